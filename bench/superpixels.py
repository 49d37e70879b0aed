"""F-CAST's superpixels: images/s per core (and per GPU) of each way to get them, against SLIC per image, one run.

    python bench/superpixels.py                 # every case; a GPU case runs where torch sees CUDA
    python bench/superpixels.py --gpu-only      # the GPU case alone (SFCN batched on cuda) and its CPU baseline

Prints each case's rate and its ratio to the baseline, and writes ``bench/results/superpixels.json``
(``superpixels_gpu.json`` with ``--gpu-only``). Every case
runs in a fresh Python process (``--case NAME``) with one CPU thread (``torch.set_num_threads(1)``,
``OMP_NUM_THREADS=1``), as a data-loader worker does: its images/s is per core. The cases are interleaved over
``--repeats`` and each rate is the median; images per CPU-second of the process is reported beside the wall rate
(on a machine shared with other work the CPU rate is the steadier of the two).

Images: real photographs that scikit-image ships (astronaut, coffee, chelsea, rocket, ...), as JPEG 512 x 384 like
CC3M's, cut to the encoder's 224 x 224 view (:func:`finetune.preprocess.superpixels.encoder_view`); 196 segments.

Cases (superpixel work per image unless said otherwise):

- ``slic``: scikit-image SLIC on one image (the default method, computed on the fly by today's data workers): the
  baseline of every ratio;
- ``seeds``: OpenCV SEEDS with CAST's settings (needs ``opencv-contrib-python-headless``; skipped without it);
- ``sfcn``: SFCN (F-CAST's method) on one image on the CPU;
- ``sfcn_batch``: SFCN on ``--batch`` images in one forward on the CPU;
- ``sfcn_batch_cuda``: SFCN on ``--gpu-batch`` images in one forward on the GPU, host copies included: images/s
  per GPU (with one CPU core feeding it), and whether its labels equal the CPU's per image; skipped without CUDA;
- ``precomputed``: reading a ``KEY.superpixels.png`` entry written by ``xlipkit superpixels`` (PNG decode and the
  settings check), what a worker does instead;
- ``stream_slic`` / ``stream_precomputed``: one data worker end to end (webdataset JPEG decode, checks, the F-CAST
  term's sub-captions and tokenizer, the model's 224 px preprocessing, collation; batches of 16), on the original
  shards (SLIC computed) and on the shards ``xlipkit superpixels`` wrote (read back).

SFCN's weights are random (the authors' checkpoint cannot be downloaded here): the network's cost does not depend on
its weights, its labels do.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results" / "superpixels.json"
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "cat")
SIDE, SEGMENTS = 224, 196
BASELINE = "slic"
CPU_CASES = ("slic", "seeds", "sfcn", "sfcn_batch", "precomputed", "stream_slic", "stream_precomputed")


# ------------------------------------------------------------------------------------------ data
def _jpegs(n: int) -> list[bytes]:
    """``n`` JPEG files (512 x 384, quality 90) cycling through scikit-image's photographs."""
    import PIL.Image
    import skimage.data

    out = []
    for i in range(n):
        photo = PIL.Image.fromarray(getattr(skimage.data, PHOTOS[i % len(PHOTOS)])()).convert("RGB")
        if i >= len(PHOTOS):  # not the very same image again: another crop of it
            w, h = photo.size
            dx, dy = (i * 17) % max(1, w // 8), (i * 11) % max(1, h // 8)
            photo = photo.crop((dx, dy, w - (w // 8 - dx), h - (h // 8 - dy)))
        buf = io.BytesIO()
        photo.resize((512, 384), PIL.Image.BICUBIC).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _views(n: int) -> list:
    from finetune.data.images import read_image
    from finetune.preprocess.superpixels import encoder_view

    return [encoder_view(read_image(j), SIDE) for j in _jpegs(n)]


def _sfcn_weights(folder: Path) -> str:
    import torch
    from safetensors.torch import save_file

    from finetune.preprocess.superpixels import SpixelNet

    torch.manual_seed(0)
    path = folder / "sfcn_random.safetensors"
    save_file({k: v.contiguous() for k, v in SpixelNet().state_dict().items()}, str(path))
    return str(path)


def _write_shards(folder: Path, jpegs: list[bytes]) -> str:
    """Webdataset shards (4) of the JPEGs with ``KEY.json`` captions of several sentences; returns the pattern."""
    from finetune.data.synthetic import synthetic_scenes

    n = len(jpegs)
    captions = [r["caption"] for r in synthetic_scenes(n, 0, image_size=32)]
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // 4)
    for s in range(4):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for k in range(s * per, min(n, (s + 1) * per)):
                for ext, data in (("jpg", jpegs[k]), ("json", json.dumps({"caption": captions[k]}).encode())):
                    info = tarfile.TarInfo(f"{k:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / "{00000..00003}.tar")


# ------------------------------------------------------------------------------------------ cases
def _timed(fn, images: int) -> dict:
    fn()  # warm-up: imports, the network's first call
    wall, cpu = time.perf_counter(), time.process_time()
    done = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = done or images
    return {"images": done, "seconds": round(wall, 4), "cpu_seconds": round(cpu, 4),
            "images_per_s": round(done / wall, 2), "images_per_cpu_s": round(done / cpu, 2) if cpu else None}


def run_case(name: str, args: argparse.Namespace) -> dict:
    """One case in this process (one CPU thread); returns its measurements."""
    import torch

    from finetune.preprocess import superpixels as sp

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_superpixels_"))
    n = args.images
    if name == "slic":
        views, settings = _views(n), sp.SuperpixelSettings("slic", SEGMENTS)
        return _timed(lambda: [sp.compute_superpixels(v, settings) for v in views] and None, n)
    if name == "seeds":
        import cv2

        if not hasattr(cv2, "ximgproc"):
            return {"skipped": "OpenCV without cv2.ximgproc (pip install opencv-contrib-python-headless)"}
        views, settings = _views(n), sp.SuperpixelSettings("seeds", SEGMENTS)
        return _timed(lambda: [sp.compute_superpixels(v, settings) for v in views] and None, n)
    if name in ("sfcn", "sfcn_batch", "sfcn_batch_cuda"):
        settings = sp.SuperpixelSettings("sfcn", SEGMENTS, checkpoint=_sfcn_weights(tmp))
        if name == "sfcn":
            views = _views(n)
            return _timed(lambda: [sp.compute_superpixels(v, settings) for v in views] and None, n)
        if name == "sfcn_batch":
            views = _views(args.batch)
            batches = max(1, n // args.batch)
            return _timed(lambda: [sp.compute_superpixels_batch(views, settings) for _ in range(batches)] and
                          batches * args.batch, batches * args.batch)
        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device"}
        views = _views(args.gpu_batch)
        batches = args.gpu_batches

        def gpu() -> int:
            for _ in range(batches):
                sp.compute_superpixels_batch(views, settings, device="cuda")  # labels back on the host
            torch.cuda.synchronize()
            return batches * args.gpu_batch

        out = _timed(gpu, batches * args.gpu_batch)
        check = min(16, args.gpu_batch)
        on_gpu = sp.compute_superpixels_batch(views[:check], settings, device="cuda")
        same = [bool((on_gpu[i] == sp.compute_superpixels(views[i], settings)).all()) for i in range(check)]
        pixels = sum(float((on_gpu[i] == sp.compute_superpixels(views[i], settings)).mean()) for i in range(check))
        out.update(device=torch.cuda.get_device_name(0), batch=args.gpu_batch,
                   images_equal_to_cpu_per_image=f"{sum(same)}/{check}",
                   pixels_equal_to_cpu_per_image=round(pixels / check, 6))
        return out
    if name == "precomputed":
        views, settings = _views(n), sp.SuperpixelSettings("slic", SEGMENTS)
        stamp = sp.settings_stamp(settings, SIDE)
        entries = [sp.encode_entry(sp.compute_superpixels(v, settings), stamp) for v in views]
        out = _timed(lambda: [sp.decode_entry(e, stamp) for e in entries] and None, n)
        out["entry_bytes_mean"] = round(statistics.mean(len(e) for e in entries))
        return out
    if name in ("stream_slic", "stream_precomputed"):
        return _stream_case(name, args, tmp)
    raise SystemExit(f"unknown case {name!r}")


def _stream_case(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from dataclasses import asdict

    from finetune import load_model
    from finetune.cli.superpixels import ShardJob, write_shard
    from finetune.data.collate import Collator
    from finetune.data.streams import ExampleStream, expand_urls, open_stream
    from finetune.objectives.base import Objective
    from finetune.objectives.fcast import FCastOptions
    from finetune.objectives.registry import build_term
    from finetune.preprocess.superpixels import settings_stamp

    urls = _write_shards(tmp / "shards", _jpegs(args.stream_images))
    model = load_model("random:fcast-b", family="fcast")  # CAST-B: 224 px, 196 SLIC superpixels
    term, _ = build_term("fcast", FCastOptions())
    objective = Objective(None, [(term, 1.0)])
    objective.prepare_model(model)
    if name == "stream_precomputed":
        stamp = settings_stamp(model.superpixels, model.image_size)
        (tmp / "out").mkdir()
        for src in expand_urls(urls):
            write_shard(ShardJob(src, str(tmp / "out" / Path(src).name), asdict(model.superpixels),
                                 model.image_size, stamp, "image"))
        urls = str(tmp / "out" / "{00000..00003}.tar")
    spec = {"name": "webdataset", "urls": urls, "shuffle_buffer": 0}
    collate = Collator(model, objective)
    batch_size = 16

    def worker() -> int:
        stream = ExampleStream(open_stream(spec), spec, on_error="raise",
                               transform=lambda e: objective.stream_map(e, model))
        it, batch, done = iter(stream), [], 0
        for _ in range(args.stream_images):
            batch.append(next(it))
            if len(batch) == batch_size:
                out = collate(batch)
                assert out["image_inputs"]["superpixels"].shape == (batch_size, 224, 224)
                done += batch_size
                batch = []
        return done

    return _timed(worker, args.stream_images)


# ------------------------------------------------------------------------------------------ driver
def _one(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", name, "--images", str(args.images),
           "--batch", str(args.batch), "--gpu-batch", str(args.gpu_batch), "--gpu-batches", str(args.gpu_batches),
           "--stream-images", str(args.stream_images)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--images", type=int, default=24, help="images per timed pass of a per-image case")
    p.add_argument("--batch", type=int, default=32, help="SFCN batch on the CPU")
    p.add_argument("--gpu-batch", type=int, default=256, help="SFCN batch on the GPU")
    p.add_argument("--gpu-batches", type=int, default=20, help="timed GPU batches")
    p.add_argument("--stream-images", type=int, default=64, help="examples of the end-to-end worker cases")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-only", action="store_true", help="the GPU case and the baseline only")
    p.add_argument("--out", default=None,
                   help=f"results file (default {RESULTS.name}; with --gpu-only superpixels_gpu.json beside it)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(RESULTS.with_name("superpixels_gpu.json") if args.gpu_only else RESULTS)
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return {}
    cases = (BASELINE, "sfcn", "sfcn_batch_cuda") if args.gpu_only else (*CPU_CASES, "sfcn_batch_cuda")
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    load_before = os.getloadavg()
    for r in range(args.repeats):
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for case in order:
            runs[case].append(_one(case, args))
            print(f"repeat {r}: {case}: {runs[case][-1]}", flush=True)
    base = runs[BASELINE]
    base_wall = statistics.median(x["images_per_s"] for x in base)
    base_cpu = statistics.median(x["images_per_cpu_s"] for x in base)
    summary = {}
    for case, results in runs.items():
        if any("skipped" in x for x in results):
            summary[case] = {"skipped": results[0]["skipped"]}
            continue
        wall = statistics.median(x["images_per_s"] for x in results)
        cpu = statistics.median(x["images_per_cpu_s"] for x in results)
        summary[case] = {"images_per_s": wall, "images_per_cpu_s": cpu, "ratio_to_slic": round(wall / base_wall, 2),
                         "cpu_ratio_to_slic": round(cpu / base_cpu, 2),
                         **{k: v for k, v in results[-1].items() if k not in ("images", "seconds", "cpu_seconds",
                                                                              "images_per_s", "images_per_cpu_s")}}
    import cv2
    import torch

    result = {
        "what": "superpixel work per 224 px image (196 segments), one CPU thread per process, a fresh process per "
                "case; images/s per core (wall) and per CPU-second, medians of the repeats, ratios to SLIC per image "
                "measured in the same run",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_average_1min": {"before": round(load_before[0], 1), "after": round(os.getloadavg()[0], 1)},
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "opencv": f"{cv2.__version__}{' contrib' if hasattr(cv2, 'ximgproc') else ''} ({cv2.__file__})"},
        "settings": {"images": args.images, "batch": args.batch, "gpu_batch": args.gpu_batch,
                     "stream_images": args.stream_images, "repeats": args.repeats},
        "cases": summary,
        "runs": runs,
    }
    width = max(len(c) for c in summary)
    for case, s in summary.items():
        if "skipped" in s:
            print(f"{case:{width}s}  skipped: {s['skipped']}")
        else:
            print(f"{case:{width}s}  {s['images_per_s']:9.1f} images/s  {s['images_per_cpu_s']:9.1f} per CPU-s  "
                  f"x{s['ratio_to_slic']:.2f} of SLIC per image (CPU x{s['cpu_ratio_to_slic']:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
