"""Hub round trip: train the quickstart for a few steps, push it, load it back, compare embeddings.

    HF_TOKEN=hf_... python examples/hub_roundtrip.py --repo-id me/xlipkit-quickstart
    HF_TOKEN=hf_... python examples/hub_roundtrip.py --repo-id me/xlipkit-quickstart-lora --adapter lora
    python examples/hub_roundtrip.py --stage-only /tmp/xlipkit-upload      # offline: the folder push would upload

Anything after the options is a recipe override (``train.batch_size=16``). The run goes to
``--out`` (default ``runs/hub_roundtrip``); the pushed model is loaded back with
``finetune.load_finetuned`` (from the hub, or from the staged folder with ``--stage-only``) and its
text and image embeddings of held-out synthetic scenes are compared with those of the local run.
Exit status 0 when they agree within 1e-5.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo-id", help="hub repository to push to (user/name); needs HF_TOKEN or `hf auth login`")
    p.add_argument("--stage-only", metavar="DIR", help="write the upload folder into DIR instead of pushing")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--adapter", choices=("full", "lora", "dora"), help="adapter type (default: the recipe's, full)")
    p.add_argument("--train-size", type=int, default=512, help="synthetic training scenes (default 512)")
    p.add_argument("--eval-size", type=int, default=64, help="held-out scenes evaluated before/after (default 64)")
    p.add_argument("--out", default="runs/hub_roundtrip", help="run folder (default runs/hub_roundtrip)")
    p.add_argument("--public", action="store_true", help="create the hub repository public (default private)")
    p.add_argument("overrides", nargs="*", help="more recipe overrides, key.sub=value")
    return p


def recipe_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides of recipes/quickstart.yaml for a round trip of ``args.steps`` steps (the user's last)."""
    overrides = [f"output.dir={args.out}", f"train.max_steps={args.steps}", f"data.train.size={args.train_size}",
                 f"eval.sets.0.size={args.eval_size}", "train.trackers=[]",
                 # the quickstart's 25 warm-up steps are a tenth of its 250: keep that tenth of this short run
                 f"train.warmup_steps={args.steps // 10}",
                 # the quickstart's model from its registry config, not its pretrained start (model.init_from
                 # would train that first) nor its clip-only comparison: a round trip of a few steps
                 "model.name_or_path=random:small-clip", "model.init_from=null", "eval.compare_with=[]"]
    if args.adapter:
        overrides.append(f"adapter.type={args.adapter}")
    return overrides + list(args.overrides)


def embed(model: torch.nn.Module, captions: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Text ``(B, D)`` and image ``(B, D)`` embeddings of ``model`` (a DualEncoder)."""
    tok = model.tokenize(captions)
    with torch.no_grad():
        text = model.encode_text(tok.input_ids, tok.attention_mask).embeds
        image = model.encode_image(**model.preprocess_images(images)).embeds
    return text, image


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.repo_id and not args.stage_only:
        print("error: give --repo-id USER/NAME to push, or --stage-only DIR to stay offline", file=sys.stderr)
        return 2

    from finetune import load_finetuned
    from finetune.config import RecipeError, load_recipe
    from finetune.data.sources import load_source
    from finetune.hub import HubPushError, push, stage_upload
    from finetune.training import run_recipe

    out = Path(args.out)
    try:
        recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", recipe_overrides(args))
    except RecipeError as e:
        print(f"recipe error: {e}", file=sys.stderr)
        return 2
    status = run_recipe(recipe)
    if status:
        return status

    repo_id = args.repo_id or "me/xlipkit-quickstart"
    if args.stage_only:
        source = str(stage_upload(out, args.stage_only, repo_id=repo_id, overwrite=True))
        print(f"staged the upload for {repo_id} in {source}")
    else:
        try:
            commit = push(out, repo_id, private=not args.public)
        except HubPushError as e:
            print(f"push failed: {e}", file=sys.stderr)
            return 1
        source = repo_id
        print(f"pushed to {commit.commit_url}")

    scenes = load_source({"name": "synthetic", "split": "test", "size": 8, "seed": 7}).dataset
    captions, images = list(scenes["caption"]), [row["image"] for row in scenes]
    local_text, local_image = embed(load_finetuned(str(out / "final")), captions, images)
    hub_text, hub_image = embed(load_finetuned(source), captions, images)
    d_text = (local_text - hub_text).abs().max().item()
    d_image = (local_image - hub_image).abs().max().item()
    print(f"loaded back from {source}: max |difference| text {d_text:.2e}, image {d_image:.2e} "
          f"({len(captions)} scenes, {local_text.shape[1]}-d embeddings)")
    if max(d_text, d_image) > TOLERANCE:
        print(f"round trip FAILED: embeddings differ by more than {TOLERANCE}", file=sys.stderr)
        return 1
    print("round trip OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
