"""bench/buckets.py: its caption fixtures have the lengths it says (DOCCI's mean of 136 words, COCO's 8-20 words
around 10.5), and its padding shares are the token counts of the batches the training loop collates."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import buckets  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_datasets")


def test_captions_have_the_word_counts_asked_for():
    rng = random.Random(0)
    for n in (1, 8, 13, 136, 320):
        assert len(buckets.caption_of(n, rng).split()) == n
    docci = [buckets.docci_words(rng) for _ in range(4000)]
    coco = [buckets.coco_words(rng) for _ in range(4000)]
    assert statistics.mean(docci) == pytest.approx(136, abs=3) and 50 <= min(docci) and max(docci) <= 320
    assert statistics.mean(coco) == pytest.approx(10.6, abs=0.3) and min(coco) == 8 and max(coco) <= 20


@pytest.mark.slow
def test_the_padding_shares_are_the_collated_batches_token_counts(tmp_path):
    """COCO-length captions through GRM's recipe and BERT's 512 positions: every batch's captions take the 32-token
    bucket, cut to the longest caption; the share with buckets lies between the floor (each pass at its longest row) and padding to 512."""
    r = buckets.share_case("coco-lengths", tmp_path, batches=3, rows_of_lengths=400)
    longest = -(-r["caption_tokens"]["max"] // 8) * 8  # the 32-token bucket cut to the longest caption
    assert r["max_text_len"] == 512 and r["planned"]["text"] == [longest] and longest <= 32
    b = r["batch_128"]
    assert b["computed_tokens"] == 3 * 128 * longest  # one caption pass a batch, 128 rows at that length
    assert b["padding_share"] == pytest.approx(1 - b["real_tokens"] / b["computed_tokens"])
    assert b["padding_share_floor"] < b["padding_share"] < b["padding_share_padded_to_max"]
    assert b["padding_share_padded_to_max"] == pytest.approx(1 - b["real_tokens"] / (3 * 128 * 512))
    assert 11 <= r["caption_tokens"]["mean"] <= 17  # COCO's 10-20 BERT tokens, [CLS] and [SEP] included
    # train.group_by_length: the sampler's first batches, padded to the finer ladder planned with it
    g = b["grouped"]
    assert set(r["planned_grouped"]["text"]) <= {12, 16, 20, 24, 28, 32} and len(r["planned_grouped"]["text"]) >= 3
    assert g["batches"] == 3 and g["real_tokens"] == b["grouped_default_buckets"]["real_tokens"]
    assert g["padding_share_floor"] <= g["padding_share"] < b["grouped_default_buckets"]["padding_share"]
    assert g["padding_share"] == pytest.approx(1 - g["real_tokens"] / g["computed_tokens"])
