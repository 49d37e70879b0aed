"""``python -m finetune.cli COMMAND ...``, the form ``accelerate launch -m finetune.cli train RECIPE`` runs."""

import sys

from finetune.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
