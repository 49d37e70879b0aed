"""Secrets in recipes (``hub.token``, and the object-storage credentials of :mod:`finetune.credentials`: the
``storage_options`` keys ``key``, ``secret``, ``token``, ``password``, ..., its headers, credentials inside URLs),
found by their key wherever they are given: a flat override (``hub.token=...``), a section override
(``'hub={token: ...}'``), a nested YAML mapping in a recipe file.

Two operations, one rule for what is secret:

- :func:`mask_secrets` is the one masking of text shown or written: error messages, logs, the comment lines of a
  run's ``recipe.yaml`` copied into a model card. It hides the values of secret keys (``token: X``,
  ``token=X``), any value given in ``secrets`` (those collected by key from the recipe being loaded), and anything
  shaped like a Hugging Face token (``hf_...``), whatever its key. :func:`mask_override` shows one
  ``key=value`` override that way.
- :func:`without_secrets` is an override as it is written into a run's ``recipe.yaml`` header or a command the
  user is told to run again: the secret keys left out (a token belongs in ``HF_TOKEN``, a storage credential in
  the filesystem's usual places), the rest still valid.
- :func:`clean_recipe` is a recipe tree as a file holds it: ``hub.token`` left out, every storage credential and
  every credential inside a URL masked (``***``).

This module is the bottom of :mod:`finetune.config`: it imports nothing of it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from finetune.credentials import credential_path, mask_data, mask_text

__all__ = ["SECRET_PATHS", "clean_recipe", "mask_override", "mask_secrets", "override_secrets", "secret_key",
           "secret_values", "without_secrets"]

#: the recipe keys that hold a secret: never written into a file, never printed
SECRET_PATHS = frozenset({("hub", "token")})
#: what masked text shows in place of a secret
MASK = "***"
#: what a Hugging Face token looks like (any key, or none)
_TOKEN_VALUE = re.compile(r"\b(hf_)[A-Za-z0-9]{10,}")
_SECRET_WORDS = ("token", "secret", "password", "passwd", "apikey", "api_key", "credential", "auth")
#: ``name: value`` / ``name=value`` in free text (a YAML line, a flow mapping, an override, a command line) where
#: the name's last part is a secret word as a whole (``token``, ``hub.token``, ``HF_TOKEN``, ``access-token``, not
#: ``tokenizer`` or ``max_tokens``: :data:`_SECRET_LAST`) and is not quoted in backticks (messages write keys as
#: `hub.token`). A name is taken whole (a run of name characters, never part of one) and tested apart, so that the
#: patterns stay linear on any text (a 32 kB run of ``a-a-...`` took 40 s with the name inside the pattern)
_SECRET_LAST = re.compile(r"(?:[A-Za-z0-9]+[_-])*(?:token|secret|password|passwd|apikey|api[_-]key|credentials?|"
                          r"auth)(?:[_-][A-Za-z0-9]+)*", re.IGNORECASE)
#: a ``name:`` / ``name=`` (its value follows: :data:`_VALUE`)
_KEY_VALUE = re.compile(r"""(?<![`\w.\-"'])["']?(?P<name>[\w.\-]++)["']?[ \t]*+(?::[ \t]+|:$|=)[ \t]*+""",
                        re.MULTILINE)
#: ``--name`` on a command line followed by its value after a space, the name as in :data:`_KEY_VALUE`
_OPTION_VALUE = re.compile(r"""(?<!\S)(?P<name>--?[\w.\-]++)[ \t]++(?=[^\s-])""")
#: the value after a name: quoted, a flow list, or up to the next space, comma or bracket
_VALUE = re.compile(r""""(?:[^"\\]|\\.)*+"|'(?:[^']|'')*+'|\[[^\]\n]*+\]?|[^\s,{}\[\]]++""")
_ARGUMENT = re.compile(r"\S++")


def _mask_values(text: str, names: re.Pattern, values: re.Pattern) -> str:
    """``text`` with the value after every name found by ``names`` whose last part is a secret's
    (:data:`_SECRET_LAST`) replaced by ``***``."""
    out, pos = [], 0
    for match in names.finditer(text):
        if match.start() < pos or not _SECRET_LAST.fullmatch(match.group("name").lstrip("-").rsplit(".", 1)[-1]):
            continue
        value = values.match(text, match.end())
        if value is None:
            continue
        out += [text[pos:match.end()], MASK]
        pos = value.end()
    return "".join([*out, text[pos:]])


#: secrets shorter than this are hidden where their key shows them, not searched for in free text (a token of
#: one or two characters would mask every number in a message)
_MIN_SEARCHED = 4
#: overrides parsed to find their secrets: at most this long, without anchors or aliases
_MAX_PARSED = 1 << 16
_ALIAS = re.compile(r"(?:^|[\s\[{,:])[&*]")


def secret_key(key: Any) -> bool:
    """Whether a recipe key looks like it holds a secret: it contains ``token``, ``secret``, ``password``,
    ... or is a near miss of one (``tokn``, ``tocken``), as a mistyped ``hub.token`` is."""
    word = str(key).lower()
    if any(w in word for w in _SECRET_WORDS):
        return True
    return bool(difflib.get_close_matches(word, ["token", "secret", "password"], n=1, cutoff=0.75))


def _names_secret(text: str) -> bool:
    """Whether any word of ``text`` is a secret key (:func:`secret_key`)."""
    return any(secret_key(w) for w in re.findall(r"[A-Za-z_]\w*", text))


def _scalars(value: Any) -> list[str]:
    """Every scalar under ``value`` as text (a token given as a list or a number is still a secret)."""
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _scalars(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _scalars(v)]
    return [] if value is None or isinstance(value, bool) else [str(value)]


def secret_values(value: Any, path: tuple[Any, ...] = ()) -> list[str]:
    """The values under the secret keys (:func:`secret_key`) of plain data, as text, at any depth.

    Args:
        value: a recipe tree, a section, or an override's value.
        path: where ``value`` sits in the recipe (an override's key path): a value below a secret key is
            secret whole.
    """
    if path and (secret_key(path[-1]) or credential_path(path)):
        return _scalars(value)
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in secret_values(v, (*path, k))]
    if isinstance(value, (list, tuple)):
        return [s for i, v in enumerate(value) for s in secret_values(v, (*path, i))]
    return []


def _parsed(override: str) -> tuple[tuple[str, ...], Any] | None:
    """``(key path, value)`` of a ``key.sub=value`` override, or None when it is not one, its value is not
    YAML, or it is not worth parsing here: over 64 KiB or with YAML anchors or aliases (which could expand
    without bound: the recipe's own loader bounds them, and this module is below it)."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or not re.fullmatch(r"[\w.-]+", key) or len(raw) > _MAX_PARSED or _ALIAS.search(raw):
        return None
    try:
        return tuple(key.split(".")), (yaml.safe_load(raw) if raw.strip() else None)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None


def override_secrets(overrides: Iterable[str]) -> list[str]:
    """The values that ``key=value`` overrides give to secret keys (:func:`secret_values`), as text; an override
    that names a secret key but does not parse gives its whole value."""
    found = []
    for text in overrides:
        parsed = _parsed(text)
        if parsed is not None:
            found += secret_values(parsed[1], parsed[0])
        elif _names_secret(text):
            found.append(text.partition("=")[2].strip())
    return found


def mask_secrets(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` as it may be shown or written: the value of every secret key in it (``token: X``,
    ``hub.token=X``, ``{"token": "X"}``, ``--token X``) replaced by ``***``, every value of ``secrets`` (at least 4
    characters) wherever it appears, every ``hf_...`` token, and the credentials inside URLs, headers and AWS key
    ids (:func:`finetune.credentials.mask_text`).

    Args:
        text: a message, a log line, the comment lines of a recipe, a command line.
        secrets: values known to be secret (:func:`secret_values` of the recipe and overrides in use).
    """
    for secret in sorted({s for s in secrets if len(s) >= _MIN_SEARCHED}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _mask_values(text, _KEY_VALUE, _VALUE)
    text = _mask_values(text, _OPTION_VALUE, _ARGUMENT)
    return mask_text(_TOKEN_VALUE.sub(lambda m: m.group(1) + MASK, text))


def _masked(value: Any, path: tuple[Any, ...]) -> Any:
    """``value`` (set at ``path``) with the values under secret keys replaced by ``***``."""
    if path and (secret_key(path[-1]) or credential_path(path)):
        return MASK
    if isinstance(value, Mapping):
        return {k: _masked(v, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(v, (*path, i)) for i, v in enumerate(value)]
    return value


def mask_override(text: str) -> str:
    """A ``key=value`` override as messages show it: the values under its secret keys hidden, by key, whatever
    they look like (``hub.token=***``, ``hub={token: '***', repo_id: me/x}``, also for a near miss such as
    ``hub.tokn``). An override whose value is not YAML and names a secret key shows no value at all."""
    parsed = _parsed(text)
    key, sep, raw = text.partition("=")
    if parsed is None:
        if sep and raw.strip() and _names_secret(text):
            return f"{key}={MASK}"
        return mask_secrets(text)
    path, value = parsed
    if (secret_key(path[-1]) or credential_path(path)) and sep and raw.strip():
        return f"{key}={MASK}"
    if not secret_values(value, path) and _masked(value, path) == value:
        return mask_secrets(text)
    shown = yaml.safe_dump(_masked(value, path), default_flow_style=True, width=float("inf"), allow_unicode=True,
                           sort_keys=False)
    return mask_secrets(f"{key}={shown.strip()}")


def _drop(value: Any, path: tuple[str, ...]) -> tuple[Any, bool]:
    """``value`` (set at ``path``) less the keys of :data:`SECRET_PATHS` below it, and whether any was there."""
    if not isinstance(value, dict):
        return value, False
    out, dropped = {}, False
    for k, v in value.items():
        sub = (*path, str(k))
        if sub in SECRET_PATHS or credential_path(sub):
            dropped = True
            continue
        out[k], below = _drop(v, sub)
        dropped = dropped or below
    return out, dropped


def without_secrets(override: str) -> str | None:
    """An override as a file or a command repeats it: None for one that sets a secret key (``hub.token=...``),
    a section override re-written without its secret keys (``'hub={token: X, repo_id: me/x}'`` ->
    ``hub={repo_id: me/x}``), any other override unchanged. Only the recipe's secret keys (:data:`SECRET_PATHS`)
    and the storage credentials (:func:`finetune.credentials.credential_path`) are left out, so that what remains
    sets the same recipe but for them; an override that this module does not parse (YAML anchors, over 64 KiB) and
    that names a secret word is left out whole (None). Credentials inside URLs stay: mask the text shown
    (:func:`mask_secrets`)."""
    parsed = _parsed(override)
    if parsed is None:  # not parsed here (anchors, size): left out whole when it may hold a secret
        return None if _names_secret(override) else override
    path, value = parsed
    if any(path[:len(p)] == p for p in SECRET_PATHS) or credential_path(path):
        return None
    clean, dropped = _drop(value, path)
    if not dropped:
        return override
    shown = yaml.safe_dump(clean, default_flow_style=True, width=float("inf"), allow_unicode=True,
                           sort_keys=False).strip()
    return f"{override.partition('=')[0].strip()}={shown}"


def clean_recipe(recipe: Any) -> Any:
    """A recipe tree (plain data) as a file may hold it: the keys of :data:`SECRET_PATHS` left out (``hub.token``),
    every storage credential and every credential inside a URL masked (:func:`finetune.credentials.mask_data`).
    Anything that is not a mapping is returned as it is."""
    if not isinstance(recipe, Mapping):
        return recipe
    out = mask_data(recipe)
    for section, key in SECRET_PATHS:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out
