"""Moved to :mod:`finetune.models.families.vision_text` (issue 25, DESIGN 2): this old path stays importable.

The name is an alias of the new module (the same module object), so that imports, private names and
monkeypatching through the old path keep working. Import from ``finetune.models.families.vision_text`` in new code.
"""

import sys

import finetune.models.families.vision_text as _moved

sys.modules[__name__] = _moved
