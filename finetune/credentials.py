"""The credentials a recipe can hold besides ``hub.token``, found and masked wherever a recipe, a URL or a message is
written or shown (``recipe.yaml``, ``metrics.json``, ``final/xlipkit.json``, checkpoints, the staged hub folder, the
model card, logs, errors, the resume command):

- object-storage options (``data.*.options.storage_options``, fsspec's keyword arguments): a key below a
  ``storage_options`` mapping whose name is a credential (:data:`CREDENTIAL_NAMES`: ``key``, ``secret``, ``token``,
  ``password``, ``session_token``, ``account_key``, ``sas_token``, ...; or any name holding ``token``, ``secret``,
  ``password``, ``credential``, ``auth``, ``cookie``, ``signature``, ``api_key``), the ``client_kwargs`` headers
  (``Authorization``, ``Cookie``, ``X-Api-Key``) included (:func:`credential_path`);
- credentials inside URLs, in any text: a user and password (``https://user:pass@host/``, shown ``https://***@host/``)
  and the query parameters of signed or tokened URLs (``?X-Amz-Signature=``, ``?X-Amz-Credential=``, ``?sig=``,
  ``?token=``, ``?key=``, shown ``=***``) (:func:`mask_text`);
- an ``Authorization`` / ``Cookie`` header or a ``curl -u user:pass`` in a ``pipe:`` command, and AWS access key ids
  (``AKIA...`` / ``ASIA...``) wherever they appear.

This module is of the ground floor: it imports nothing of the toolkit, so that the data readers (their errors and
logs) and the recipe code (:mod:`finetune.config.secrets`) share one rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CREDENTIAL_NAMES", "MASK", "credential_name", "credential_path", "mask_data", "mask_text",
           "masked_credentials"]

#: what masked text shows in place of a credential
MASK = "***"
#: fsspec / botocore / gcsfs / adlfs / HTTP keyword names that hold a credential (lower case, ``-`` as ``_``)
CREDENTIAL_NAMES = frozenset({
    "key", "secret", "token", "password", "passwd", "session_token", "security_token", "access_key",
    "access_key_id", "secret_key", "secret_access_key", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "account_key", "sas_token", "connection_string", "client_secret", "credential",
    "credentials", "api_key", "apikey", "x_api_key", "authorization", "proxy_authorization", "cookie",
    "private_key", "private_key_id", "refresh_token", "access_token", "id_token",
})
#: words that make any name under ``storage_options`` a credential
_WORDS = ("token", "secret", "password", "passwd", "credential", "auth", "cookie", "signature", "api_key", "apikey",
          "private_key")
#: ``scheme://user[:password]@``: the user part is masked whole (an access key id may stand there)
_USERINFO = re.compile(r"(?P<scheme>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*+://)(?P<user>[^\s/@?#'\"\[\]]++)@")
#: ``?name=value`` / ``&name=value``: masked where the name says it holds a signature, a token or a key
#: (:data:`_QUERY_WORDS`; the name is tested apart, so that the pattern stays linear on any text)
_QUERY = re.compile(r"(?P<name>[?&;][A-Za-z0-9_.-]+=)(?P<value>[^&#\s'\"]+)")
_QUERY_WORDS = re.compile(r"sig|token|key|credential|password|secret|auth|accessid|session", re.IGNORECASE)
#: ``Authorization: Bearer X`` / ``Cookie: a=b`` (a header in a ``pipe:`` command or a message)
_HEADER = re.compile(r"(?P<name>\b(?:Proxy-)?Authorization|\bCookie|\bX-Api-Key|\bX-Auth-Token)(?P<sep>\s*[:=]\s*)"
                     r"(?P<value>(?:(?:Bearer|Basic|Token|Digest)\s+)?[^\s'\"]+)", re.IGNORECASE)
#: ``curl -u user:pass`` / ``--user user:pass``
_USER_OPTION = re.compile(r"(?P<name>(?<!\S)(?:-u|--user|--proxy-user)[ \t=]+)(?P<value>['\"]?[^\s'\"]+['\"]?)")
#: AWS access key ids (long-term and temporary)
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")


def credential_name(name: Any) -> bool:
    """Whether ``name``, a key below ``storage_options``, names a credential (:data:`CREDENTIAL_NAMES`, or a name
    holding ``token``, ``secret``, ``password``, ``auth``, ...)."""
    word = str(name).lower().replace("-", "_")
    return word in CREDENTIAL_NAMES or any(w in word for w in _WORDS)


def credential_path(path: tuple[Any, ...]) -> bool:
    """Whether the value at ``path`` in a recipe (``("data", "train", "options", "storage_options", "secret")``) is a
    credential: its key names one (:func:`credential_name`) and it lies below a ``storage_options`` mapping."""
    return bool(path) and "storage_options" in (str(p) for p in path[:-1]) and credential_name(path[-1])


def mask_text(text: str) -> str:
    """``text`` with the credentials inside URLs, headers, ``-u user:pass`` options and AWS key ids masked (see the
    module); anything else unchanged."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: m.group("scheme") + MASK + "@", text)
    text = _QUERY.sub(lambda m: m.group("name") + MASK if _QUERY_WORDS.search(m.group("name")) else m.group(0), text)
    text = _HEADER.sub(lambda m: m.group("name") + m.group("sep") + MASK, text)
    text = _USER_OPTION.sub(lambda m: m.group("name") + MASK, text)
    return _AWS_KEY_ID.sub(MASK, text)


def mask_data(value: Any, path: tuple[Any, ...] = ()) -> Any:
    """A copy of plain data (a recipe tree, a report) with every credential masked: the values at credential paths
    (:func:`credential_path`) replaced by ``***``, every string passed through :func:`mask_text`."""
    if value is not None and credential_path(path):
        return MASK
    if isinstance(value, Mapping):
        return {k: mask_data(v, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_data(v, (*path, i)) for i, v in enumerate(value)]
    return mask_text(value) if isinstance(value, str) else value


def masked_credentials(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths below ``value`` whose credential reads ``***``: masked when a run wrote its ``recipe.yaml``, and
    useless as a credential (a run of that file must be given the credential again)."""
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in masked_credentials(v, (*path, k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in masked_credentials(v, (*path, i))]
    return [path] if value == MASK and credential_path(path) else []
