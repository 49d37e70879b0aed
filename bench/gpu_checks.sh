#!/usr/bin/env bash
# The GPU checks in one command, for one lent H100/H200 (16 cores) with no network: the training loop against
# the bare step (bench/loop.py), DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 through accelerate (bench/engines_gpu.py)
# and SFCN superpixels batched on the GPU (bench/superpixels.py --gpu-only). Each part has a time limit of its
# own and writes what it finished, so a cut-off part keeps its results and the next part still runs.
#
#   ../shared/tools/gpu-wheels.sh torchdata hjson tokenizers   # here, once: .whl/ holds what the image lacks
#   # plus a deepspeed wheel built here (pure Python): DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed
#   bash bench/gpu_checks.sh                                   # there, with .whl carried; results in $OUT
#
# PARTS (default: loop engines superpixels, in that order), LOOP_CASES, LOOP_BUDGET, LOOP_S, ENGINES, ENGINES_S and
# SUPERPIXELS_S override the defaults below; LOOP_ARGS adds arguments to bench/loop.py.
set -u
OUT=${OUT:-bench/results/gpu_checks}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; nproc
  python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

loop() {
  timeout "${LOOP_S:-290}" python3 bench/loop.py --device cuda --workers 8 --budget "${LOOP_BUDGET:-270}" \
    --cases "${LOOP_CASES:-clip-248,siglip2,clip-248-torch-attention,clip-248-compiled,structxlip-pool}" \
    --out "$OUT/loop.json" ${LOOP_ARGS:-} > "$OUT/loop.log" 2>&1
  echo "loop.py exit $?"; grep -v "it/s\|examples/s" "$OUT/loop.log" | tail -n 25
}
engines() {
  timeout "${ENGINES_S:-150}" python3 bench/engines_gpu.py --engines ${ENGINES:-fsdp2 deepspeed-zero2 deepspeed-zero3} \
    --out "$OUT/engines_gpu.json" --keep /tmp/engines > "$OUT/engines.log" 2>&1
  echo "engines_gpu.py exit $?"; tail -n 8 "$OUT/engines.log"
}
superpixels() {
  timeout "${SUPERPIXELS_S:-45}" python3 bench/superpixels.py --gpu-only --repeats 1 \
    --out "$OUT/superpixels_gpu.json" > "$OUT/superpixels.log" 2>&1
  echo "superpixels.py exit $?"; tail -n 6 "$OUT/superpixels.log"
}
for part in ${PARTS:-loop engines superpixels}; do "$part"; done
