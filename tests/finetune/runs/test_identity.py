"""Which run a folder holds (:mod:`finetune.runs.identity`): what a continued run must match, and the keys that
differ between two recipes."""

from __future__ import annotations

from finetune.runs.identity import continuation_view, differing_keys
from tests.finetune.runs.tiny_runs import recipe_dict


def test_continuation_view_and_differing_keys():
    view = continuation_view(recipe_dict(checkpoint_every=2, trackers=["tensorboard"]))
    assert set(view) == {"model", "adapter", "objective", "data", "train"}
    assert "checkpoint_every" not in view["train"] and view["train"]["lr"] == 1e-3
    assert view["data"] == {"train": {"name": "synthetic", "size": 16}}
    assert differing_keys({"a": {"b": 1}}, {"a": {"b": 1, "c": "x"}}) == ['a.c: (unset) -> "x"']
