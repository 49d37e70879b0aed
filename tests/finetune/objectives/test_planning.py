"""The training loop's collate function plans on the CPU (finetune.objectives.planning): the epoch reaches the workers'
terms, the text plan says whether every text request is right-padded, micro-batches get their own terms' plans."""

from __future__ import annotations

import pytest
import torch

from finetune.data.collate import EPOCH_KEY, Collator
from finetune.data.sources import load_source
from finetune.models.registry import build_model
from finetune.objectives import ClipTerm, Objective
from finetune.objectives.base import TERM_PLANS, TEXT_PLAN, Term
from finetune.objectives.encoders import encode_texts
from finetune.objectives.planning import MicroPlans, PlannedCollate, split_batch


@pytest.fixture(scope="module")
def scenes():
    return load_source({"name": "synthetic", "size": 8, "seed": 0, "options": {"image_size": 48}}).dataset


class _EpochProbe(Term):
    name = "probe"
    produces = frozenset({"probe_epoch"})

    def __init__(self) -> None:
        super().__init__()
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def prepare(self, example):
        return {"probe_epoch": self.epoch}

    def collate(self, examples, model):
        return {"probe_epoch": torch.tensor([e["probe_epoch"] for e in examples])}

    def plan(self, model, batch):
        return {"rows": len(batch["ids"])}


def test_the_epoch_reaches_the_terms_where_the_batch_is_collated(scenes):
    model = build_model("tiny-clip")
    probe = _EpochProbe()
    objective = Objective(ClipTerm(), [(probe, 0.0)])
    collate = PlannedCollate(Collator(model, objective), objective, model)
    batch = collate([{**scenes[i], EPOCH_KEY: 3} for i in range(2)])
    assert batch["probe_epoch"].tolist() == [3, 3] and probe.epoch == 3
    assert EPOCH_KEY not in batch


def test_the_text_plan_says_whether_the_rows_are_right_padded(scenes):
    """Right-padded rows (the tokenizers') may skip the causal tower's padding mask, and give the embeddings of the
    masked tower; a left-padded batch is planned as such, so the tower keeps its mask."""
    model = build_model("tiny-clip").eval()
    objective = Objective(ClipTerm())
    words = scenes[0]["caption"].split()
    captions = [" ".join(words[:n]) for n in (3, 40, 5, 12)]
    batch = Collator(model, objective)([{**scenes[i], "caption": c} for i, c in enumerate(captions)])
    plan = objective.plan(model, batch)
    assert plan.right_padded and plan.lengths == {"text": int(batch["attention_mask"].sum(-1).max())}
    _, reqs, _ = objective.requests(batch)
    with torch.no_grad():
        fast = encode_texts(model, reqs, plan)["text"]
        masked = model.encode_text(batch["input_ids"], batch["attention_mask"]).embeds
    torch.testing.assert_close(fast, masked, atol=1e-5, rtol=1e-5)
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    assert not objective.plan(model, batch).right_padded


def test_micro_batches_get_their_own_terms_plans_and_the_text_plan(scenes):
    model = build_model("tiny-clip")
    objective = Objective(ClipTerm(), [(_EpochProbe(), 0.0)])
    batch = PlannedCollate(Collator(model, objective), objective, model, micro_batches=2)(
        [scenes[i] for i in range(6)])
    plans = batch[TERM_PLANS]
    assert isinstance(plans, MicroPlans) and [p["probe"] for p in plans.plans] == [{"rows": 3}, {"rows": 3}]
    parts = split_batch(batch, 2)
    assert [p["ids"] for p in parts] == [batch["ids"][:3], batch["ids"][3:]]
    for part, plan in zip(parts, plans.plans):
        assert part[TERM_PLANS] is plan and part[TEXT_PLAN] is batch[TEXT_PLAN]
        assert part["input_ids"].shape[0] == 3
