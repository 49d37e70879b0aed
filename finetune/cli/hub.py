"""``xlipkit push`` / ``xlipkit export`` (``python -m finetune.hub push|export``): push a run to the Hugging Face hub
with a model card, stage what would be uploaded, or export it as a plain model folder (:mod:`finetune.hub`).

    python -m finetune.hub push RUN_DIR --repo-id USER/NAME [--public] [--revision BRANCH] [--merge]
    python -m finetune.hub push RUN_DIR --repo-id USER/NAME --stage-only DIR     # no network
    python -m finetune.hub export RUN_DIR OUT_DIR [--format auto|transformers|open_clip]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from finetune.cli.arguments import ArgumentParser

__all__ = ["main"]

#: ``--format`` choices (:data:`finetune.hub.upload.FORMATS`, repeated here so that ``--help`` imports no model code)
FORMATS = ("auto", "transformers", "open_clip")


def _parser(prog: str = "python -m finetune.hub") -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description="Push a fine-tuned run to the Hugging Face hub with a model card, or export it as a plain "
                    "transformers / open_clip folder (adapter merged, 248 text positions in the config).",
        epilog="The token comes from HF_TOKEN or `hf auth login` (never from the command line, where it would "
               "land in the shell history).\n\nexamples:\n"
               "  python -m finetune.hub push runs/structxlip_docci --repo-id me/clip-structxlip-docci\n"
               "  python -m finetune.hub push runs/quickstart --repo-id me/quickstart --stage-only /tmp/upload\n"
               "  python -m finetune.hub export runs/structxlip_docci exported/clip-structxlip-docci",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    ps = sub.add_parser("push", help="upload a run with a generated model card")
    ps.add_argument("run_dir", help="a run folder (recipe.yaml, metrics.json, final/) or a save_finetuned folder")
    ps.add_argument("--repo-id", required=True, help="user/name or org/name")
    ps.add_argument("--public", action="store_true", help="create the repository public (default: private)")
    ps.add_argument("--revision", help="branch to commit to (created when missing)")
    ps.add_argument("--commit-message", help="commit message")
    ps.add_argument("--base-model", help="hub id of the base model when the run loaded a local copy of it")
    ps.add_argument("--merge", action="store_true", help="upload the adapter merged into its base")
    ps.add_argument("--stage-only", metavar="DIR", help="write the folder that would be uploaded into DIR; no network")
    ps.add_argument("--overwrite", action="store_true",
                    help="with --stage-only: replace a DIR that an earlier --stage-only wrote")
    pe = sub.add_parser("export", help="write the merged model as a plain transformers / open_clip folder")
    pe.add_argument("run_dir", help="a run folder or a save_finetuned folder")
    pe.add_argument("out_dir", help="a new or empty folder outside the run folder")
    pe.add_argument("--format", choices=FORMATS, default="auto", help="default: the run's backend")
    pe.add_argument("--overwrite", action="store_true", help="replace an OUT_DIR that an earlier export wrote")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; returns 0 on success, 1 when the push failed, 2 on bad input."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_args(argv)
    # imported after parsing: `--help` and usage errors need none of the models' libraries
    from finetune.hub import HubPushError, export, push, stage_upload
    from finetune.hub.upload import INFERENCE_CONFIG, INFERENCE_WEIGHTS, MARKER_NAME

    if not logging.getLogger("xlipkit").handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "export":
            out = export(args.run_dir, args.out_dir, format=args.format, overwrite=args.overwrite)
            print(f"wrote {out}: load it with CLIPModel/SiglipModel.from_pretrained({str(out)!r}) or "
                  f"open_clip.create_model_and_transforms('local-dir:{out}')")
            if (out / INFERENCE_CONFIG).is_file():
                print(f"the model's inference modules are in {out / INFERENCE_CONFIG} + {INFERENCE_WEIGHTS}: "
                      f"finetune.load_finetuned({str(out)!r}) restores them")
            return 0
        if args.stage_only:
            out = stage_upload(args.run_dir, args.stage_only, repo_id=args.repo_id, base_model=args.base_model,
                               merge=args.merge, overwrite=args.overwrite)
            files = [p for p in out.iterdir() if p.name != MARKER_NAME]
            print(f"wrote {out}: the folder `push` would upload to {args.repo_id} ({len(files)} files)")
            return 0
        info = push(args.run_dir, args.repo_id, private=not args.public, revision=args.revision,
                    commit_message=args.commit_message, base_model=args.base_model, merge=args.merge)
        print(f"pushed {args.run_dir} to {getattr(info, 'commit_url', args.repo_id)}; load it with "
              f"finetune.load_finetuned({args.repo_id!r})")
        return 0
    except HubPushError as e:
        print(f"push failed: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
