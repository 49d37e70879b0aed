"""``python -m finetune.preprocess.flism IMAGES_AND_CAPTIONS OUT``: FLISM's pairs of a dataset as a jsonl, the same
command as ``xlipkit pairs`` (:mod:`finetune.cli.pairs`); an entry point, imported by nothing."""

import sys

from finetune.cli.pairs import main

if __name__ == "__main__":
    sys.exit(main())
