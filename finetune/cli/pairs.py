"""``xlipkit pairs IMAGES_AND_CAPTIONS OUT`` (``python -m finetune.preprocess.flism``): FLISM's pairs of a dataset as
a jsonl (:func:`finetune.preprocess.flism.pairs.write_pairs`), FAST-GOAL's GLIT100k-style construction."""

from __future__ import annotations

import argparse
import logging
import sys

from finetune.cli.arguments import ArgumentParser

__all__ = ["main"]

#: ``--detector`` and ``--sam-checkpoint`` defaults (:data:`finetune.preprocess.flism.detectors.PAPER_DETECTOR`,
#: ``LISM_SAM``), repeated here so that ``--help`` imports no model code; a test keeps them equal
PAPER_DETECTOR = "hustvl/yolos-base"
LISM_SAM = "facebook/sam-vit-huge"


def _parser(prog: str = "python -m finetune.preprocess.flism") -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description="Write FLISM's global-local pairs (FAST-GOAL III-A) of a dataset as a jsonl that data.train "
                    "reads ({name: jsonl, path: OUT} with objective.terms.fastgoal.regions.method: pairs). "
                    "Resumable: run it again with the same OUT after an interruption.")
    p.add_argument("images_and_captions", metavar="IMAGES_AND_CAPTIONS",
                   help="a jsonl/csv/parquet file or folder, an image folder, or a data source (synthetic, "
                        "'{name: docci, split: train}')")
    p.add_argument("out", metavar="OUT", help="the jsonl to write (OUT.done lists the finished images)")
    p.add_argument("--model", default="openai/clip-vit-base-patch16",
                   help="the model that matches sentences to crops (hub id, folder or registry name)")
    p.add_argument("--max-text-len", type=int, default=248, help="text positions (248: Long-CLIP KPS)")
    p.add_argument("--method", choices=("detector", "sam", "dataset"), default="detector")
    p.add_argument("--detector", default=PAPER_DETECTOR,
                   help="YOLOS hub id / folder, or an ultralytics .pt file; 'none': default regions only")
    p.add_argument("--threshold", type=float, default=None, help="detection score threshold")
    p.add_argument("--classes", nargs="*", default=None, help="keep only these detector classes")
    p.add_argument("--max-boxes", type=int, default=None)
    p.add_argument("--imgsz", type=int, default=640, help="ultralytics inference size")
    p.add_argument("--sam-checkpoint", default=LISM_SAM)
    p.add_argument("--no-default", action="store_true", help="no quadrants and centre box (Table VII 'YOLO only')")
    p.add_argument("--no-links", action="store_true", help="--method dataset: match the boxes like detections")
    p.add_argument("--pairs", type=int, default=1, help="pairs per image (paper 1; Table VIII 3)")
    p.add_argument("--weighting", choices=("uniform", "weighted"), default="uniform")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=None)
    return p


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """``python -m finetune.preprocess.flism IMAGES_AND_CAPTIONS OUT``: see :func:`write_pairs`. Exit status 2
    with a message (no traceback) on bad input."""
    parser = _parser(prog) if prog else _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the model libraries load after parsing (`--help`)
    from finetune.data.images import DataError
    from finetune.models.finetuned import load_model
    from finetune.preprocess.flism.detectors import build_proposer
    from finetune.preprocess.flism.pairs import _source_spec, write_pairs

    try:
        source = _source_spec(args.images_and_captions)
        detector = None if str(args.detector).lower() in ("none", "null", "") else args.detector
        proposer = build_proposer(args.method, detector=detector, threshold=args.threshold, classes=args.classes,
                                  max_boxes=args.max_boxes, imgsz=args.imgsz, sam_checkpoint=args.sam_checkpoint,
                                  links=not args.no_links, device=args.device)
        if proposer is None and args.no_default:
            raise ValueError("--detector none with --no-default leaves no candidate region")
        model = load_model(args.model, max_text_len=args.max_text_len)
        if args.device:
            model.to(args.device)
        counts = write_pairs(source, args.out, model, proposer=proposer, default=not args.no_default,
                             pairs=args.pairs, weighting=args.weighting, batch_size=args.batch_size)
    except (DataError, ValueError, FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {counts['pairs']} pairs of {counts['images']} images to {args.out} ({counts['skipped']} images "
          "were done before)")
    return 0
