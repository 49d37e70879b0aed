"""Tokenisation shared by the backends: :class:`TokenizedText`, truncation that keeps the end token, and padding.

Long captions are the point of this toolkit, so a caption that does not fit is cut in its middle
content, never at its end token (Long-CLIP's ``tokenize`` forces the last token to EOT; HF
tokenizers keep the special suffix when they truncate), and the cut is reported per caption.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class TokenizedText:
    """Token ids of a batch of captions, padded to a common length.

    Attributes:
        input_ids: ``(B, L)`` token ids.
        attention_mask: ``(B, L)`` 1 for real tokens.
        truncated: ``(B,)`` bool, True where the caption did not fit and was cut (end token kept).
    """

    input_ids: Tensor
    attention_mask: Tensor
    truncated: Tensor

    def to(self, device: torch.device | str) -> TokenizedText:
        """Move the three tensors to ``device``."""
        return TokenizedText(
            self.input_ids.to(device), self.attention_mask.to(device), self.truncated.to(device)
        )


def truncate_keep_end(ids: Sequence[int], max_length: int, n_end: int) -> tuple[list[int], bool]:
    """Cut ``ids`` to ``max_length`` tokens, keeping its last ``n_end`` tokens (the end token).

    Returns the (possibly shortened) list and whether it was cut.
    """
    if len(ids) <= max_length:
        return list(ids), False
    if n_end >= max_length:
        raise ValueError(f"max_length={max_length} leaves no room for content next to {n_end} end token(s)")
    head = list(ids[: max_length - n_end])
    tail = list(ids[len(ids) - n_end :]) if n_end else []
    return head + tail, True


def pad_batch(
    seqs: Sequence[Sequence[int]], length: int, pad_id: int, *, side: str = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to ``length``: ``(input_ids (B, length), attention_mask (B, length))``."""
    import numpy as np

    ids = np.full((len(seqs), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), length), dtype=np.int64)
    for i, s in enumerate(seqs):  # numpy row assignment: no tensor per row (this runs per batch in the workers)
        n = len(s)
        if side == "left":
            ids[i, length - n :] = s
            mask[i, length - n :] = 1
        else:
            ids[i, :n] = s
            mask[i, :n] = 1
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    return ids, mask


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """The token ids of ``texts`` with special tokens, untruncated, unpadded: what ``tokenizer(texts)`` gives.
    A fast tokenizer whose backend has no truncation or padding set is called directly
    (``encode_batch_fast``: the same ids without the character offsets, about 20 % less time)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None and getattr(backend, "truncation", 0) is None and getattr(backend, "padding", 0) is None:
        return [e.ids for e in fast(texts, add_special_tokens=True)]
    return tokenizer(texts, add_special_tokens=True, truncation=False, padding=False, verbose=False)["input_ids"]


def special_suffix_length(tokenizer: Any) -> int:
    """How many special tokens an HF tokenizer appends after the content (1 for CLIP's EOS and
    T5's ``</s>``, 0 for a tokenizer that adds none)."""
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return len(full) - start - len(bare)
    special = set(getattr(tokenizer, "all_special_ids", []))
    n = 0
    while n < len(full) and full[len(full) - 1 - n] in special:
        n += 1
    return n


def hf_tokenize(
    tokenizer: Any,
    texts: list[str],
    max_length: int,
    *,
    padding: str = "max_length",
    clean: Callable[[str], str] | None = None,
) -> TokenizedText:
    """Tokenise with a transformers tokenizer, truncating with the special suffix kept.

    Args:
        tokenizer: a transformers tokenizer (fast or slow).
        texts: ``B`` captions.
        max_length: the most tokens a caption may have, special tokens included.
        padding: ``"max_length"`` (pad every row to ``max_length``) or ``"longest"``.
        clean: optional text clean-up applied first (open_clip's ``clean_fn``).

    Returns:
        :class:`TokenizedText` with ``(B, L)`` ids and mask and ``(B,)`` truncation flags.
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string: wrap it as [text]")
    if clean is not None:
        texts = [clean(t) for t in texts]
    n_end = special_suffix_length(tokenizer)
    rows, flags = [], []
    for ids in _encode(tokenizer, list(texts)):
        cut, was_cut = truncate_keep_end(ids, max_length, n_end)
        rows.append(cut)
        flags.append(was_cut)
    if padding == "max_length":
        length = max_length
    elif padding == "longest":
        length = max((len(r) for r in rows), default=1)
    else:
        raise ValueError(f"padding must be 'max_length' or 'longest', got {padding!r}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask = pad_batch(rows, length, pad_id, side=getattr(tokenizer, "padding_side", "right"))
    return TokenizedText(ids, mask, torch.tensor(flags, dtype=torch.bool))
