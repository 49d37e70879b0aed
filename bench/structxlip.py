"""What StructXLIP costs per training step, and how fast its preprocessing runs, measured in one run.

    python bench/structxlip.py [--batch 8] [--k 3] [--rounds 4] [--steps 1] [--model random:clip-vit-base-patch16]
                               [--threads N] [--modes clip structxlip_crop structxlip_pool public_code]
                               [--skip-preprocess]

On the same model (CLIP ViT-B/16 with random weights from the registry, text stretched to 248 positions) and
the same data (``--batch`` images with DOCCI-style captions that fill the 248 positions), it times one
training step (forward, backward, fused AdamW step) of:

- ``clip``: the plain CLIP step (InfoNCE on B images and B captions);
- ``structxlip_crop``: clip + the ``structxlip`` term with ``regions.encode: crop`` (the paper: 2B + B*K
  images in one image-tower pass, captions, filtered captions, chunks padded to the longest chunk);
- ``structxlip_pool``: the same with ``regions.encode: pool`` (our extension: 2B images, regions pooled from
  the edge maps' patch states);
- ``public_code``: the StructXLIP public code's step as its source does it (``train.py`` L164-246,
  ``losses.py``): the lexicon filter and the tokenisation of the filtered captions inside the step, one call
  of the transformers ``CLIPModel`` forward (not xlipkit's model layer, and with the stock transformers
  modules: xlipkit's fused QuickGELU MLPs are switched back for this step) over [B images | B edge maps | B*K
  crops] and [B captions | B filtered captions] padded to 248 tokens without an attention mask and with
  ``output_hidden_states=True``, the public chunks (sliding word windows, up to 64 a caption) pooled from
  the caption's token states in a per-sample loop, the same four losses, backward.

All modes run over ONE model in one process, interleaved: after a warm-up step of each, ``--rounds`` rounds
of ``--steps`` steps of every mode in turn; each mode keeps its best step, so that load from other processes
on a shared machine (which comes and goes) hits every mode alike and does not decide a ratio. Process CPU
time per step is recorded beside wall-clock time, and so is the crop / public-code ratio of every round (the
two run back to back, under the same load) with its median. Peak memory is measured apart: each mode alone
in a fresh process, its resident memory after building the model and optimiser and its peak (``ru_maxrss``)
over one step. The preprocessing part reuses ``bench/preprocess_throughput.py``: lexicon-filter captions/s
on 20,000 DOCCI-length captions and Canny images/s at 224 x 224 and 1024 x 768. Results go to
``bench/results/structxlip.json``; ratios compare numbers of this run only.

Targets (the issue): crop mode no slower than the public code's step; pool mode at most 2.3 x the plain
step; the lexicon filter above 15,000 captions/s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results" / "structxlip.json"
MODES = ("clip", "structxlip_crop", "structxlip_pool", "public_code")


class _OptimCfg:
    lr = 5e-6
    weight_decay = 0.05
    betas = (0.9, 0.98)
    eps = 1e-6
    fused_optimizer = "auto"


def docci_style_captions(n: int, *, words: int = 210, seed: int = 0) -> list[str]:
    """DOCCI-length captions (``preprocess_throughput.docci_like_captions``) whose sentences are joined two
    by two, so that a sentence has about 20 words as in DOCCI (136 words in 7.1 sentences, FLAIR Tab. 6);
    ``words`` = 210 fills the 248 text positions of CLIP's tokenizer."""
    from preprocess_throughput import docci_like_captions

    out = []
    for caption in docci_like_captions(n, words=words, seed=seed):
        count = iter(range(10_000))
        out.append(re.sub(r"[.;](?= )", lambda m: "," if next(count) % 2 == 0 else m.group(), caption))
    return out


def _images(n: int, seed: int = 0) -> list[Any]:
    from preprocess_throughput import _natural_like

    return [_natural_like(480, 640, seed + i) for i in range(n)]


