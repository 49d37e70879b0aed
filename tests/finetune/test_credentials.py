"""Object-storage credentials and credentials inside URLs (issue 40): masked in every text and file a recipe's values
reach (:mod:`finetune.credentials`, :mod:`finetune.config.secrets`): the run's ``recipe.yaml`` (body and header),
the recipe tree of ``metrics.json`` / ``xlipkit.json`` / checkpoints (``recipe_to_dict``), override messages, the
resume command, data errors and the run's log."""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config import dump_recipe, load_recipe
from finetune.config.io import recipe_to_dict
from finetune.config.secrets import mask_override, mask_secrets, without_secrets
from finetune.credentials import credential_path, mask_data, mask_text, masked_credentials
from finetune.data.images import DataError
from tests.finetune.data.test_stream_sources import s3_server  # noqa: F401 - the fixture

KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
MINIO_USER = "minio-user-4f2a"  # a key id that does not look like an AWS one: only its key says it is one
BEARER = "tok3n-value-9c1d"
URL_PASSWORD = "pa55word-77"
SIGNATURE = "deadbeef0123"
ALL = (KEY_ID, SECRET, MINIO_USER, BEARER, URL_PASSWORD, SIGNATURE)


@pytest.mark.parametrize("text, shown", [
    ("https://user:pa55@host/x.tar", "https://***@host/x.tar"),
    ("s3://user@bucket/x.tar", "s3://***@bucket/x.tar"),
    ("https://h/x.tar?X-Amz-Algorithm=A&X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ab12&X-Amz-Date=1",
     "https://h/x.tar?X-Amz-Algorithm=A&X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Date=1"),
    ("https://a.blob.core.windows.net/c/x.tar?sv=2021&sig=zz%2B&se=2030", "https://a.blob.core.windows.net/c/x.tar?"
                                                                          "sv=2021&sig=***&se=2030"),
    ("https://h/x.tar?token=abc&page=2", "https://h/x.tar?token=***&page=2"),
    ("pipe:curl -s -H 'Authorization: Bearer abc.def' https://h/x.tar", "pipe:curl -s -H 'Authorization: ***' "
                                                                        "https://h/x.tar"),
    ("pipe:curl -u me:pw https://h/x.tar", "pipe:curl -u *** https://h/x.tar"),
    (f"key id {KEY_ID} in a message", "key id *** in a message"),
    ("shards/{00000..00009}.tar and s3://bucket/a-key/x.tar", "shards/{00000..00009}.tar and s3://bucket/a-key/x.tar"),
])
def test_credentials_inside_urls_headers_and_key_ids_are_masked(text: str, shown: str) -> None:
    assert mask_text(text) == shown


def test_storage_credentials_are_found_by_key_below_storage_options_only() -> None:
    options = ("data", "train", "options", "storage_options")
    for name in ("key", "secret", "token", "password", "session_token", "account_key", "sas_token",
                 "aws_secret_access_key", "Authorization", "X-Api-Key", "Cookie"):
        assert credential_path((*options, name)), name
    assert credential_path((*options, "client_kwargs", "headers", "Authorization"))
    for name in ("endpoint_url", "anon", "client_kwargs", "requester_pays", "username"):
        assert not credential_path((*options, name)), name
    assert not credential_path(("data", "train", "key")) and not credential_path(("model", "max_text_len"))
    tree = {"storage_options": {"key": KEY_ID, "secret": "***", "anon": False}}
    assert mask_data(tree) == {"storage_options": {"key": "***", "secret": "***", "anon": False}}
    assert masked_credentials(tree) == [("storage_options", "secret")]


