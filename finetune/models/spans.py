"""Moved to :mod:`finetune.models.core.spans` (issue 25, DESIGN 2): this old path stays importable.

The name is an alias of the new module (the same module object), so that imports, private names and
monkeypatching through the old path keep working. Import from ``finetune.models.core.spans`` in new code.
"""

import sys

import finetune.models.core.spans as _moved

sys.modules[__name__] = _moved