def _dataset(batch: int) -> Any:
    import datasets

    captions = docci_style_captions(batch)
    features = datasets.Features({"id": datasets.Value("string"), "image": datasets.Image(),
                                  "caption": datasets.Value("string")})
    return datasets.Dataset.from_dict(
        {"id": [f"bench-{i}" for i in range(batch)], "image": _images(batch), "caption": captions}, features=features)


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def _build(args: argparse.Namespace, cache_dir: str, modes: list[str]) -> tuple[Any, dict, dict]:
    """One model and, for every mode, ``(module, batch)`` over it; the preprocessing is cached in ``cache_dir``.

    Returns:
        ``(model, {mode: (module, batch)}, info about the batch)``.
    """
    from finetune import load_model
    from finetune.data.collate import Collator
    from finetune.objectives import ClipTerm, Objective
    from finetune.objectives.structxlip import RegionOptions, StructXLIPOptions, StructXLIPTerm
    from finetune.training import TrainModule

    torch.manual_seed(0)
    model = load_model(args.model, max_text_len=248)
    dataset = _dataset(args.batch)
    terms, batches = {}, {}
    for encode in ("crop", "pool"):
        term = StructXLIPTerm(StructXLIPOptions(regions=RegionOptions(k=args.k, per_image=args.k, encode=encode)))
        data = term.preprocess(dataset, model, cache_dir=cache_dir)
        terms[encode] = term
        batches[encode] = Collator(model, Objective(ClipTerm(), [(term, term.weights)]))(
            [data[i] for i in range(args.batch)])
    crop = batches["crop"]
    sx = crop["structxlip"]
    info = {
        "caption_tokens": crop["attention_mask"].sum(1).tolist(),
        "filtered_caption_tokens": sx["filtered_attention_mask"].sum(1).tolist(),
        "chunks": sum(t.shape[0] for t in sx["chunk_input_ids"]),
        "chunk_tokens": torch.cat(sx["chunk_attention_mask"]).sum(1).tolist(),
        "regions": sum(t.shape[0] for t in sx["region_slot"]),
    }
    modules: dict[str, tuple[Any, dict]] = {}
    for mode in modes:
        if mode == "clip":
            modules[mode] = (TrainModule(model, Objective(ClipTerm())), crop)
        elif mode == "public_code":
            modules[mode] = (_PublicCodeStep(model, crop, list(dataset["caption"][:args.batch])), crop)
            info["public_code_chunks"] = modules[mode][0].n_spans
        else:
            encode = mode.split("_")[1]
            term = terms[encode]
            modules[mode] = (TrainModule(model, Objective(ClipTerm(), [(term, term.weights)])), batches[encode])
    return model, modules, info


