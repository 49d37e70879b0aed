"""``losses`` is a leaf library (issue 25 item 1, DESIGN 2): ``import losses`` in a fresh interpreter loads torch
and nothing of the toolkit or of the model libraries, and adds well under a second to ``import torch``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("finetune", "transformers", "open_clip", "datasets", "pydantic")

# Both imports timed in the same fresh interpreter: torch first (its own cost, whatever the machine), then losses.
SCRIPT = """
import json, sys, time
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
start = time.perf_counter()
import losses
losses_s = time.perf_counter() - start
forbidden = %r
loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
print(json.dumps({"torch_s": torch_s, "losses_s": losses_s, "loaded": loaded, "file": losses.__file__}))
""" % (FORBIDDEN,)


def test_import_losses_loads_torch_only_and_takes_under_a_second_beyond_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().parent == ROOT / "losses"  # this checkout's losses, not an install
    assert result["loaded"] == [], f"`import losses` loaded {result['loaded']}: losses must need torch only"
    # a bound, not a benchmark: on a 2-core shared machine the import takes ~0.03 s after torch's ~1 s
    assert result["losses_s"] < 1.0, (f"`import losses` took {result['losses_s']:.2f} s beyond `import torch` "
                                      f"({result['torch_s']:.2f} s)")
