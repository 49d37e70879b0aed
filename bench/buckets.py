"""Length buckets on the CPU (issue 37 item 3): how much of the text computed is padding, and what a step costs,
with each text pass padded to its bucket (this checkout) against padding to the model's maximum (the tree before
buckets, ``--baseline``, unpacked with ``git archive``: captions at ``max_text_len``, short texts at the training
set's longest, as issue 29's fixed shapes had them).

Figures, each printed beside its goal:

- **padding share** (share of the text tokens the passes compute that are padding; goal <= 25 %), from batches
  collated as the training loop collates them (``PlannedCollate``: the plan chooses each pass's length on the
  host), with buckets, padded to the maximum, and the floor of any padding to a rectangle (each pass at its own
  longest row), over ``--share-batches`` batches drawn as the sampler draws them, and with ``train.group_by_length``
  (the first batches of its sampler, padded to the lengths planned with it: :func:`grouped_buckets`; also at the
  multiples of 32, to show what the grouping alone does), on three training sets:
  ``quickstart`` (``recipes/quickstart.yaml``: clip + StructXLIP on its 2,000 synthetic scenes, small-clip's CLIP
  tokenizer, 248 positions, batch 16), ``docci-lengths`` (``recipes/longclip_docci.yaml``'s clip objective, CLIP
  tokenizer, 248 positions, on captions with DOCCI's lengths, batch 16 and the GPU benchmark's 256) and
  ``coco-lengths`` (``recipes/grm_coco.yaml``'s GRM objective and BERT tokenizer, 512 positions, batch 128, on
  captions with COCO's lengths). Where the lengths come from: DOCCI's descriptions average 136 words (the DOCCI
  paper, as StructXLIP's paper quotes it: /work/shared/papers/structxlip.txt); the spread around it (sd 38 words,
  50-320) is assumed, not taken from a source. COCO's captions: annotators were asked for at least 8 words, and the
  captions average about 10.5 words (Chen et al. 2015, "Microsoft COCO Captions"); the shape of the distribution
  over 8-20 words here is assumed. The words are those of the offline tokenizers' word list
  (``finetune/models/offline_tokenizers.py``), one token each, so the token counts follow the word counts as
  CLIP's and BERT's real vocabularies give them for plain English (about one token a word, plus punctuation).
- **s/step** (steady seconds per step from the run's ``metrics.json``; one fresh ``finetune/run.py`` process per
  run, the trees interleaved, ``--rounds`` rounds, ``OMP_NUM_THREADS`` the same for both): ``quickstart`` (the
  quickstart recipe from ``random:small-clip``, ``--steps`` steps; goal: >= 1.5x faster than padding to 248) and
  ``grm-coco`` (the GRM COCO recipe as shipped on tiny towers: a 2-layer ViT and a 2-layer BERT with BERT-base's
  512 positions, the COCO-length captions, batch ``--grm-batch``; padded, every caption runs at 512 in BERT, in
  eq. 7's token-wise similarity and in the token gates); ``quickstart-grouped``: the quickstart with
  ``train.group_by_length=true`` against this checkout without it (no goal: the figure asked for).

    python bench/buckets.py                    # everything: bench/results/buckets.json
    python bench/buckets.py --only share       # the padding shares alone (no training run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
RECIPES = ROOT / "recipes"
#: the tree before buckets: captions padded to max_text_len, short texts to the training set's longest
BASELINE = "d972037"
GOALS = {"padding_share": 0.25, "quickstart_speedup": 1.5}
#: the s/step case of the quickstart with train.group_by_length against the same checkout without it
GROUPED_CASE = "quickstart-grouped"


# -- captions with real lengths ----------------------------------------------------------------------------------
_NOUNS = ("man woman dog cat bird horse car bus truck bike train boat plane tree flower building house window door "
          "table chair bed child boy girl person bottle book phone cup plate").split()
_ADJS = "red green blue yellow orange black white small large tall wooden metal bright dark round old".split()
_VERBS = ("is sitting on|is standing near|is holding|is looking at|is lying beside|is riding|is walking toward|"
          "is parked next to|is placed on|is covered with").split("|")
_PLACES = ("in the street|on the grass|near the water|in the room|on the beach|in front of a building|under the sky|"
           "along the road|beside the river|at the top of the hill").split("|")


def _sentence(rng: random.Random) -> list[str]:
    words = ["a", rng.choice(_ADJS), rng.choice(_NOUNS), *rng.choice(_VERBS).split(), "the", rng.choice(_ADJS),
             rng.choice(_NOUNS), *rng.choice(_PLACES).split()]
    if rng.random() < 0.5:
        words += ["while", "a", rng.choice(_NOUNS), *rng.choice(_VERBS).split(), "a", rng.choice(_NOUNS)]
    return words


def caption_of(words: int, rng: random.Random) -> str:
    """A caption of exactly ``words`` words: sentences of the scene vocabulary, the last one cut to fit."""
    out: list[str] = []
    while len(out) < words:
        s = _sentence(rng)[: words - len(out)]
        out += s[:-1] + [s[-1] + "."]
    text = " ".join(out)
    return text[0].upper() + text[1:]


def docci_words(rng: random.Random) -> int:
    """DOCCI-like: mean 136 words (DOCCI); the spread (sd 38, 50-320) assumed."""
    return int(min(320, max(50, round(rng.gauss(136, 38)))))


#: COCO-like word counts (at least 8; mean about 10.6 with these weights, COCO's reported mean is about 10.5)
_COCO_WEIGHTS = {8: 15, 9: 20, 10: 20, 11: 14, 12: 10, 13: 7, 14: 5, 15: 3, 16: 2, 17: 1.5, 18: 1, 19: 0.8, 20: 0.7}


def coco_words(rng: random.Random) -> int:
    return rng.choices(list(_COCO_WEIGHTS), weights=list(_COCO_WEIGHTS.values()))[0]


def length_dataset(kind: str, size: int, seed: int = 0) -> Any:
    """``size`` rows of ``id``, ``image`` (one 32 px PNG) and ``caption`` with ``kind``'s lengths (``docci`` /
    ``coco``), as a ``datasets.Dataset``."""
    import io

    import datasets
    import PIL.Image

    rng = random.Random(seed)
    words = docci_words if kind == "docci" else coco_words
    buf = io.BytesIO()
    PIL.Image.new("RGB", (32, 32), (120, 60, 200)).save(buf, format="PNG")
    image = {"bytes": buf.getvalue(), "path": None}
    return datasets.Dataset.from_dict(
        {"id": [f"{kind}-{i}" for i in range(size)], "image": [image] * size,
         "caption": [caption_of(words(rng), rng) for _ in range(size)]},
        features=datasets.Features({"id": datasets.Value("string"), "image": datasets.Image(),
                                    "caption": datasets.Value("string")}))


def write_jsonl(folder: Path, rows: Any, image_size: int = 32) -> Path:
    """``rows`` as a JSONL training set (``train.jsonl`` and one PNG per row under ``images/``)."""
    import PIL.Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as out:
        for i, r in enumerate(rows):
            name = f"images/{i}.png"
            PIL.Image.new("RGB", (image_size, image_size), ((37 * i) % 256, (91 * i) % 256, 140)).save(folder / name)
            out.write(json.dumps({"id": r["id"], "image": name, "caption": r["caption"]}) + "\n")
    return folder


def bert_towers(folder: Path, positions: int = 512) -> dict[str, str]:
    """A tiny ViT and a tiny BERT with ``positions`` positions (BERT-base's 512), saved as hub checkpoints."""
    import torch
    from transformers import BertConfig, BertModel, ViTConfig, ViTModel

    from finetune.models.families.vision_text import _TINY_BERT, _TINY_VIT, tiny_bert_tokenizer

    if not (folder / "bert" / "config.json").is_file():
        torch.manual_seed(0)
        tokenizer = tiny_bert_tokenizer(positions)
        ViTModel(ViTConfig(**_TINY_VIT)).save_pretrained(folder / "vit")
        BertModel(BertConfig(vocab_size=len(tokenizer), **{**_TINY_BERT, "max_position_embeddings": positions})
                  ).save_pretrained(folder / "bert")
        tokenizer.save_pretrained(folder / "bert")
    return {"vision": str(folder / "vit"), "text": str(folder / "bert")}


# -- padding shares ------------------------------------------------------------------------------------------------
def share_case(name: str, work: Path, batches: int, rows_of_lengths: int = 4096) -> dict[str, Any]:
    """The padding shares of case ``name`` (module docstring) over ``batches`` batches of each batch size
    (``rows_of_lengths`` rows of DOCCI- or COCO-length captions)."""
    import torch

    from finetune import load_model
    from finetune.config import load_recipe
    from finetune.data.collate import Collator
    from finetune.data.sources import load_source
    from finetune.objectives import build_objective
    from finetune.objectives.planning import PlannedCollate
    from finetune.objectives.shapes import SHORT, TEXT, example_longest, plan_shapes, round_up
    from finetune.training.loaders import LengthGroupedEpochSampler

    if name == "quickstart":
        recipe = load_recipe(RECIPES / "quickstart.yaml")
        model = load_model("random:small-clip", max_text_len=248)
        rows = load_source(recipe.data.train).dataset
        sizes = [recipe.train.batch_size]
    elif name == "docci-lengths":
        recipe = load_recipe(RECIPES / "longclip_docci.yaml")
        model = load_model("random:tiny-clip", max_text_len=248)  # the CLIP tokenizer; the tower is not run
        rows = length_dataset("docci", rows_of_lengths)
        sizes = [recipe.train.batch_size, 256]
    else:
        recipe = load_recipe(RECIPES / "grm_coco.yaml", [f"model.options.{k}={v}" for k, v in
                                                        bert_towers(work / "towers").items()])
        from finetune.training.model import load_start_model

        model = load_start_model(recipe.model, None)
        rows = length_dataset("coco", rows_of_lengths)
        sizes = [recipe.train.batch_size]
    objective = build_objective(recipe.objective)
    objective.prepare_model(model)
    rows = objective.preprocess(rows, model, cache_dir=str(work / "cache"))
    out: dict[str, Any] = {"max_text_len": int(model.max_text_len), "rows": len(rows)}
    lengths = [int(m.sum()) for m in model.tokenize(list(rows["caption"])).attention_mask]
    out["caption_tokens"] = {"mean": statistics.mean(lengths), "median": statistics.median(lengths),
                             "p10": sorted(lengths)[len(lengths) // 10], "p90": sorted(lengths)[9 * len(lengths) // 10],
                             "min": min(lengths), "max": max(lengths)}
    shapes = plan_shapes(objective, model, rows)
    objective.set_shapes(shapes)
    out["planned"] = {k: list(v) for k, v in shapes.planned.items()}
    # padded as before buckets: captions at max_text_len, short texts at the training set's longest rounded to 8
    short = [n for t in objective.all_terms if (scan := t.shape_scan(rows, model)) is not None
             for n in example_longest(model, scan.texts.get(SHORT, []))]
    before = {TEXT: shapes.text_length, SHORT: min(shapes.text_length, round_up(max(short, default=1), 8))}
    collate = PlannedCollate(Collator(model, objective), objective, model)
    # train.group_by_length plans the finer default ladder (grouped_buckets) from the same scan
    grouped_shapes = plan_shapes(objective, model, rows, grouped=True)
    out["planned_grouped"] = {k: list(v) for k, v in grouped_shapes.planned.items()}
    gen = torch.Generator().manual_seed(0)
    for size in sizes:
        drawn = [torch.randperm(len(rows), generator=gen)[:size].tolist() for _ in range(batches)]
        objective.set_shapes(shapes)
        out[f"batch_{size}"] = entry = _shares(drawn, rows, collate, objective, shapes, before)
        # the first batches of the sampler the training loop builds with train.group_by_length on
        sampler = LengthGroupedEpochSampler(shapes.text_lengths, seed=0, batch_size=size)
        sampler.total_steps = batches
        order = [i for _, i in sampler]
        grouped = [order[k * size:(k + 1) * size] for k in range(batches)]
        megabatch = {"megabatch_batches": min(sampler.steps_per_epoch // 4, 50) or 1,
                     "steps_per_epoch": sampler.steps_per_epoch}
        entry["grouped_default_buckets"] = {**megabatch, **_shares(grouped, rows, collate, objective, shapes, before)}
        objective.set_shapes(grouped_shapes)
        entry["grouped"] = {**megabatch, **_shares(grouped, rows, collate, objective, grouped_shapes, before)}
        objective.set_shapes(shapes)
    return out


def _shares(drawn: list[list[int]], rows: Any, collate: Any, objective: Any, shapes: Any,
            before: dict[str, int]) -> dict[str, Any]:
    """The padding shares of the batches ``drawn`` (lists of row indices), collated as the training loop does."""
    from finetune.objectives.shapes import SHORT, TEXT

    real = computed = floor = padded = 0
    captions = {"real": 0, "computed": 0, "padded": 0}
    for index in drawn:
        batch = collate([rows[i] for i in index])
        plan = batch["_text_plan"]
        _, reqs, _ = objective.requests(batch)
        real += plan.real_tokens
        computed += plan.computed_tokens
        for kind, length in plan.lengths.items():
            masks = [r.attention_mask for r in reqs.values() if (SHORT if r.short else TEXT) == kind]
            if not masks:  # a term's own texts (F-CAST's chunks): not in this bench
                continue
            n = sum(m.shape[0] for m in masks)
            extent = max(int(m.sum(-1).max()) for m in masks)
            floor += n * extent
            padded += n * before[kind]
        caption = batch["attention_mask"]
        captions["real"] += int(caption.sum())
        captions["computed"] += caption.shape[0] * plan.lengths["text"]
        captions["padded"] += caption.shape[0] * shapes.text_length
    return {"batches": len(drawn), "real_tokens": real, "computed_tokens": computed,
            "padding_share": 1 - real / computed, "padding_share_floor": 1 - real / floor,
            "padding_share_padded_to_max": 1 - real / padded,
            "captions_padding_share": 1 - captions["real"] / captions["computed"],
            "captions_padding_share_padded_to_max": 1 - captions["real"] / captions["padded"],
            "text_tokens_computed_vs_padded": computed / padded}
    return out


# -- s/step: fresh processes, two trees, interleaved --------------------------------------------------------------
def _baseline_tree(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _step_overrides(case: str, work: Path, steps: int, grm_batch: int) -> tuple[str, list[str]]:
    common = [f"train.max_steps={steps}", "train.log_every=5", "train.checkpoint_every=0", "train.trackers=[]",
              "eval.sets=[]", "eval.before=false", "eval.after=false", "eval.compare_with=[]",
              "eval.compare_base_length=false", "output.overwrite=true", "data.num_workers=0"]
    if case == "quickstart":  # from random:small-clip, as issue 37 measured it
        return "recipes/quickstart.yaml", common + ["model.init_from=null", "model.name_or_path=random:small-clip"]
    towers = bert_towers(work / "towers")
    data = work / "coco-lengths"
    if not (data / "train.jsonl").is_file():
        write_jsonl(data, length_dataset("coco", grm_batch * (steps + 2), seed=1))
    return "recipes/grm_coco.yaml", common + [
        f"model.options.vision={towers['vision']}", f"model.options.text={towers['text']}",
        f"data.train={{name: jsonl, path: {data}}}", f"train.batch_size={grm_batch}", "train.mixed_precision=no",
        "train.epochs=null"]


def timed_run(tree: Path, case: str, work: Path, args: argparse.Namespace, tag: str,
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One training run of ``case`` by ``tree``'s ``finetune/run.py`` in a fresh process (with the overrides
    ``extra``): its steady s/step."""
    recipe, overrides = _step_overrides(case, work, args.steps, args.grm_batch)
    overrides = overrides + list(extra)
    out = work / f"run-{tag}"
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "finetune/run.py", recipe, *overrides, f"output.dir={out}",
           f"data.cache_dir={work / ('cache-' + tree.name)}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(tree), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{case} [{tag}] failed:\n{proc.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    thr = metrics["throughput"]
    batch = args.grm_batch if case == "grm-coco" else 16  # the quickstart's batch
    return {"s_per_step": batch / thr["steady_samples_per_s"], "steady_steps": thr["steady_steps"],
            "wall_s": wall, "shapes": thr.get("shapes")}


def step_case(case: str, trees: dict[str, Path], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``case`` run by each tree (``buckets``: this checkout, ``padded``: the baseline) in turn, ``--rounds`` rounds;
    ``quickstart-grouped``: the quickstart by this checkout as it is (``buckets``) and with
    ``train.group_by_length=true`` (``grouped``)."""
    if case == GROUPED_CASE:
        variants = {"buckets": (trees["buckets"], ()), "grouped": (trees["buckets"], ("train.group_by_length=true",))}
    else:
        variants = {label: (tree, ()) for label, tree in trees.items()}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in variants}
    for r in range(args.rounds):
        for label in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            tree, extra = variants[label]
            result = timed_run(tree, case.removesuffix("-grouped"), work, args, f"{case}-{label}-{r}", extra)
            runs[label].append(result)
            print(f"  {case} round {r + 1} [{label}]: {result['s_per_step']:.3f} s/step "
                  f"({result['wall_s']:.0f} s in all)", flush=True)
    best = {label: min(x["s_per_step"] for x in v) for label, v in runs.items()}
    slow, fast = ("buckets", "grouped") if case == GROUPED_CASE else ("padded", "buckets")
    ratios = [b["s_per_step"] / a["s_per_step"] for a, b in zip(runs[fast], runs[slow])]
    return {"runs": runs, "best_s_per_step": best, "speedup_best": best[slow] / best[fast],
            "speedup_per_round": ratios, "speedup_median": statistics.median(ratios)}


# -- main ----------------------------------------------------------------------------------------------------------
def _machine() -> dict[str, Any]:
    import torch

    return {"device": f"cpu ({platform.processor() or platform.machine()}), {os.cpu_count()} cores",
            "load_average_at_start": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version()}


def _padding_goal(shares: dict) -> str:
    """``goal <= 25 %: met`` or ``NOT met`` for one padding-share figure of :func:`share_case`."""
    ok = "met" if shares["padding_share"] <= GOALS["padding_share"] else "NOT met"
    return f"goal <= {GOALS['padding_share']:.0%}: {ok}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("share", "steps"), default=None)
    p.add_argument("--cases", default=f"quickstart,grm-coco,{GROUPED_CASE}",
                   help=f"s/step cases (quickstart, grm-coco, {GROUPED_CASE})")
    p.add_argument("--share-batches", type=int, default=50)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--grm-batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline", default=BASELINE)
    p.add_argument("--out", type=Path, default=RESULTS / "buckets.json")
    args = p.parse_args(argv)
    result: dict[str, Any] = {**_machine(), "goals": GOALS, "baseline": args.baseline,
                              "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    if args.out.is_file():  # keep what the other half measured
        old = json.loads(args.out.read_text())
        result.update({k: old[k] for k in ("padding", "steps") if k in old})
    with tempfile.TemporaryDirectory(prefix="xlipkit-bench-buckets-") as tmp:
        work = Path(tmp)
        if args.only != "steps":
            result["padding"] = {}
            for name in ("quickstart", "docci-lengths", "coco-lengths"):
                r = share_case(name, work, args.share_batches)
                result["padding"][name] = r
                for key, v in r.items():
                    if key.startswith("batch_"):
                        print(f"{name} ({key.replace('_', ' ')}): padding {v['padding_share']:.1%} of the text "
                              f"computed ({_padding_goal(v)}); captions alone "
                              f"{v['captions_padding_share']:.1%}; padded to {r['max_text_len']}: "
                              f"{v['padding_share_padded_to_max']:.1%}; floor (each pass at its longest row): "
                              f"{v['padding_share_floor']:.1%}", flush=True)
                        g, alone = v["grouped"], v["grouped_default_buckets"]
                        print(f"{name} ({key.replace('_', ' ')}), train.group_by_length: padding "
                              f"{g['padding_share']:.1%} ({_padding_goal(g)}); captions "
                              f"alone {g['captions_padding_share']:.1%}; grouped at the multiples of 32: "
                              f"{alone['padding_share']:.1%}; floor {g['padding_share_floor']:.1%} "
                              f"({g['megabatch_batches']} batches per megabatch)", flush=True)
        if args.only != "share":
            trees = {"buckets": ROOT, "padded": _baseline_tree(args.baseline, work / "baseline")}
            result["steps"] = dict(result.get("steps") or {})  # the cases not run now keep their last figures
            for case in [c for c in args.cases.split(",") if c]:
                r = step_case(case, trees, work, args)
                result["steps"][case] = r
                if case == GROUPED_CASE:
                    print(f"{case}: {r['best_s_per_step']['grouped']:.3f} s/step with train.group_by_length, "
                          f"{r['best_s_per_step']['buckets']:.3f} without: {r['speedup_best']:.2f}x (median of the "
                          f"rounds {r['speedup_median']:.2f}x; no goal: the figure asked for)", flush=True)
                    continue
                goal = f" (goal >= {GOALS['quickstart_speedup']}x: " + (
                    "met)" if r["speedup_best"] >= GOALS["quickstart_speedup"] else "NOT met)") if case == \
                    "quickstart" else " (no goal: the figure asked for)"
                print(f"{case}: {r['best_s_per_step']['buckets']:.3f} s/step with buckets, "
                      f"{r['best_s_per_step']['padded']:.3f} padded to the maximum: {r['speedup_best']:.2f}x faster "
                      f"(median of the rounds {r['speedup_median']:.2f}x){goal}", flush=True)
    result["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