def test_masking_is_linear_in_the_text() -> None:
    """Hostile round 4: a 32 kB run of ``a-a-...`` took 40 s to mask (``hub.token``'s pattern), and ``&sigsig...`` and
    ``a+a+...://`` were quadratic too; an error message or a log line holding such a value (a recipe value of up to
    1 MiB) would stop the command for hours. 200 kB of each now takes well under a second. A regular expression
    holds the interpreter, so the guard against a hang is a separate process."""
    texts = '["a-" * 100_000 + "token", "--a-" * 50_000 + "token x", "a+" * 100_000 + "://", "&sig" * 50_000, ' \
            '"a." * 100_000 + "token="]'
    code = f"from finetune.config.secrets import mask_secrets\nfor text in {texts}: mask_secrets(text)\nprint('done')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "done", done.stderr


def _recipe_with_credentials(tmp_path: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        "# storage credentials written into a recipe\n"
        "data:\n  train:\n    name: webdataset\n"
        f"    urls: https://reader:{URL_PASSWORD}@host.example/shards/{{00000..00003}}.tar?sig={SIGNATURE}\n"
        f"    options:\n      storage_options: {{key: {KEY_ID}, secret: {SECRET}, endpoint_url: 'http://127.0.0.1:9',"
        f" client_kwargs: {{headers: {{Authorization: Bearer {BEARER}, User-Agent: me}}}}}}\n"
        "train: {max_steps: 2}\n", encoding="utf-8")
    return path


def test_the_run_recipe_and_the_recipe_tree_mask_every_storage_credential(tmp_path: Path) -> None:
    overrides = [f"data.train.options.storage_options.session_token={MINIO_USER}", "train.lr=1e-5"]
    recipe = load_recipe(_recipe_with_credentials(tmp_path), overrides)
    text = dump_recipe(recipe, tmp_path / "run" / "recipe.yaml").read_text()
    for secret in ALL:
        assert secret not in text, (secret, text)
    assert "# overrides: train.lr=1e-5\n" in text  # the credential's override is left out of the header
    again = load_recipe(tmp_path / "run" / "recipe.yaml")
    options = again.data.train.options["storage_options"]
    assert options["key"] == options["secret"] == options["session_token"] == "***"
    assert options["endpoint_url"] == "http://127.0.0.1:9" and options["client_kwargs"]["headers"] == {
        "Authorization": "***", "User-Agent": "me"}
    assert again.data.train.urls == "https://***@host.example/shards/{00000..00003}.tar?sig=***"
    tree = repr(recipe_to_dict(recipe))  # metrics.json, final/xlipkit.json, train_state.json, trackers
    assert not [s for s in ALL if s in tree], tree
    assert recipe_to_dict(recipe, keep_secrets=True)["data"]["train"]["options"]["storage_options"]["key"] == KEY_ID


def test_overrides_messages_and_commands_never_show_a_storage_credential() -> None:
    flat = f"data.train.options.storage_options.key={MINIO_USER}"
    section = f"data.train.options.storage_options={{key: {MINIO_USER}, secret: {SECRET}, anon: false}}"
    assert mask_override(flat) == "data.train.options.storage_options.key=***"
    assert mask_override(section) == "data.train.options.storage_options={key: '***', secret: ***, anon: false}"
    assert without_secrets(flat) is None
    assert without_secrets(section) == "data.train.options.storage_options={anon: false}"
    url = f"data.train.urls=https://u:{URL_PASSWORD}@h/x.tar"
    assert mask_secrets(url) == "data.train.urls=https://***@h/x.tar"


def test_the_resume_command_leaves_storage_credentials_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from finetune.training import ending as launch

    monkeypatch.setattr(launch, "launch_argv", lambda: [
        "xlipkit", "train", "r.yaml", f"data.train.options.storage_options.secret={SECRET}",
        f"data.train.options.storage_options={{key: {MINIO_USER}, endpoint_url: 'http://h:9'}}",
        f"data.train.urls=https://u:{URL_PASSWORD}@h/{{0..3}}.tar"])
    command = launch.resume_command()
    assert not [s for s in ALL if s in command], command
    assert shlex.split(command)[3:] == ["data.train.options.storage_options={endpoint_url: 'http://h:9'}",
                                        "data.train.urls=https://***@h/{0..3}.tar", "train.resume=latest"]


