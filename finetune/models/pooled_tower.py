"""Moved to :mod:`finetune.models.backends.pooled_tower` (issue 25, DESIGN 2): this old path stays importable.

The name is an alias of the new module (the same module object), so that imports, private names and
monkeypatching through the old path keep working. Import from ``finetune.models.backends.pooled_tower`` in new code.
"""

import sys

import finetune.models.backends.pooled_tower as _moved

sys.modules[__name__] = _moved
