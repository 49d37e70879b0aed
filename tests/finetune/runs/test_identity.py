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


def test_keys_added_since_a_run_at_their_defaults_are_no_change(tmp_path):
    """A run folder or checkpoint written before ``train.text_buckets`` / ``train.group_by_length`` existed: an
    upgrade alone neither refuses the rerun nor the resume; a new key set away from its default still does."""
    import copy
    from pathlib import Path

    import pytest
    import yaml

    from finetune.config import load_recipe, recipe_to_dict
    from finetune.runs.errors import RunFolderError
    from finetune.runs.folder import check_run_folder
    from finetune.runs.resume import check_continuation

    root = Path(__file__).resolve().parents[3]
    current = recipe_to_dict(load_recipe(root / "recipes" / "quickstart.yaml", [f"output.dir={tmp_path / 'run'}"]))
    older = copy.deepcopy(current)
    for key in ("text_buckets", "group_by_length", "length_group_batches"):
        older["train"].pop(key)
    check_continuation(continuation_view(older), continuation_view(current), tmp_path / "step-2")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text(yaml.safe_dump(older))
    assert check_run_folder(tmp_path / "run", current) == "rerun"
    grouped = copy.deepcopy(current)
    grouped["train"]["group_by_length"] = True
    with pytest.raises(RunFolderError, match=r"train.group_by_length: \(unset\) -> true"):
        check_continuation(continuation_view(older), continuation_view(grouped), tmp_path / "step-2")
    with pytest.raises(RunFolderError, match=r"train.group_by_length: \(unset\) -> true"):
        check_run_folder(tmp_path / "run", grouped)
