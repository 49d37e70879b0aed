"""``python -m finetune.preprocess.flism IMAGES_AND_CAPTIONS OUT``: FLISM's pairs of a dataset as a jsonl
(:func:`finetune.preprocess.flism.cli.main`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
