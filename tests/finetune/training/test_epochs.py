"""The per-epoch ledger (finetune.training.epochs): an order-free digest of the ids each epoch read, the same however
the samples were split over processes and resumed parts, and changed by a sample read twice or left out."""

from __future__ import annotations

from finetune.training.epochs import EpochLedger, count_batch, ids_digest

IDS = [f"s{i:02d}" for i in range(12)]


def test_an_epoch_s_digest_is_its_ids_whatever_the_split_and_order():
    one = EpochLedger()
    one.add(IDS, 0)
    rank0, rank1 = EpochLedger(), EpochLedger()  # two processes, each its own share, in another order
    rank0.add(IDS[7:][::-1], 0)
    rank1.add(IDS[:7], [0] * 7)
    merged = EpochLedger()
    for part in (rank0.entries(), rank1.entries()):
        merged.load(part)
    assert merged.entries() == one.entries() == [{"epoch": 0, "read": 12, "ids_digest": ids_digest(IDS),
                                                  "skipped_ids": []}]
    assert ids_digest(IDS) == ids_digest(reversed(IDS))
    assert ids_digest(IDS + IDS[:1]) != ids_digest(IDS) != ids_digest(IDS[1:])  # one twice, one left out


def test_a_batch_counts_under_each_sample_s_epoch_and_a_resume_carries_the_counts():
    ledger = EpochLedger()
    assert count_batch(ledger, {"ids": IDS[:4]}, step=2, steps_per_epoch=3) == 0  # map-style: the step's epoch
    assert count_batch(ledger, {"ids": IDS[:4]}, step=3, steps_per_epoch=3) == 1
    stream = {"ids": IDS[10:] + IDS[:2], "_epochs": [0, 0, 1, 1]}  # a stream batch across an epoch's end
    assert count_batch(ledger, stream, step=4, steps_per_epoch=0) == 1 and "_epochs" not in stream
    ledger.skip(["bad"], 1)
    entries = ledger.entries()
    assert [(e["epoch"], e["read"], e["skipped_ids"]) for e in entries] == [(0, 6, []), (1, 6, ["bad"])]
    assert entries[0]["ids_digest"] == ids_digest(IDS[:4] + IDS[10:])
    resumed = EpochLedger()
    resumed.load(entries)
    assert resumed.merged(None) == entries
