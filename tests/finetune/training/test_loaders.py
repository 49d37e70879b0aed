"""The map-style training loader with ``train.group_by_length`` (finetune/training/loaders.py): each epoch reads the
examples the plain sampler keeps, once, in batches of similar lengths whose order is shuffled; the same batches for
a seed and an epoch, and from any step on (resume); streams refuse it."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState

from finetune.training.batches import open_batches
from finetune.training.checkpoint import TrainState
from finetune.training.loaders import EpochShuffleSampler, LengthGroupedEpochSampler, map_loader

REPO = Path(__file__).resolve().parents[3]


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 250) for _ in range(n)]


def _batches(sampler: EpochShuffleSampler, epoch: int) -> list[list[int]]:
    order, b = sampler.epoch_order(epoch), sampler.batch_size
    return [order[k:k + b] for k in range(0, len(order), b)]


def _cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"batch_size": 8, "seed": 3, "max_steps": None, "epochs": 3, "group_by_length": True,
                              "length_group_batches": None, **kw})


def test_an_epoch_reads_the_plain_sampler_s_examples_once_each():
    n, b = 1003, 10  # 3 examples left out per epoch (drop_last)
    lengths = _lengths(n)
    for epoch in range(3):
        grouped = LengthGroupedEpochSampler(lengths, seed=7, batch_size=b).epoch_order(epoch)
        plain = EpochShuffleSampler(n, seed=7, batch_size=b).epoch_order(epoch)
        assert len(grouped) == len(set(grouped)) == 100 * b
        assert set(grouped) == set(plain)  # the same examples; the same tail left out as without grouping


def test_batches_hold_similar_lengths_in_a_shuffled_order():
    n, b = 2000, 10
    lengths = _lengths(n)
    grouped = _batches(LengthGroupedEpochSampler(lengths, seed=0, batch_size=b), 0)
    plain = _batches(EpochShuffleSampler(n, seed=0, batch_size=b), 0)

    def spread(batches):  # mean (longest - shortest) within a batch
        return sum(max(lengths[i] for i in x) - min(lengths[i] for i in x) for x in batches) / len(batches)

    assert spread(grouped) < spread(plain) / 10
    # long and short batches alternate at random: transformers' order descends through each of its 4 megabatches
    # of 50 batches (3 rises in 199 steps); a shuffled order rises about half the time
    longest = [max(lengths[i] for i in x) for x in grouped]
    rises = sum(a < c for a, c in zip(longest, longest[1:]))
    assert 60 < rises < 140
    # another epoch, other batches: the megabatches are drawn again
    again = _batches(LengthGroupedEpochSampler(lengths, seed=0, batch_size=b), 1)
    assert len({frozenset(x) for x in grouped} & {frozenset(x) for x in again}) < 10


def test_the_batches_follow_from_the_seed_and_the_epoch():
    lengths = _lengths(500)
    one = LengthGroupedEpochSampler(lengths, seed=5, batch_size=8, megabatch=4)
    two = LengthGroupedEpochSampler(list(lengths), seed=5, batch_size=8, megabatch=4)
    assert one.epoch_order(2) == two.epoch_order(2)
    assert one.epoch_order(2) != one.epoch_order(3)
    assert LengthGroupedEpochSampler(lengths, seed=6, batch_size=8, megabatch=4).epoch_order(2) != one.epoch_order(2)


def test_a_larger_megabatch_groups_tighter():
    lengths = _lengths(4000)

    def spread(megabatch):
        batches = _batches(LengthGroupedEpochSampler(lengths, seed=0, batch_size=16, megabatch=megabatch), 0)
        return sum(max(lengths[i] for i in x) - min(lengths[i] for i in x) for x in batches) / len(batches)

    assert spread(1) > 3 * spread(4) > 9 * spread(62)  # about 215, 56 and 4 tokens
    with pytest.raises(ValueError, match="train.group_by_length.*1 or more"):
        LengthGroupedEpochSampler(lengths, seed=0, batch_size=16, megabatch=0)


def _accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))


def _ids(batches, first: int) -> list[tuple[int, list[int]]]:
    return [(epoch, batch["i"].tolist()) for epoch, batch in batches.from_step(first)]


def test_a_resume_mid_epoch_reads_the_batches_of_a_straight_run():
    """Through the loader the loop opens (open_batches over accelerate, from a step on)."""
    n = 45  # 5 batches of 8 a run's epoch, 5 examples left out
    rows = [{"i": i} for i in range(n)]
    collate = lambda xs: {"i": torch.tensor([x["i"] for x in xs])}  # noqa: E731
    cfg, lengths = _cfg(), _lengths(n)
    straight = _ids(open_batches(_accelerator(), rows, collate, cfg, TrainState(), lengths=lengths), 0)
    assert len(straight) == 15 and [e for e, _ in straight] == [0] * 5 + [1] * 5 + [2] * 5
    sampler = LengthGroupedEpochSampler(lengths, seed=3, batch_size=8)
    assert [i for _, x in straight[5:10] for i in x] == sampler.epoch_order(1)  # the grouped order, batch by batch
    for first in (3, 7):  # mid-epoch
        resumed = _ids(open_batches(_accelerator(), rows, collate, cfg, TrainState(), lengths=lengths), first)
        assert resumed == straight[first:]
    plain = _ids(open_batches(_accelerator(), rows, collate, _cfg(group_by_length=False), TrainState()), 0)
    assert plain != straight  # the key reaches the loader


def test_grouping_needs_one_length_per_example_and_refuses_a_stream():
    rows = [{"i": i} for i in range(20)]
    with pytest.raises(ValueError, match="train.group_by_length: the training set has 20 examples but 19"):
        map_loader(rows, list, _cfg(), 0, lengths=[1] * 19)
    with pytest.raises(ValueError, match="train.group_by_length: the training set has 20 examples but no"):
        map_loader(rows, list, _cfg(), 0)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows)

    with pytest.raises(ValueError, match="train.group_by_length: true needs a map-style data.train: a stream"):
        open_batches(_accelerator(), Stream(), list, _cfg(max_steps=2), TrainState())


def test_the_loop_groups_by_the_scanned_caption_lengths(tmp_path):
    """build_loop with the key on: the sampler groups by each row's caption tokens (the scan that planned the
    buckets, not a second tokenisation), and the finer default ladder is planned."""
    from finetune import load_model
    from finetune.config import load_recipe
    from finetune.data.sources import load_source
    from finetune.objectives import ClipTerm, Objective
    from finetune.objectives.shapes import grouped_buckets, token_counts
    from finetune.training import TrainModule, build_loop

    rows = load_source({"name": "synthetic", "size": 24, "seed": 0, "options": {"image_size": 32}}).dataset
    model = load_model("tiny-clip", max_text_len=248)
    calls = []
    tokenize = model.tokenize
    model.tokenize = lambda texts, *a, **k: (calls.append(len(texts)), tokenize(texts, *a, **k))[1]
    cfg = load_recipe(REPO / "recipes" / "quickstart.yaml", ["train.batch_size=8", "train.max_steps=2", "train.trackers=[]",
                                                  "train.group_by_length=true"]).train
    loop = build_loop(_accelerator(), TrainModule(model, Objective(ClipTerm())), rows, cfg, tmp_path / "run")
    sampler = loop.batches.sampler
    assert isinstance(sampler, LengthGroupedEpochSampler)
    model.tokenize = tokenize
    assert sampler.lengths == token_counts(model, rows["caption"]) and calls.count(24) == 1  # one scan of 24 rows
    assert loop.setup.shapes.buckets == grouped_buckets(248)
