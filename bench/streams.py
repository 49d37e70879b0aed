"""Samples/s of a streamed ``data.train`` read by 0, 1 and 2 DataLoader workers (``data.num_workers``).

Run ``python bench/streams.py``: prints the numbers and writes ``bench/results/streams.json``.

The data path of the clip recipes at 224 px, without a model: webdataset shards of JPEG images (512 x 384, as
CC3M's) and ~60-word captions, read by :class:`finetune.data.streams.StreamLoader` (one process), each example
decoded and checked by :class:`~finetune.data.streams.ExampleStream`, each batch collated by
:class:`finetune.data.collate.Collator` with OpenAI CLIP's image processor (shortest side to 224 bicubic,
centre crop, normalise: ``transformers.CLIPImageProcessor()``'s defaults) and the CLIP BPE tokenizer at 77
tokens. ``0`` workers is what streams did before (read in the training process).

Settings are interleaved (0, 1, 2 workers, then 1, 2, 0, ...) and repeated, each timed over ``--batches``
batches after the workers' first batches (start-up excluded); the ratios are medians of each repetition's
ratio, measured in the same run. The machine this ran on is shared, so absolute numbers move with its load.

Linux's autogroup scheduler (``/proc/sys/kernel/sched_autogroup_enabled``) shares the CPU between sessions,
not processes: on a machine busy with other sessions, all the workers of one launch together get about one
session's share, so adding a worker adds little. The settings marked ``own session`` start each worker in a
session of its own (``os.setsid`` in ``worker_init_fn``), which gives each worker the share a worker gets on
a machine of its own; their ratio shows whether the data path itself scales (no step serialised in the
training process). On a quiet machine the two kinds of setting agree.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results" / "streams.json"


def write_shards(folder: Path, n: int, per_shard: int) -> str:
    """``n`` synthetic scenes as JPEG (512 x 384) + caption webdataset shards; returns the url pattern."""
    import PIL.Image

    from finetune.data.synthetic import synthetic_scenes

    scenes = synthetic_scenes(n, 0, image_size=384)
    shards = -(-n // per_shard)
    for s in range(shards):
        with tarfile.open(folder / f"shard-{s:05d}.tar", "w") as tar:
            for k in range(s * per_shard, min(n, (s + 1) * per_shard)):
                row = scenes[k]
                buf = io.BytesIO()
                row["image"].convert("RGB").resize((512, 384), PIL.Image.BICUBIC).save(buf, "JPEG", quality=90)
                for ext, data in (("jpg", buf.getvalue()), ("txt", row["caption"].encode())):
                    info = tarfile.TarInfo(f"{row['id']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / f"shard-{{00000..{shards - 1:05d}}}.tar")


def clip_collator():
    """A :class:`Collator` with CLIP's 224-px image processor and the CLIP tokenizer (77 tokens)."""
    from transformers import CLIPImageProcessor

    from finetune.data.collate import Collator
    from finetune.models.registry import build_model

    tokenizer_model = build_model("tiny-clip")  # the real CLIP BPE tokenizer, built offline
    processor = CLIPImageProcessor()

    def preprocess_images(images):
        return {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}

    return Collator(SimpleNamespace(preprocess_images=preprocess_images, tokenize=tokenizer_model.tokenize))


def _own_session(worker_id: int) -> None:
    os.setsid()


def rate(urls: str, workers: int, batch_size: int, batches: int, collate, own_session: bool = False) -> float:
    """Samples/s of ``batches`` batches from a fresh loader with ``workers`` workers, after each worker's
    first two batches (``own_session``: each worker in a scheduling session of its own)."""
    from finetune.data.streams import ExampleStream, StreamLoader, open_stream

    spec = {"name": "webdataset", "urls": urls, "seed": 0}
    loader = StreamLoader(ExampleStream(open_stream(spec), spec), batch_size=batch_size, collate_fn=collate,
                          num_workers=workers, prefetch_factor=2)
    if own_session:
        loader.loader.worker_init_fn = _own_session
    it = iter(loader)
    for _ in range(2 * max(1, workers)):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
    elapsed = time.perf_counter() - start
    assert batch["image_inputs"]["pixel_values"].shape == (batch_size, 3, 224, 224)
    del it, loader
    return batches * batch_size / elapsed


def _name(workers: int, own_session: bool) -> str:
    return f"{workers} worker{'s' if workers != 1 else ''}" + (", own session" if own_session else "")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=12, help="timed batches per measurement")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)  # as in DataLoader workers: the comparison is processes, not intra-op threads
    settings = ((0, False), (1, False), (2, False), (1, True), (2, True))
    rates: dict[tuple[int, bool], list[float]] = {w: [] for w in settings}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        n = (2 + args.batches) * args.batch_size * 2 + 64  # every measurement stays inside epoch 0
        urls = write_shards(Path(tmp), n, per_shard=max(1, n // 16))
        collate = clip_collator()
        rate(urls, 2, args.batch_size, 2, collate)  # warm the file cache and imports
        for r in range(args.repeats):
            order = settings[r % len(settings):] + settings[: r % len(settings)]
            for w, own in order:
                rates[w, own].append(rate(urls, w, args.batch_size, args.batches, collate, own))
                print(f"repeat {r}: {_name(w, own)}: {rates[w, own][-1]:.1f} samples/s", flush=True)
    ratio_2_1 = [b / a for a, b in zip(rates[1, False], rates[2, False])]
    ratio_2_1_own = [b / a for a, b in zip(rates[1, True], rates[2, True])]
    ratio_1_0 = [b / a for a, b in zip(rates[0, False], rates[1, False])]
    result = {
        "what": "stream data path alone (webdataset JPEG 512x384 -> decode, check, CLIP 224 px processor, CLIP "
                "tokenizer at 77): samples/s with data.num_workers 0, 1, 2 in one process",
        "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "torch": torch.__version__,
                    "load_average_1min": {"before": round(load_before[0], 1), "after": round(os.getloadavg()[0], 1)}},
        "batch_size": args.batch_size, "batches_per_measurement": args.batches, "repeats": args.repeats,
        "autogroup_scheduler": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1",
        "samples_per_s": {_name(*w): [round(v, 1) for v in rates[w]] for w in settings},
        "median_samples_per_s": {_name(*w): round(statistics.median(rates[w]), 1) for w in settings},
        "ratio_2_workers_over_1": {"median": round(statistics.median(ratio_2_1), 2),
                                   "per_repeat": [round(v, 2) for v in ratio_2_1]},
        "ratio_2_workers_over_1_own_sessions": {"median": round(statistics.median(ratio_2_1_own), 2),
                                                "per_repeat": [round(v, 2) for v in ratio_2_1_own]},
        "ratio_1_worker_over_0": {"median": round(statistics.median(ratio_1_0), 2),
                                  "per_repeat": [round(v, 2) for v in ratio_1_0]},
        "note": "1 worker is slower than reading in the training process because every batch's float32 pixels "
                "(16 x 3 x 224 x 224 = 9.6 MB) are copied into shared memory to reach it; with uint8 pixels or a "
                "small batch output the two match (measured separately on this machine)",
    }
    print(f"2 workers / 1 worker: {result['ratio_2_workers_over_1']['median']:.2f}x in one session, "
          f"{result['ratio_2_workers_over_1_own_sessions']['median']:.2f}x with a session per worker (medians of "
          f"{args.repeats}); 1 worker / training process: {result['ratio_1_worker_over_0']['median']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
