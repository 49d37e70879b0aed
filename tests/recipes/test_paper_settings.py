"""Every "Paper settings" line of every shipped recipe is something its paper states (issue 33).

A recipe header lists what it takes from a paper in blocks of this form::

    # Paper settings (StructXLIP):
    #   - l1 = 0.25, l2 = 0.1, l3 = 0.1 (section 4, Implementation details)
    #   - batch 16 (D.2)

Each line must be ``<text> (<where>)`` of an entry of that paper in ``paper_settings.yaml`` (the table of what
each paper states, with the paper's own words), and the recipe must hold the values the entry fixes. Everything
else a header says is labelled with its source outside these blocks. A recipe that trains with a paper's method
(its objective term, or its model family for F-CAST) has a block for that paper.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune.config import load_recipe, recipe_to_dict

HERE = Path(__file__).resolve().parent
RECIPES = sorted((HERE.parents[1] / "recipes").glob("*.yaml"))
TABLE = yaml.safe_load((HERE / "paper_settings.yaml").read_text(encoding="utf-8"))
BLOCK = re.compile(r"^# Paper settings \((?P<name>[^()]+)\):$")
ITEM = re.compile(r"^#   - (?P<claim>.+)$")
CLAIM = re.compile(r"^(?P<text>.+) \((?P<where>[^()]+)\)$")
#: objective term -> the paper whose method it is
TERM_PAPERS = {"structxlip": "structxlip", "fastgoal": "fast_goal", "grm": "grm", "flair": "flair", "fcast": "fcast"}
NAMES = {entry["name"]: key for key, entry in TABLE.items()}
_MISSING = object()


def header(path: Path) -> list[str]:
    """The comment lines before the recipe's first key."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            break
        lines.append(line)
    return lines


