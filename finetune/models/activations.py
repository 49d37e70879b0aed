"""Moved to :mod:`finetune.models.backends.activations` (issue 25, DESIGN 2): this old path stays importable.

The name is an alias of the new module (the same module object), so that imports, private names and
monkeypatching through the old path keep working. Import from ``finetune.models.backends.activations`` in new code.
"""

import sys

import finetune.models.backends.activations as _moved

sys.modules[__name__] = _moved
