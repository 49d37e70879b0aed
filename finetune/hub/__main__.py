"""``python -m finetune.hub push|export ...``: the hub's command line (:mod:`finetune.cli.hub`, also
``xlipkit push`` / ``xlipkit export``), the entry point DESIGN section 1 documents."""

import sys

from finetune.cli.hub import main

if __name__ == "__main__":
    sys.exit(main())
