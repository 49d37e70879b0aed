"""Hub push, staging and export: the exact files uploaded, that they load on their own, the card's
front matter, that no token reaches a file or a message, that failed pushes leave the run alone,
and that exports load with plain transformers / open_clip and give the run's embeddings. A staged or exported folder
holds the marker that lets ``overwrite`` replace it (tests/finetune/hub/test_outputs.py); a push never uploads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from finetune import load_finetuned, load_model
from finetune.cli.hub import main
from finetune.hub import HubPushError, export, push, read_run, stage_upload
from finetune.hub.model_card import read_front_matter
from finetune.hub.upload import MARKER_NAME
from tests.finetune.hub.hub_runs import AFTER, CAPTIONS, FAKE_TOKEN, embeddings, images, make_run, snapshot

REPO_ID = "me/tiny-clip-long"
ADAPTER_FILES = {"README.md", "adapter_config.json", "adapter_model.safetensors", "xlipkit_extra.safetensors",
                 "xlipkit.json", "recipe.yaml", "metrics.json", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json"}
FULL_HF_FILES = {"README.md", "config.json", "model.safetensors", "xlipkit.json", "recipe.yaml", "metrics.json",
                 "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"}


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run over the ``tiny-clip`` registry config (a base anyone with xlipkit can build),
    whose recipe files still hold a hub token, as an old or hand-edited recipe might."""
    return make_run(tmp_path_factory.mktemp("runs") / "clip-lora", "tiny-clip", "lora", token=FAKE_TOKEN)


class FakeHub:
    """Stands in for the three ``HfApi`` calls that reach the network; ``upload_folder`` copies
    what it is given, so the test sees exactly what would have been uploaded."""

    def __init__(self, copy_to: Path, fail: BaseException | None = None) -> None:
        self.copy_to = copy_to
        self.fail = fail
        self.calls: list[tuple[str, dict]] = []
        self.tokens: list[str | None] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeHub":
        from huggingface_hub import HfApi

        fake = self

        def create_repo(api, repo_id, **kw):
            fake.tokens.append(api.token)
            fake.calls.append(("create_repo", {"repo_id": repo_id, **kw}))

        def create_branch(api, repo_id, **kw):
            fake.calls.append(("create_branch", {"repo_id": repo_id, **kw}))

        def upload_folder(api, **kw):
            fake.calls.append(("upload_folder", kw))
            if fake.fail is not None:
                raise fake.fail
            import shutil

            shutil.copytree(kw["folder_path"], fake.copy_to)
            return SimpleNamespace(commit_url=f"https://huggingface.co/{kw['repo_id']}/commit/abc", oid="abc")

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        return self


def _assert_close(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], atol: float = 1e-5) -> None:
    for x, y in zip(a, b):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


