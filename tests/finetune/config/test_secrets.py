"""``hub.token`` is masked by its key, not by what it looks like, wherever a recipe gives it (a flat override, a
whole-section override, nested YAML in the file): recipe errors never echo it, the run's ``recipe.yaml`` never holds
it, and the overrides a file or a command repeats leave it out (:mod:`finetune.config.secrets`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from finetune.config import RecipeError, dump_recipe, load_recipe
from finetune.config.secrets import mask_override, mask_secrets, without_secrets

#: tokens that do not look like one (no ``hf_`` prefix): only their key says they are secret
SECRET = "mysecret-4f2a9c"
NUMBER = "73914652"


def _recipe(tmp_path: Path, text: str = "# r\ntrain: {max_steps: 2}\n") -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("override, says", [
    (f"hub={{token: {SECRET}, bogus: 1}}", r"`hub\.bogus` is not a recipe key"),
    (f"hub={{token: [{SECRET}]}}", r"`hub\.token` expected a string or null"),
    (f"hub={{token: {NUMBER}}}", r"`hub\.token` expected a string or null, got \*\*\* \(an integer\)"),
    (f"hub.token=[{SECRET}]", r"`hub\.token` expected a string or null"),
    (f"hub.token={NUMBER}", r"`hub\.token` expected a string or null"),
    (f"hub={{\"token\": \"{SECRET}\", bogus: 1}}", r"`hub\.bogus` is not a recipe key"),
    (f"hub={{token: {SECRET}, repo_id: 'a/b'", r"the value is not valid YAML"),
    (f"hub={{token: &a {SECRET}, repo_id: *a, bogus: 1}}", r"`hub\.bogus` is not a recipe key"),
    (f"hub={{tokn: {SECRET}, bogus: 1}}", r"is not a recipe key"),
])
def test_an_override_error_never_echoes_a_token_whatever_it_looks_like(tmp_path: Path, override: str,
                                                                         says: str) -> None:
    with pytest.raises(RecipeError, match=says) as info:
        load_recipe(_recipe(tmp_path), ["train.lr=1e-5", override])
    message = str(info.value)
    assert SECRET not in message and NUMBER not in message, message
    assert "***" in message and message.startswith("command-line override `hub"), message


@pytest.mark.parametrize("text", [f"# r\nhub:\n  token: [{SECRET}]\n", f"# r\nhub:\n  token: {NUMBER}\n",
                                  f"# r\nhub: {{token: [{SECRET}, 1]}}\n"])
def test_a_recipe_file_error_never_echoes_its_token(tmp_path: Path, text: str) -> None:
    path = _recipe(tmp_path, text)
    with pytest.raises(RecipeError, match=rf"{path}, line \d+: `hub\.") as info:
        load_recipe(path)
    assert SECRET not in str(info.value) and NUMBER not in str(info.value), str(info.value)


def test_a_section_override_token_never_reaches_the_run_recipe(tmp_path: Path) -> None:
    recipe = load_recipe(_recipe(tmp_path), ["train.lr=1e-5", f"hub={{token: {SECRET}, repo_id: me/x}}",
                                             f"hub.token={SECRET}-2"])
    assert recipe.hub.token == f"{SECRET}-2" and recipe.hub.repo_id == "me/x"
    text = dump_recipe(recipe, tmp_path / "run" / "recipe.yaml").read_text()
    assert SECRET not in text and "token" not in text.replace(str(tmp_path), ""), text
    assert "# overrides: train.lr=1e-5 hub={repo_id: me/x}\n" in text
    again = load_recipe(tmp_path / "run" / "recipe.yaml")
    assert again == dataclasses.replace(recipe, hub=dataclasses.replace(recipe.hub, token=None), source=again.source,
                                        overrides=())


def test_masking_is_by_key() -> None:
    # an override as a message shows it: every value under a secret key hidden, the rest as given
    assert mask_override(f"hub.token={SECRET}") == "hub.token=***"
    assert mask_override(f"hub={{token: {SECRET}, repo_id: me/x}}") == "hub={token: ***, repo_id: me/x}"
    assert mask_override("hub={token: ab, repo_id: me/x}") == "hub={token: ***, repo_id: me/x}"  # short ones too
    assert mask_override(f"hub.tokn={SECRET}") == "hub.tokn=***"  # a near miss of the key
    assert mask_override("train.lr=1e-5") == "train.lr=1e-5"
    # an override as a file or a command repeats it: the secret left out, the rest still valid
    assert without_secrets(f"hub.token={SECRET}") is None
    assert without_secrets(f"hub={{token: {SECRET}, repo_id: me/x, private: false}}") == \
        "hub={repo_id: me/x, private: false}"
    assert without_secrets(f"hub={{token: {SECRET}}}") == "hub={}"
    assert without_secrets(f"hub={{token: &a {SECRET}, repo_id: *a}}") is None  # not parsed here: left out whole
    assert without_secrets("train.lr=1e-5") == "train.lr=1e-5"
    # free text: values of secret keys, known secrets, anything shaped like a hub token
    line = (f"# overrides: hub.token={SECRET} train.lr=1 hub={{token: {SECRET}, repo_id: me/x}} "
            f"'hub={{\"token\": \"{SECRET}\"}}' HF_TOKEN={SECRET} --token={SECRET} --hf-token {SECRET} "
            "hf_abcdefghijklmnop")
    masked = mask_secrets(line)
    assert SECRET not in masked and "hf_abcdefghijklmnop" not in masked, masked
    assert "train.lr=1" in masked and "repo_id: me/x" in masked
    assert mask_secrets(f"it was {NUMBER} and {NUMBER[:3]}", [NUMBER, NUMBER[:3]]) == f"it was *** and {NUMBER[:3]}"
    kept = "`hub.token` expected a string, got a list; tokenizer: clip, max_tokens=77"
    assert mask_secrets(kept) == kept