def test_data_errors_and_the_run_log_mask_credentials(capsys: pytest.CaptureFixture) -> None:
    error = DataError(f"cannot read shard https://u:{URL_PASSWORD}@h/x.tar?X-Amz-Signature={SIGNATURE} ({KEY_ID})")
    assert str(error) == "cannot read shard https://u:***@h/x.tar?X-Amz-Signature=*** (***)".replace("u:***", "***")
    from finetune.training.environment import setup_logging

    logger = logging.getLogger("xlipkit")
    saved = logger.handlers[:], logger.propagate
    logger.handlers = []
    try:
        setup_logging(True)
        logger.handlers[0].stream = sys.stderr  # capsys's stderr
        logger.warning("shard %s ends early", f"https://u:{URL_PASSWORD}@h/x.tar")
    finally:
        logger.handlers, logger.propagate = saved
    err = capsys.readouterr().err
    assert "shard https://***@h/x.tar ends early" in err and URL_PASSWORD not in err


@pytest.mark.slow
def test_a_run_on_s3_with_credentials_in_the_recipe_writes_them_nowhere(tmp_path, s3_server, monkeypatch,
                                                                          caplog) -> None:
    """Issue 40: ``storage_options: {key: AKIA..., secret: ...}`` was written as given into recipe.yaml,
    metrics.json, final/xlipkit.json, checkpoints/step-N/train_state.json and the folder ``push --stage-only``
    prepares. Every file of the run folder and of the staged folder, and the run's log, are searched."""
    from finetune.hub.upload import stage_upload
    from finetune.models.registry import save_tiny
    from tests.finetune.data.test_stream_sources import _upload
    from tests.finetune.data.test_streams import _run_recording, _scenes, _stream_recipe, write_webdataset

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    _upload(s3_server, "train", write_webdataset(tmp_path / "shards", _scenes(8), 4))
    options = (f"data.train.options={{storage_options: {{key: {KEY_ID}, secret: {SECRET}, "
               f"client_kwargs: {{region_name: us-east-1}}}}}}")
    recipe = _stream_recipe(tiny, "s3://train/shard-{00000..00001}.tar", tmp_path / "run", options,
                            "train.max_steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=5")
    caplog.set_level(logging.INFO)
    assert len(_run_recording(recipe, monkeypatch)) == 2
    stage_upload(tmp_path / "run", tmp_path / "staged", repo_id="me/run")
    written = [p for folder in ("run", "staged") for p in (tmp_path / folder).rglob("*") if p.is_file()]
    names = {str(p.relative_to(tmp_path)) for p in written}
    for name in ("run/recipe.yaml", "run/metrics.json", "run/final/xlipkit.json", "run/checkpoints/step-1/"
                 "train_state.json", "run/checkpoints/step-2/stream_index.json", "staged/recipe.yaml",
                 "staged/metrics.json", "staged/xlipkit.json", "staged/README.md"):
        assert name in names, sorted(names)
    for path in written:
        data = path.read_bytes()
        assert KEY_ID.encode() not in data and SECRET.encode() not in data, path
    assert "key: '***'" in (tmp_path / "run" / "recipe.yaml").read_text()
    assert KEY_ID not in caplog.text and SECRET not in caplog.text


def test_xlipkit_validate_never_prints_a_url_credential(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The preflight reads the recipe's values as given (a masked URL is refused as masked) and every line it prints
    masks them: the needs listed, the error, the command it repeats."""
    from finetune.cli.validate import main

    path = tmp_path / "r.yaml"
    path.write_text("# r\ntrain: {max_steps: 2}\neval: {sets: []}\n", encoding="utf-8")
    urls = f"data.train={{name: webdataset, urls: '{tmp_path}/missing-{{0..1}}.tar?token={SIGNATURE}'}}"
    assert main([str(path), urls, f"data.train.options.storage_options.password={URL_PASSWORD}"]) == 2
    out = "".join(capsys.readouterr())
    assert SIGNATURE not in out and URL_PASSWORD not in out, out
    assert "missing-0.tar?token=***" in out and "do not exist" in out