# -- staging and push --------------------------------------------------------------------------------
@pytest.mark.slow
def test_stage_upload_writes_a_complete_adapter_folder_that_loads_on_its_own(clip_run: Path, tmp_path: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    before = snapshot(clip_run)
    out = stage_upload(clip_run, tmp_path / "upload", repo_id=REPO_ID)

    assert {p.name for p in out.iterdir()} == ADAPTER_FILES | {MARKER_NAME}
    assert snapshot(clip_run) == before
    original = embeddings(load_finetuned(clip_run / "final"))
    _assert_close(embeddings(load_finetuned(out)), original, atol=0)
    # the adapter matters: the stretched base alone encodes differently
    base_text, _ = embeddings(load_model("tiny-clip", max_text_len=248))
    assert (base_text - original[0]).abs().max() > 1e-3
    assert AutoTokenizer.from_pretrained(out).model_max_length == 248
    assert type(AutoImageProcessor.from_pretrained(out)).__name__.startswith("CLIPImageProcessor")
    info = json.loads((out / "xlipkit.json").read_text())
    assert info["kind"] == "adapter" and info["base_model"] == "random:tiny-clip"
    assert "token" not in info["recipe"]["hub"]
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recipe["hub"] == {"push": True, "repo_id": "me/tiny", "private": True, "revision": None}
    assert (out / "recipe.yaml").read_text().startswith("# tiny test run\n")
    assert json.loads((out / "metrics.json").read_text())["after"] == AFTER


@pytest.mark.parametrize("token_from", ["argument", "HF_TOKEN"])
def test_push_uploads_the_staged_folder_with_a_card_and_never_the_token(
    clip_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture, token_from: str,
) -> None:
    hub = FakeHub(tmp_path / "uploaded").install(monkeypatch)
    before = snapshot(clip_run)
    caplog.set_level("DEBUG")
    if token_from == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
        result = push(clip_run, REPO_ID, revision="long-captions", commit_message="tiny run")
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
        result = push(clip_run, REPO_ID, token=FAKE_TOKEN, revision="long-captions", commit_message="tiny run")

    assert result.commit_url.startswith(f"https://huggingface.co/{REPO_ID}")
    assert [name for name, _ in hub.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert hub.tokens == [FAKE_TOKEN]
    assert hub.calls[0][1] == {"repo_id": REPO_ID, "private": True, "exist_ok": True, "repo_type": "model"}
    assert hub.calls[1][1]["branch"] == "long-captions"
    upload = hub.calls[2][1]
    assert (upload["repo_id"], upload["revision"], upload["commit_message"]) == (REPO_ID, "long-captions", "tiny run")
    assert not Path(upload["folder_path"]).exists()  # the staging folder is removed after the push

    uploaded = tmp_path / "uploaded"
    files = snapshot(uploaded)
    assert set(files) == ADAPTER_FILES
    assert [name for name, data in files.items() if FAKE_TOKEN.encode() in data] == []
    assert snapshot(clip_run) == before  # the run folder (token and all) is as it was
    captured = capsys.readouterr()
    assert FAKE_TOKEN not in caplog.text + captured.out + captured.err

    meta = read_front_matter(files["README.md"].decode())
    assert set(meta) == {"library_name", "pipeline_tag", "tags", "datasets", "model-index"}
    assert meta["library_name"] == "peft"
    assert meta["pipeline_tag"] == "zero-shot-image-classification"
    assert meta["tags"] == ["xlipkit", "clip", "long-captions", "structxlip", "long-clip", "lora", "peft"]
    assert meta["datasets"] == ["google/docci"]
    [entry] = meta["model-index"]
    assert entry["name"] == "tiny-clip-long"
    recall = {(r["task"]["type"], m["name"]): m["value"] for r in entry["results"] for m in r["metrics"]}
    assert recall == {("text-to-image-retrieval", "t2i R@1"): 25.0, ("text-to-image-retrieval", "t2i R@5"): 75.0,
                      ("image-to-text-retrieval", "i2t R@1"): 37.5, ("image-to-text-retrieval", "i2t R@5"): 87.5}
    assert {r["dataset"]["name"] for r in entry["results"]} == {"synthetic"}
    _assert_close(embeddings(load_finetuned(uploaded)), embeddings(load_finetuned(clip_run / "final")), atol=0)


def test_push_that_cannot_reach_the_hub_leaves_the_run_unchanged(clip_run: Path) -> None:
    before = snapshot(clip_run)
    # no patching: tests run with HF_HUB_OFFLINE=1, so the real create_repo call fails
    with pytest.raises(HubPushError) as err:
        push(clip_run, REPO_ID, token=FAKE_TOKEN)
    message = str(err.value)
    assert "HF_HUB_OFFLINE" in message and "unchanged" in message
    assert f"python -m finetune.hub push {clip_run} --repo-id {REPO_ID}" in message
    assert FAKE_TOKEN not in message
    assert snapshot(clip_run) == before


def test_push_refused_by_the_hub_says_what_to_do_without_echoing_the_token(
    clip_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    response = httpx.Response(403, request=httpx.Request("POST", "https://huggingface.co/api/me/upload"))
    refused = HfHubHTTPError(f"403 Forbidden: token {FAKE_TOKEN} cannot write to me", response=response)
    FakeHub(tmp_path / "uploaded", fail=refused).install(monkeypatch)
    before = snapshot(clip_run)
    with pytest.raises(HubPushError, match="write access") as err:
        push(clip_run, REPO_ID, token=FAKE_TOKEN)
    assert FAKE_TOKEN not in str(err.value) and "403 Forbidden" in str(err.value)
    assert snapshot(clip_run) == before
    assert not (tmp_path / "uploaded").exists()


def test_cli_push_failure_exits_nonzero_with_a_message(
    clip_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    before = snapshot(clip_run)
    status = main(["push", str(clip_run), "--repo-id", REPO_ID])
    captured = capsys.readouterr()
    assert status == 1
    failure = [line for line in captured.err.splitlines() if not line[:8].replace(":", "").isdigit()]  # log lines
    assert failure[0].startswith("push failed:") and "unchanged" in captured.err
    assert FAKE_TOKEN not in captured.out + captured.err
    assert snapshot(clip_run) == before


def test_push_without_any_token_says_how_to_log_in(
    clip_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import huggingface_hub.constants as hf_constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    hub = FakeHub(tmp_path / "uploaded").install(monkeypatch)
    with pytest.raises(HubPushError, match="HF_TOKEN.*hf auth login"):
        push(clip_run, REPO_ID)
    assert main(["push", str(clip_run), "--repo-id", REPO_ID]) == 1
    assert "no Hugging Face token" in capsys.readouterr().err
    assert hub.calls == []


def test_push_stops_when_the_token_is_left_in_a_run_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path / "run", "tiny-clip", "lora", metrics_extra={"note": f"pushed with {FAKE_TOKEN}"})
    hub = FakeHub(tmp_path / "uploaded").install(monkeypatch)
    with pytest.raises(HubPushError, match=r"found in metrics\.json .*nothing was uploaded") as err:
        push(run, REPO_ID, token=FAKE_TOKEN)
    assert FAKE_TOKEN not in str(err.value)
    assert hub.calls == []


def test_a_token_in_a_section_override_never_reaches_the_card_or_the_staged_recipe(tmp_path: Path) -> None:
    """A run folder written before tokens were masked by key: its ``recipe.yaml`` header holds a whole-section
    override with a token that does not look like one, and a flat one."""
    secret = "mysecret-4f2a9c"
    run = make_run(tmp_path / "run", "tiny-clip", "lora")
    text = (run / "recipe.yaml").read_text()
    header = f"# tiny test run\n# overrides: train.lr=1e-5 'hub={{token: {secret}, push: true}}' hub.token={secret}-2\n"
    (run / "recipe.yaml").write_text(header + text.split("\n", 1)[1])
    out = stage_upload(run, tmp_path / "upload", repo_id=REPO_ID)
    leaked = [name for name, data in snapshot(out).items() if secret.encode() in data]
    assert leaked == []
    header = (out / "recipe.yaml").read_text().splitlines()[1]
    assert header == "# overrides: train.lr=1e-5 'hub={token: ***, push: true}' hub.token=***"
    assert header in (out / "README.md").read_text()  # the card shows the recipe as staged


def test_adapter_over_a_local_base_needs_merge_or_a_hub_base_id(tiny_dir, tmp_path: Path) -> None:
    from transformers import CLIPModel

    run = make_run(tmp_path / "run", str(tiny_dir("tiny-clip")), "lora")
    with pytest.raises(ValueError, match=r"local base model .*--merge.*--base-model"):
        stage_upload(run, tmp_path / "refused", repo_id=REPO_ID)
    assert not (tmp_path / "refused").exists()

    named = stage_upload(run, tmp_path / "named", repo_id=REPO_ID, base_model="openai/clip-vit-base-patch16")
    assert json.loads((named / "xlipkit.json").read_text())["base_model"] == "openai/clip-vit-base-patch16"
    peft_cfg = json.loads((named / "adapter_config.json").read_text())
    assert peft_cfg["base_model_name_or_path"] == "openai/clip-vit-base-patch16"
    card = (named / "README.md").read_text()
    assert read_front_matter(card)["base_model"] == "openai/clip-vit-base-patch16"
    assert 'AutoModel.from_pretrained("openai/clip-vit-base-patch16", config=config' in card

    merged = stage_upload(run, tmp_path / "merged", repo_id=REPO_ID, merge=True)
    assert {p.name for p in merged.iterdir()} == FULL_HF_FILES | {MARKER_NAME}
    meta = read_front_matter((merged / "README.md").read_text())
    assert meta["library_name"] == "transformers" and "peft" not in meta["tags"] and "lora" in meta["tags"]
    plain, loading = CLIPModel.from_pretrained(merged, output_loading_info=True)
    assert not any(loading.values())
    local = load_finetuned(run / "final")
    tok = local.tokenize(CAPTIONS)
    with torch.no_grad():
        text = plain.get_text_features(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
    text = text if isinstance(text, torch.Tensor) else text.pooler_output
    _assert_close((text,), (embeddings(local)[0],))


def test_stage_full_run_uploads_the_native_folder(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", "tiny-siglip", "full", train="synthetic")
    out = stage_upload(run, tmp_path / "upload", repo_id="me/tiny-siglip-long")
    assert {p.name for p in out.iterdir()} == FULL_HF_FILES | {MARKER_NAME}
    meta = read_front_matter((out / "README.md").read_text())
    assert meta["library_name"] == "transformers" and "datasets" not in meta
    assert meta["tags"][:2] == ["xlipkit", "siglip"]
    assert "SiglipModel.from_pretrained(\"me/tiny-siglip-long\")" in (out / "README.md").read_text()
    _assert_close(embeddings(load_finetuned(out)), embeddings(load_finetuned(run / "final")), atol=0)


def test_stage_and_read_run_reject_bad_input(clip_run: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no namespace"):
        stage_upload(clip_run, tmp_path / "a", repo_id="just-a-name")
    with pytest.raises(ValueError, match="not a hub repository id"):
        stage_upload(clip_run, tmp_path / "b", repo_id="a/b/c")
    with pytest.raises(ValueError, match="not a hub model id"):
        stage_upload(clip_run, tmp_path / "c", repo_id=REPO_ID, base_model="/models/clip")
    with pytest.raises(FileNotFoundError, match="neither a run folder"):
        read_run(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        stage_upload(clip_run, tmp_path / "busy", repo_id=REPO_ID)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"


def test_cli_stage_only_writes_the_upload_folder(clip_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["push", str(clip_run), "--repo-id", REPO_ID, "--stage-only", str(tmp_path / "up")]) == 0
    assert {p.name for p in (tmp_path / "up").iterdir()} == ADAPTER_FILES | {MARKER_NAME}
    assert "the folder `push` would upload" in capsys.readouterr().out
    assert main(["push", str(clip_run), "--repo-id", "bad", "--stage-only", str(tmp_path / "x")]) == 2


# -- export ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", ["lora", "dora"])
@pytest.mark.parametrize("name", ["tiny-clip", "tiny-siglip"])
def test_export_loads_with_plain_transformers_and_matches_the_run(tiny_dir, tmp_path: Path, name: str,
                                                                   adapter: str) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel, SiglipModel

    run = make_run(tmp_path / "run", str(tiny_dir(name)), adapter)
    out = export(run, tmp_path / "export")
    cls = CLIPModel if name == "tiny-clip" else SiglipModel
    plain, loading = cls.from_pretrained(out, output_loading_info=True)
    assert not any(loading.values()), loading
    plain.eval()
    assert plain.config.text_config.max_position_embeddings == 248
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.model_max_length == 248
    processor = AutoImageProcessor.from_pretrained(out)

    ours = load_finetuned(run / "final")
    padding = True if name == "tiny-clip" else "max_length"
    tok = tokenizer(CAPTIONS, padding=padding, truncation=True, return_tensors="pt")
    assert tok.input_ids.shape[1] > 77  # the long caption keeps its tokens past 77
    torch.testing.assert_close(tok.input_ids, ours.tokenize(CAPTIONS).input_ids)
    pixels = processor(images=images(), return_tensors="pt").pixel_values
    with torch.no_grad():
        kwargs = {"attention_mask": tok.attention_mask} if name == "tiny-clip" else {}
        text = plain.get_text_features(input_ids=tok.input_ids, **kwargs)
        image = plain.get_image_features(pixel_values=pixels)
    pooled = tuple(x if isinstance(x, torch.Tensor) else x.pooler_output for x in (text, image))
    _assert_close(pooled, embeddings(ours))


@pytest.mark.slow
def test_exported_folder_loads_where_xlipkit_cannot_be_imported(tiny_dir, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", str(tiny_dir("tiny-clip")), "lora")
    out = export(run, tmp_path / "export")
    ours = load_finetuned(run / "final")
    ids = ours.tokenize(CAPTIONS)
    torch.save({"input_ids": ids.input_ids, "attention_mask": ids.attention_mask}, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "sys.modules['finetune'] = None; sys.modules['losses'] = None   # xlipkit is not importable\n"
        "from transformers import CLIPModel\n"
        f"model = CLIPModel.from_pretrained({str(out)!r}).eval()\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r}, weights_only=True)\n"
        "with torch.no_grad():\n"
        "    out = model.get_text_features(**ids)\n"
        "out = out if isinstance(out, torch.Tensor) else out.pooler_output\n"
        f"torch.save(out, {str(tmp_path / 'text.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, capture_output=True,
                   env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    _assert_close((torch.load(tmp_path / "text.pt", weights_only=True),), (embeddings(ours)[0],))


def test_export_of_an_open_clip_run_loads_with_open_clip(tiny_dir, tmp_path: Path) -> None:
    import open_clip

    run = make_run(tmp_path / "run", str(tiny_dir("tiny-openclip")), "lora")
    out = export(run, tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {"open_clip_config.json", "open_clip_model.safetensors", "xlipkit.json",
                                                 MARKER_NAME}
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"]["context_length"] == 248
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    model.eval()
    ids = tokenizer(CAPTIONS)
    assert ids.shape == (3, 248)
    ours = load_finetuned(run / "final")
    pixels = torch.stack([preprocess(im) for im in images()])
    torch.testing.assert_close(pixels, ours.preprocess_images(images())["pixel_values"])
    with torch.no_grad():
        plain = (model.encode_text(ids), model.encode_image(pixels))
        mine = (ours.encode_text(ids).embeds, ours.encode_image(pixels).embeds)
    _assert_close(plain, mine)


def test_export_rejects_other_formats_and_busy_folders(tiny_dir, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    run = make_run(tmp_path / "run", str(tiny_dir("tiny-openclip")), "lora")
    with pytest.raises(ValueError, match="exports to format 'open_clip' only"):
        export(run, tmp_path / "a", format="transformers")
    with pytest.raises(ValueError, match="is not one of"):
        export(run, tmp_path / "b", format="onnx")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main(["export", str(run), str(tmp_path / "busy")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "c")]) == 2
    assert main(["export", str(run), str(tmp_path / "ok"), "--format", "open_clip"]) == 0
    assert (tmp_path / "ok" / "open_clip_model.safetensors").is_file()


@pytest.mark.slow
def test_hub_roundtrip_example_trains_stages_and_loads_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "examples" / "hub_roundtrip.py"
    spec = importlib.util.spec_from_file_location("hub_roundtrip_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    status = example.main(["--stage-only", str(tmp_path / "upload"), "--out", str(tmp_path / "run"), "--steps", "2",
                           "--train-size", "32", "--eval-size", "16", "--adapter", "lora", "train.batch_size=16"])
    assert status == 0
    assert "round trip OK" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "upload").iterdir()} == ADAPTER_FILES | {MARKER_NAME}
    metrics = json.loads((tmp_path / "upload" / "metrics.json").read_text())
    meta = read_front_matter((tmp_path / "upload" / "README.md").read_text())
    [entry] = meta["model-index"]
    t2i = {m["name"]: m["value"] for r in entry["results"] if r["task"]["type"] == "text-to-image-retrieval"
           for m in r["metrics"]}
    assert t2i == {f"t2i {k}": round(v, 2) for k, v in metrics["after"]["synthetic"]["t2i"].items()}