class _PublicCodeStep(torch.nn.Module):
    """The public code's training step as its source does it (``structxlip/train.py`` L164-246 and
    ``losses.py``, read from the notes and the code): inside the step the captions are lexicon-filtered and the
    filtered ones tokenised to 248 tokens; ONE call of the transformers ``CLIPModel`` forward over
    [B images | B edge maps | B*K crops] and [B captions | B filtered captions], both padded to 248 tokens with
    no attention mask and ``output_hidden_states=True``; then, per sample, the public chunks (2-6-word sliding
    windows with stride 1 inside clauses split at ``[.,;!?]``, at most 64 per caption, token spans from the
    tokenizer's offsets), each chunk embedding = softmax(||h||)-weighted token states over its span (weights
    without gradient), ``final_layer_norm`` and ``text_projection`` again, and the local loss against every
    crop of the batch; the four losses with the public weights (main scale detached for L_I'T', local scale
    min(s / 0.07, 100)) and ε = 1e-8 before every normalisation. Its per-step debug statistics are left out.
    Nothing of it goes through xlipkit's model layer: the transformers model is called directly."""

    WINDOW, MAX_SPANS, EPS = 3, 64, 1e-8

    def __init__(self, model: Any, batch: dict, captions: list[str]) -> None:
        super().__init__()
        from preprocess_throughput import PublicStyleFilter

        self.hf = model.model
        self.tokenizer = model.tokenizer
        self.filter = PublicStyleFilter()
        self.captions = list(captions)
        sx = batch["structxlip"]
        self.b = len(self.captions)
        self.k = sx["region_inputs"]["pixel_values"][0].shape[0]
        crops = torch.cat(sx["region_inputs"]["pixel_values"])
        self.pixels = torch.cat([batch["image_inputs"]["pixel_values"], sx["edge_inputs"]["pixel_values"], crops])
        self.caption_ids = self._tokenize(self.captions)  # the public data loader's tokenised captions
        self.n_spans = sum(len(self.spans(self.filter(c))) for c in self.captions)

    def _tokenize(self, texts: list[str]) -> Tensor:
        return self.tokenizer(texts, padding="max_length", truncation=True, max_length=248,
                              return_tensors="pt").input_ids

    def spans(self, caption: str) -> list[tuple[int, int]]:
        """Token spans ``[start, end)`` of the public chunks of ``caption``."""
        enc = self.tokenizer(caption, return_offsets_mapping=True)
        words = list(re.finditer(r"\b\w+\b", caption))
        clauses, begin = [], 0
        for punct in re.finditer(r"[.,;!?]+", caption):
            clauses.append(punct.end())
            begin = punct.end()
        if begin < len(caption):
            clauses.append(len(caption))
        out: list[tuple[int, int]] = []
        w = 0
        for clause_end in clauses:
            first = w
            while w < len(words) and words[w].start() < clause_end:
                w += 1
            n = w - first
            if n <= 0:
                continue
            size = next(s for limit, s in ((4, 2), (10, self.WINDOW), (20, self.WINDOW + 1), (40, self.WINDOW + 2),
                                           (10**9, self.WINDOW + 3)) if n <= limit)
            for i in range(first, w - size + 1):
                start, end = enc.char_to_token(words[i].start()), enc.char_to_token(words[i + size - 1].end() - 1)
                if start is not None and end is not None and end >= start:
                    out.append((start, end + 1))
                if len(out) >= self.MAX_SPANS:
                    return out
        return out

    def forward(self, batch: dict) -> dict:
        import torch.nn.functional as F

        from finetune.models.backends.activations import use_fast_quick_gelu

        b, k, eps = self.b, self.k, self.EPS
        filtered = [self.filter(c) for c in self.captions]
        ids = torch.cat([self.caption_ids, self._tokenize(filtered)])
        use_fast_quick_gelu(self.hf, fast=False)  # the stock transformers modules, as the public code runs them
        try:
            out = self.hf(pixel_values=self.pixels, input_ids=ids, output_hidden_states=True, return_dict=True)
        finally:
            use_fast_quick_gelu(self.hf)
        image, text = out.image_embeds, out.text_embeds
        img, edge, crops = image[:b], image[b:2 * b], image[2 * b:]
        cap, fil = text[:b], text[b:]
        tokens = out.text_model_output.last_hidden_state[:b]
        scale = self.hf.logit_scale.exp()

        def nce(x: Tensor, y: Tensor, s: Tensor) -> Tensor:
            logits = s * F.normalize(x + eps, dim=-1) @ F.normalize(y + eps, dim=-1).t()
            target = torch.arange(x.shape[0])
            return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2

        consistency = F.cosine_embedding_loss(F.normalize(img + eps, dim=-1), F.normalize(edge + eps, dim=-1),
                                              torch.ones(b))
        crops_n = F.normalize(crops + eps, dim=-1)
        local, items = torch.zeros(()), 0
        for i in range(b):
            spans = self.spans(filtered[i])
            pooled = []
            for s, e in spans:
                h = tokens[i, s:e]
                with torch.no_grad():
                    w = torch.softmax(h.norm(dim=-1), dim=0)
                pooled.append((h * w[:, None]).sum(0))
            if not pooled:
                continue
            chunks = self.hf.text_projection(self.hf.text_model.final_layer_norm(torch.stack(pooled)))
            sim = (scale / 0.07).clamp(max=100) * (F.normalize(chunks + eps, dim=-1) @ crops_n.t())
            positive = torch.zeros(b * k, dtype=torch.bool)
            positive[i * k:(i + 1) * k] = True
            log_pos = torch.logsumexp(sim.masked_fill(~positive, torch.finfo(sim.dtype).min), dim=1)
            local = local - (log_pos - torch.logsumexp(sim, dim=1)).mean()
            items += 1
        loss = (nce(img, cap, scale) + 0.25 * nce(edge, fil, scale.detach()) + 0.001 * consistency
                + 0.001 * local / max(items, 1))
        return {"loss": loss}


