"""Tokenizers that are built without any download.

- :func:`clip_tokenizer`: the real CLIP BPE tokenizer (49,408 tokens) as a transformers
  ``CLIPTokenizer``, built from the vocabulary file open_clip ships
  (``open_clip/bpe_simple_vocab_16e6.txt.gz``); it gives the same ids as open_clip's
  ``SimpleTokenizer`` and OpenAI's ``clip.tokenize``.
- :func:`word_tokenizer`: a small deterministic WordPiece tokenizer (a few hundred tokens: common
  English words, single characters and ``##`` continuations) for the ``tiny-siglip*`` test models,
  whose real SentencePiece / Gemma vocabularies are not shipped with any installed package. Any
  English text tokenises (unknown words fall back to characters), and it appends ``</s>`` like
  SigLIP's T5 tokenizer.
"""

from __future__ import annotations

import functools
import gzip
import json
import string
import tempfile
from pathlib import Path
from typing import Any

#: open_clip's vocabulary construction (open_clip/tokenizer.py ``SimpleTokenizer.__init__``)
_N_MERGES = 49152 - 256 - 2


@functools.lru_cache(maxsize=1)
def _clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    path = default_bpe()
    if not Path(path).is_file():
        raise FileNotFoundError(f"open_clip's BPE vocabulary is missing at {path}: reinstall open_clip_torch")
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1 : _N_MERGES + 1]
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def clip_tokenizer(model_max_length: int = 77) -> Any:
    """The CLIP BPE tokenizer as a transformers ``CLIPTokenizer``, built offline.

    Ids: ``<|startoftext|>`` = 49406, ``<|endoftext|>`` = 49407 (also the padding token, as in
    ``openai/clip-vit-base-patch16``).
    """
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=model_max_length)


_WORDS = """
a an the this that these those there here it its is are was were be been being has have had do does
and or but nor so yet of in on at to from by with without into onto over under above below behind
between beside next near far left right top bottom middle center centre corner edge side front back
up down inside outside around across along through toward towards against among upon while where when
what which who whose whom why how all any both each every few many more most other some such no not
only own same than too very can will just one two three four five six seven eight nine ten first
second third last another several image photo picture scene view background foreground object objects
shape shapes circle circles square squares triangle triangles star stars rectangle rectangles oval
ovals hexagon pentagon diamond cross heart ring line lines dot dots
red green blue yellow orange purple pink brown black white gray grey cyan magenta gold silver beige
dark light bright pale small large big tiny huge medium little long short tall wide narrow thin thick
round flat smooth rough soft hard shiny matte striped spotted wooden metal glass plastic paper stone
man woman men women person people child children boy girl dog dogs cat cats bird birds horse car cars
bus truck bike bicycle train boat plane tree trees flower flowers grass sky cloud clouds sun water sea
river lake road street building house houses window windows door wall floor table chair bed room
city field mountain hill beach snow sand rock food plate cup bottle book phone shirt hat hair face
hand hands eye eyes head body leg legs sitting standing walking running holding wearing looking
lying playing eating riding parked covered filled made shown seen placed located surrounded
together other also each whole entire partly half closer further lower upper rest group pair
""".split()


@functools.lru_cache(maxsize=1)
def _word_vocab() -> dict[str, int]:
    specials = ["<pad>", "</s>", "<unk>"]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = specials + chars + ["##" + c for c in string.ascii_lowercase + string.digits]
    for w in _WORDS:
        if w not in tokens:
            tokens.append(w)
    return {tok: i for i, tok in enumerate(tokens)}


def word_tokenizer(model_max_length: int = 64) -> Any:
    """A small lower-casing WordPiece tokenizer (``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2) that
    appends ``</s>`` to every caption. Deterministic: the vocabulary is the fixed list above."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = _word_vocab()
    backend = Tokenizer(models.WordPiece(vocab=dict(vocab), unk_token="<unk>", max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                    strip_accents=True, lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])]
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
    )


def word_vocab_size() -> int:
    """Number of tokens of :func:`word_tokenizer` (the ``vocab_size`` its models need)."""
    return len(_word_vocab())
