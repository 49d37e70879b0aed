"""``python -m finetune.cli COMMAND ...``, the form ``accelerate launch -m finetune.cli train RECIPE`` runs."""

from finetune.cli.main import main
from finetune.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
