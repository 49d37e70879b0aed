"""The model layer's layout (DESIGN 2): the old module paths still import, and no import circle runs through
``finetune.models``, the StructXLIP folder or ``finetune.preview``."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

MOVED = {
    "finetune.models.encoder": "finetune.models.core.encoder",
    "finetune.models.tokens": "finetune.models.core.tokens",
    "finetune.models.spans": "finetune.models.core.spans",
    "finetune.models.hf": "finetune.models.backends.hf",
    "finetune.models.openclip": "finetune.models.backends.openclip",
    "finetune.models.pooled_tower": "finetune.models.backends.pooled_tower",
    "finetune.models.activations": "finetune.models.backends.activations",
    "finetune.models.flair": "finetune.models.families.flair",
    "finetune.models.vision_text": "finetune.models.families.vision_text",
    "finetune.models.fcast": "finetune.models.families.fcast",
    "finetune.models.loading": "finetune.models.finetuned",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_moved_module(old: str) -> None:
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old]) and sys.modules[old] is module


def test_names_that_moved_between_modules_still_import_from_the_old_one() -> None:
    from finetune.models import adapters, finetuned, registry
    from finetune.models.backends import openclip
    from finetune.models.encoder import DualEncoder, TokenizedText
    from finetune.models.tokens import TokenizedText as moved

    assert TokenizedText is moved and DualEncoder.__module__ == "finetune.models.core.encoder"
    for name in ("save_finetuned", "load_finetuned", "read_info", "INFO_NAME", "FORMAT_VERSION"):
        assert getattr(adapters, name) is getattr(finetuned, name), name
    assert registry.TIMM_TINY_SIGLIP == openclip.TIMM_TINY_SIGLIP
    assert registry.register_tiny_timm_siglip is openclip.register_tiny_timm_siglip
    assert registry.REGISTRY["tiny-clip"].backend == "hf" and registry.ALIASES["vit-b/16"] == "clip-vit-base-patch16"
    assert registry.FAMILY_CONFIGS == {"fcast": {"fcast-b": True, "fcast-s": True, "fcast-tiny": False}}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        adapters.nothing  # noqa: B018


def _import_graph() -> dict[str, set[str]]:
    """Module -> the toolkit modules it imports (function-level imports too), from the source."""
    files = [*REPO.glob("finetune/**/*.py"), *REPO.glob("losses/**/*.py")]
    mods = {}
    for path in files:
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _ours(module: str) -> bool:
    # inference_modules belongs to the registries' work (issue 25, item 2), checked with them
    return ((module.startswith("finetune.models") and module != "finetune.models.inference_modules")
            or module.startswith("finetune.objectives.structxlip") or module == "finetune.preview")


def test_no_import_circle_through_the_model_layer_structxlip_or_the_preview() -> None:
    assert [c for c in _cycles(_import_graph()) if any(_ours(m) for m in c)] == []


def test_the_circle_check_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
