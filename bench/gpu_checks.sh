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
# SUPERPIXELS_S override the defaults below; LOOP_ARGS adds arguments to bench/loop.py. The loop's cases run the
# never-measured ones first (bench/loop.py NEVER_MEASURED: every method since the fixed shapes, GRM's own COCO
# setting, the DOCCI-length case with buckets and padded to 248), then the ones measured before (clip-248, siglip2),
# then the compiled and torch-attention variants; each case reads only its own rows, 5 + 20 loop steps and 2 + 20
# bare steps at batch 256 (the cases' own batch where they have one). The parts' limits add up to 555 s: give the
# call a 600 s timeout (docs/guides/benchmarks.md predicts what fits).
#
#   DRY_RUN=1 bash bench/gpu_checks.sh    # on the CPU: the same cases and order through the families' tiny configs
#                                         # (bench/loop.py --tiny), the GPU-only parts skipped
set -u
OUT=${OUT:-bench/results/gpu_checks}
mkdir -p "$OUT"
CASES_FIRST=lora,structxlip-pool,fastgoal,grm,flair,fcast,grm-coco,clip-docci,clip-docci-248
CASES_THEN=clip-248,siglip2,clip-248-compiled,structxlip-crop,clip-248-torch-attention,clip-77,dora
if [ -n "${DRY_RUN:-}" ]; then
  timeout "${LOOP_S:-900}" python3 bench/loop.py --device cpu --tiny --cases "${LOOP_CASES:-$CASES_FIRST,$CASES_THEN}" \
    --out "$OUT/loop_dryrun.json" ${LOOP_ARGS:-} > "$OUT/loop_dryrun.log" 2>&1
  echo "loop.py (dry run) exit $?"; grep -v "it/s\|examples/s" "$OUT/loop_dryrun.log" | grep -v "^USDT\|^ERROR" | tail -n 40
  exit 0
fi
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
  timeout "${LOOP_S:-440}" python3 bench/loop.py --device cuda --workers 8 --budget "${LOOP_BUDGET:-420}" \
    --warmup 5 --steady 20 --cases "${LOOP_CASES:-$CASES_FIRST,$CASES_THEN}" \
    --out "$OUT/loop.json" ${LOOP_ARGS:-} > "$OUT/loop.log" 2>&1
  echo "loop.py exit $?"; grep -v "it/s\|examples/s" "$OUT/loop.log" | tail -n 25
}
engines() {
  timeout "${ENGINES_S:-80}" python3 bench/engines_gpu.py --engines ${ENGINES:-fsdp2 deepspeed-zero2 deepspeed-zero3} \
    --out "$OUT/engines_gpu.json" --keep /tmp/engines > "$OUT/engines.log" 2>&1
  echo "engines_gpu.py exit $?"; tail -n 8 "$OUT/engines.log"
}
superpixels() {
  timeout "${SUPERPIXELS_S:-35}" python3 bench/superpixels.py --gpu-only --repeats 1 \
    --out "$OUT/superpixels_gpu.json" > "$OUT/superpixels.log" 2>&1
  echo "superpixels.py exit $?"; tail -n 6 "$OUT/superpixels.log"
}
for part in ${PARTS:-loop engines superpixels}; do "$part"; done
