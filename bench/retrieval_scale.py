"""Peak memory and time of cosine Recall@K at 100k x 100k in blocks (``finetune.evaluation.scorers``), against the
full-matrix computation at a size it can afford, measured in the same run; prints the ratios and writes
``bench/results/retrieval.json``.

    python bench/retrieval_scale.py [--n 100000] [--full-n 16384] [--dim 512] [--block-size 1024] [--device auto]

Each measurement runs in a fresh process, so its peak memory is its own: on CPU the growth of the peak
resident set size over the inputs (``ru_maxrss``), on CUDA ``max_memory_allocated`` over the inputs.
Embeddings are random unit vectors, one caption per image (the ranks do not depend on the values).

"Full matrix" is the computation retrieval code commonly does: the whole ``(Nt, Ni)`` similarity matrix,
then the ranks from it (wrong items at least as high as the correct one, ties against the model).
Both methods give the same Recall@K at ``--full-n`` (checked).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.files import write_json_atomic  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KS = (1, 5, 10)
GIB = 2.0 ** 30


def _inputs(n: int, dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, dim, generator=g)
    texts = images + 4.0 * torch.randn(n, dim, generator=g)  # a noisy, informative "model"
    return images.to(device), texts.to(device), torch.arange(n, device=device)


def full_matrix_recall(images: torch.Tensor, texts: torch.Tensor, owner: torch.Tensor) -> dict:
    """Recall@K from the whole ``(Nt, Ni)`` cosine matrix (the computation the blocks replace)."""
    images, texts = F.normalize(images, dim=-1), F.normalize(texts, dim=-1)
    tol = images.shape[1] * torch.finfo(images.dtype).eps
    sim = texts @ images.T  # (Nt, Ni)
    wrong = owner[:, None] != torch.arange(images.shape[0], device=images.device)[None, :]
    target = (texts * images[owner]).sum(-1)
    t_rank = ((sim >= (target - tol)[:, None]) & wrong).sum(1)
    best = torch.full((images.shape[0],), float("-inf"), device=images.device).scatter_reduce(
        0, owner, target, reduce="amax")
    i_rank = ((sim >= (best - tol)[None, :]) & wrong).sum(0)
    return {"t2i": {f"R@{k}": float((t_rank < k).double().mean() * 100) for k in KS},
            "i2t": {f"R@{k}": float((i_rank < k).double().mean() * 100) for k in KS}}


def _measure(method: str, n: int, dim: int, block_size: int, device: str, threads: int, queue: mp.Queue) -> None:
    torch.set_num_threads(threads)
    from finetune.evaluation import recall_at_k

    images, texts, owner = _inputs(n, dim, device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    if method == "blocks":
        recall = recall_at_k(images, texts, owner, KS, block_size=block_size)
    else:
        recall = full_matrix_recall(images, texts, owner)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    inputs = 2 * n * dim * 4
    queue.put({"method": method, "n": n, "seconds": seconds, "peak_extra_gib": peak / GIB,
               "inputs_gib": inputs / GIB, "peak_total_gib": (peak + inputs) / GIB, "recall": recall})


def measure(method: str, n: int, args: argparse.Namespace) -> dict:
    """Run one measurement in a fresh process and return its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(method, n, args.dim, args.block_size, args.device, args.threads, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"{method} at n={n} failed (exit code {proc.exitcode})")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="images = texts for the blocked run")
    ap.add_argument("--full-n", type=int, default=16_384, help="size the full-matrix method runs at")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    small_blocks = measure("blocks", args.full_n, args)
    small_full = measure("full", args.full_n, args)
    if small_blocks["recall"] != small_full["recall"]:
        raise SystemExit(f"the methods disagree at n={args.full_n}: {small_blocks['recall']} vs {small_full['recall']}")
    large_blocks = measure("blocks", args.n, args)
    full_bytes = args.n * args.n * 4 * 2.125  # float32 matrix + the boolean masks it compares with
    result = {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "dim": args.dim,
        "block_size": args.block_size,
        "blocks_at_full_n": small_blocks,
        "full_matrix_at_full_n": small_full,
        "blocks_at_n": large_blocks,
        "ratio_peak_extra_memory_full_vs_blocks_at_full_n": small_full["peak_extra_gib"] / max(
            small_blocks["peak_extra_gib"], 1e-9),
        "ratio_time_blocks_vs_full_at_full_n": small_blocks["seconds"] / small_full["seconds"],
        "full_matrix_at_n_would_need_gib": full_bytes / GIB,
    }
    print(f"cosine retrieval, D={args.dim}, block {args.block_size}, {result['device']}, {args.threads} threads")
    for key in ("blocks_at_full_n", "full_matrix_at_full_n", "blocks_at_n"):
        r = result[key]
        print(f"  {key:<22} n={r['n']:>7}: {r['seconds']:8.2f} s, peak {r['peak_extra_gib']:.3f} GiB above the "
              f"{r['inputs_gib']:.3f} GiB of inputs, t2i R@1 {r['recall']['t2i']['R@1']:.2f}")
    memory = result["ratio_peak_extra_memory_full_vs_blocks_at_full_n"]
    print(f"  at n={args.full_n}: full matrix / blocks peak memory {memory:.1f}x, "
          f"blocks / full matrix time {result['ratio_time_blocks_vs_full_at_full_n']:.2f}x")
    print(f"  a full matrix at n={args.n} would need about {result['full_matrix_at_n_would_need_gib']:.1f} GiB")
    write_json_atomic(RESULTS / "retrieval.json", result)


if __name__ == "__main__":
    main()