def paper_blocks(lines: list[str]) -> list[tuple[str, list[tuple[int, str]]]]:
    """``[(paper name as written, [(line number, claim), ...]), ...]`` of a header's "Paper settings" blocks."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    current: list[tuple[int, str]] | None = None
    for number, line in enumerate(lines, start=1):
        match = BLOCK.match(line)
        if match:
            current = []
            blocks.append((match["name"], current))
            continue
        item = ITEM.match(line) if current is not None else None
        if item:
            current.append((number, item["claim"]))
        else:
            current = None
    return blocks


def _get(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _holds(actual: Any, expected: Any) -> bool:
    if isinstance(expected, dict) and set(expected) == {"one_of"}:
        return any(_holds(actual, e) for e in expected["one_of"])
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and isinstance(actual, (int, float)):
        return abs(float(actual) - float(expected)) <= 1e-12 * max(1.0, abs(float(expected)))
    if isinstance(expected, list) and isinstance(actual, (list, tuple)):
        return len(expected) == len(actual) and all(_holds(a, e) for a, e in zip(actual, expected))
    return actual == expected


def check_recipe(path: Path, table: dict[str, Any] = TABLE) -> list[str]:
    """The problems of one recipe's "Paper settings" blocks against ``table``: unknown papers, lines that are
    not ``<text> (<where>)``, claims the table does not hold for that paper, values the recipe does not hold,
    and a paper whose method the recipe trains with but lists no block for."""
    names = {entry["name"]: key for key, entry in table.items()}
    resolved = recipe_to_dict(load_recipe(path))
    problems = []
    listed = set()
    for name, claims in paper_blocks(header(path)):
        key = names.get(name)
        if key is None:
            problems.append(f"'Paper settings ({name})': no such paper in paper_settings.yaml ({sorted(names)})")
            continue
        listed.add(key)
        if not claims:
            problems.append(f"'Paper settings ({name})' lists nothing (write '#   - <text> (<where>)' lines)")
        entries = {(c["text"], c["where"]): c for c in table[key]["claims"]}
        for number, claim in claims:
            match = CLAIM.match(claim)
            if not match:
                problems.append(f"line {number}: {claim!r} is not '<text> (<where>)'")
                continue
            entry = entries.get((match["text"], match["where"]))
            if entry is None:
                same_text = [w for t, w in entries if t == match["text"]]
                hint = f" (the table has it at: {'; '.join(same_text)})" if same_text else ""
                problems.append(f"line {number}: {name} does not state {claim!r} in paper_settings.yaml{hint}")
                continue
            for dotted, expected in (entry.get("values") or {}).items():
                actual = _get(resolved, dotted)
                if actual is _MISSING or not _holds(actual, expected):
                    shown = "absent" if actual is _MISSING else repr(actual)
                    problems.append(f"line {number}: {claim!r} needs {dotted} = {expected!r}, the recipe has {shown}")
    trained = {TERM_PAPERS[t] for t in (resolved["objective"].get("terms") or {}) if t in TERM_PAPERS}
    base = resolved["objective"].get("base")
    if base in TERM_PAPERS:
        trained.add(TERM_PAPERS[base])
    for key in sorted(trained - listed):
        problems.append(f"trains with {table[key]['name']}'s method but has no '# Paper settings ({table[key]['name']}):' "
                        "block")
    return problems


def test_the_table_is_well_formed():
    assert set(TABLE) == set(TERM_PAPERS.values())
    for key, entry in TABLE.items():
        seen = set()
        for claim in entry["claims"]:
            assert set(claim) <= {"text", "where", "quote", "values"}, (key, claim)
            assert claim["text"] and claim["where"] and claim["quote"], (key, claim)
            assert "(" not in claim["where"] and ")" not in claim["where"], (key, claim)
            assert (claim["text"], claim["where"]) not in seen, (key, claim["text"])
            seen.add((claim["text"], claim["where"]))
            line = f"#   - {claim['text']} ({claim['where']})"
            assert len(line) <= 120, f"{key}: {line!r} is longer than a recipe line may be"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_paper_settings_are_what_the_paper_states(path):
    problems = check_recipe(path)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_the_check_catches_a_claim_no_paper_makes(tmp_path):
    """The check itself: the K = 3 the issue found, a section that does not state it, a value the recipe does not
    hold, and a method recipe without a block, each fail."""
    shipped = (HERE.parents[1] / "recipes" / "structxlip_docci.yaml").read_text(encoding="utf-8")
    assert "#   - batch 16 (D.2)" in shipped
    cases = {
        "#   - batch 16 (D.2)\n#   - K = 3 regions per chunk (D.2)": "does not state 'K = 3 regions per chunk (D.2)'",
        "#   - batch 16 (section 4, Implementation details)": "the table has it at: D.2",
    }
    for replacement, expected in cases.items():
        path = tmp_path / "structxlip_docci.yaml"
        path.write_text(shipped.replace("#   - batch 16 (D.2)", replacement), encoding="utf-8")
        assert any(expected in p for p in check_recipe(path)), expected
    path.write_text(shipped.replace("  batch_size: 16\n", "  batch_size: 32\n"), encoding="utf-8")
    assert any("needs train.batch_size = 16, the recipe has 32" in p for p in check_recipe(path))
    path.write_text(shipped.replace("# Paper settings (StructXLIP):", "# Settings:"), encoding="utf-8")
    assert any("has no '# Paper settings (StructXLIP):' block" in p for p in check_recipe(path))


PAPERS = os.environ.get("XLIPKIT_PAPERS")


@pytest.mark.skipif(not PAPERS, reason="XLIPKIT_PAPERS names no folder with the papers' text")
@pytest.mark.parametrize("key", sorted(TABLE))
def test_quotes_are_the_papers_words(key):
    """Each entry's quote is in the paper (whitespace normalised): the table says what the paper says."""
    text = re.sub(r"\s+", " ", (Path(PAPERS) / f"{key}.txt").read_text(encoding="utf-8"))
    missing = [c["quote"] for c in TABLE[key]["claims"] if re.sub(r"\s+", " ", c["quote"]).strip() not in text]
    assert not missing, f"{key}: quotes not found in the paper: {missing}"
