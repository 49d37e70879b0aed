"""What the README tells a newcomer holds: its losses snippet runs and trains StructXLIP's temperature, the
zero-shot templates the evaluation guide lists (and any the README names) are the CLI's, and the accelerate
configs the pages name exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
EVALUATION_GUIDE = (REPO / "docs" / "guides" / "evaluation.md").read_text(encoding="utf-8")


def _section(title: str, text: str = README) -> str:
    """The ``## title`` section of ``text`` (the README unless given), up to the next ``## `` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_the_losses_snippet_runs_and_its_structxlip_temperature_reaches_the_optimiser(capsys):
    [snippet] = [b for b in _code_blocks(_section("Losses library"), "python") if "StructXLIPLoss" in b]
    namespace: dict = {}
    exec(compile(snippet, "README.md (Losses library)", "exec"), namespace)  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out.splitlines()
    [shown] = _code_blocks(_section("Losses library"), "text")  # what the README says it prints
    assert len(printed) == 3 and all(line.startswith(f"step {i}: loss ") for i, line in enumerate(printed))
    for line, expected in zip(printed, shown.splitlines()):
        got, want = (list(map(float, re.findall(r"-?\d+\.\d+", t))) for t in (line, expected))
        assert got == pytest.approx(want, abs=0.011), (line, expected)  # the same, up to a CPU's last digit
        total, clip, structxlip_sum, structure, consistency, local = got
        assert total == pytest.approx(clip + structxlip_sum, abs=0.011)
        assert structxlip_sum == pytest.approx(0.25 * structure + 0.1 * consistency + 0.1 * local, abs=0.011)
    structxlip, optimizer = namespace["structxlip"], namespace["optimizer"]
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = list(structxlip.parameters())
    assert params and all(id(p) in optimised for p in params)
    assert structxlip.structure_logit_scale.item() != pytest.approx(2.659260, abs=1e-6)  # it trained
    assert torch.isfinite(namespace["loss"])


def test_the_zero_shot_templates_the_docs_list_are_the_clis():
    from finetune.cli.evaluate import _parser
    from finetune.evaluation.zeroshot import TEMPLATES

    match = re.search(r"`--templates ([\w|]+)`, default `(\w+)`", _section("Zero-shot classification", EVALUATION_GUIDE))
    assert match, "docs/guides/evaluation.md names the --templates choices and default"
    choices, default = match.group(1).split("|"), match.group(2)
    assert choices == [*TEMPLATES, "FILE"]
    assert default == _parser().get_default("templates")
    for example in re.findall(r"--templates (\w+)\b", README + EVALUATION_GUIDE):
        assert example in TEMPLATES


def test_the_accelerate_configs_the_pages_name_exist():
    """Every `--config_file` of the README and the docs names a shipped config; the README's DDP line and the
    getting-started page's one-process launch use them."""
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    named = {path for page in pages
             for path in re.findall(r"--config_file (configs/[\w/.-]+?\.yaml)", page.read_text("utf-8"))}
    assert {"configs/accelerate/one_process.yaml", "configs/accelerate/multi_gpu.yaml"} <= named
    assert all((REPO / path).is_file() for path in named), named
    assert "--config_file configs/accelerate/multi_gpu.yaml --num_processes 8" in README
    launching = _section("Launching a run", (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8"))
    assert "accelerate launch --config_file configs/accelerate/one_process.yaml --quiet finetune/run.py " \
           "recipes/quickstart.yaml" in launching