def _step(module: Any, batch: dict, optimizer: Any) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    out = module(batch)
    out["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - start_cpu


def _timing_worker(args: argparse.Namespace, cache_dir: str, queue: Any) -> None:
    """Every mode over ONE model in one process, interleaved: rounds of one step of each mode in turn, so
    that load from other processes hits all modes alike; each mode keeps its best step."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from finetune.training import build_optimizer

    _, modules, info = _build(args, cache_dir, list(args.modes))
    optimizer = build_optimizer(torch.nn.ModuleList([m for m, _ in modules.values()]), _OptimCfg())
    for module, batch in modules.values():  # warm-up
        _step(module, batch, optimizer)
    wall: dict[str, list[float]] = {m: [] for m in modules}
    cpu: dict[str, list[float]] = {m: [] for m in modules}
    for round_ in range(args.rounds):
        for mode, (module, batch) in modules.items():
            for _ in range(args.steps):
                w, c = _step(module, batch, optimizer)
                wall[mode].append(w)
                cpu[mode].append(c)
            print(f"  round {round_ + 1} {mode:16s} {wall[mode][-1]:7.2f} s/step wall, {cpu[mode][-1]:7.2f} s CPU",
                  flush=True)
    queue.put({
        "info": info,
        "threads": torch.get_num_threads(),
        "modes": {m: {"seconds_per_step": min(wall[m]), "cpu_seconds_per_step": min(cpu[m]),
                      "all_seconds_per_step": wall[m], "all_cpu_seconds_per_step": cpu[m],
                      "samples_per_s": args.batch / min(wall[m])} for m in modules},
    })


def _memory_worker(mode: str, args: argparse.Namespace, cache_dir: str, queue: Any) -> None:
    """One mode alone in a fresh process: resident memory after setup and the peak over one step."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from finetune.training import build_optimizer

    _, modules, _ = _build(args, cache_dir, [mode])
    module, batch = modules[mode]
    optimizer = build_optimizer(module, _OptimCfg())
    setup = _rss_gb()
    _step(module, batch, optimizer)
    queue.put({"rss_after_setup_gb": setup, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})


def _in_process(target: Any, *args: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def step_costs(args: argparse.Namespace) -> dict:
    """Seconds per step of every mode (interleaved in one process, see :func:`_timing_worker`) and the peak
    memory of each (alone in a fresh process, see :func:`_memory_worker`)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        timing = _in_process(_timing_worker, args, cache_dir)
        out = {"batch_contents": timing["info"], "threads": timing["threads"]}
        for mode in args.modes:
            memory = _in_process(_memory_worker, mode, args, cache_dir)
            out[mode] = {**timing["modes"][mode], **memory}
            print(f"  {mode:16s} best {out[mode]['seconds_per_step']:7.2f} s/step wall, "
                  f"{out[mode]['cpu_seconds_per_step']:7.2f} s CPU; peak RSS {memory['peak_rss_gb']:5.1f} GB",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:clip-vit-base-patch16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1, help="timed steps of a mode per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of interleaved steps; a mode keeps its best step")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the step processes (default: torch's)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--skip-preprocess", action="store_true", help="skip the lexicon and Canny throughput part")
    ap.add_argument("--lexicon-captions", type=int, default=20000)
    args = ap.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    print(f"{args.model}, batch {args.batch}, K = {args.k}, 248 text positions, {threads} threads")
    costs = step_costs(args)
    steps = {m: costs[m] for m in args.modes}
    result: dict[str, Any] = {
        "model": args.model, "batch": args.batch, "k": args.k, "steps": args.steps, "rounds": args.rounds,
        "text_positions": 248,
        "device": "cpu", "threads": costs["threads"], "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "batch_contents": costs["batch_contents"],
        "step": steps,
    }
    def ratios_of(key: str) -> dict[str, float]:
        ratios = {}
        if "clip" in steps:
            ratios.update({f"{m}_vs_clip": steps[m][key] / steps["clip"][key] for m in steps if m != "clip"})
        if "public_code" in steps and "structxlip_crop" in steps:
            ratios["structxlip_crop_vs_public_code"] = steps["structxlip_crop"][key] / steps["public_code"][key]
        return ratios

    ratios = ratios_of("seconds_per_step")
    result["ratios"] = ratios
    result["ratios_cpu_time"] = ratios_of("cpu_seconds_per_step")
    if "public_code" in steps and "structxlip_crop" in steps:
        # the two modes run one after the other in each round, so a round's ratio sees the same machine load
        per_round = [c / p for c, p in zip(steps["structxlip_crop"]["all_seconds_per_step"],
                                           steps["public_code"]["all_seconds_per_step"])]
        result["crop_vs_public_code_per_round"] = per_round
        result["crop_vs_public_code_median_of_rounds"] = statistics.median(per_round)
        print(f"  structxlip_crop_vs_public_code per round: {', '.join(f'{r:.2f}' for r in per_round)} "
              f"(median {statistics.median(per_round):.2f})")
    targets = {}
    if "structxlip_crop_vs_public_code" in ratios:
        targets["crop_no_slower_than_public_code"] = ratios["structxlip_crop_vs_public_code"] <= 1.0
    if "structxlip_pool_vs_clip" in ratios:
        targets["pool_at_most_2.3x_clip"] = ratios["structxlip_pool_vs_clip"] <= 2.3
    for key, value in ratios.items():
        print(f"  {key}: {value:.2f} (wall clock), {result['ratios_cpu_time'][key]:.2f} (CPU time)")
    if not args.skip_preprocess:
        from preprocess_throughput import canny_throughput, lexicon_throughput

        lex = lexicon_throughput(args.lexicon_captions)
        canny = canny_throughput()
        result["lexicon"] = lex
        result["canny"] = canny
        targets["lexicon_above_15000_captions_per_s_2_cores"] = lex["captions_per_s_2_processes"] > 15000
        print(f"  lexicon filter: {lex['captions_per_s_2_processes']:,.0f} captions/s on 2 processes "
              f"({lex['captions_per_s_1_process']:,.0f} on 1; "
              f"public-style {lex['baseline_public_style_captions_per_s']:,.0f})")
        for size in ("224x224", "1024x768"):
            print(f"  canny {size}: {canny[size]['edge_map_images_per_s']:,.0f} images/s")
    result["targets_met"] = targets
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, RESULTS)
    print(f"wrote {RESULTS}")
    return result


if __name__ == "__main__":
    main()
