"""One rule for the arguments of every loss in ``losses/`` (issue 31 item 10, ``losses/checks.py``,
docs/guides/losses.md "Arguments and empty batches"):

- shapes, dtypes, Python numbers and constructor arguments are checked at once, with a ``ValueError`` that names
  the argument;
- values only the device holds (owner indices, a tensor ``logit_scale`` / temperature / bias, per-pair weights) are
  checked by a device-side assertion: a ``ValueError`` at once on the CPU, and no host read in the training step;
- an empty batch gives 0 with the graph intact (backward runs, zero gradients).
"""

from __future__ import annotations

import math

import pytest
import torch

from losses import (
    FLAIRLoss,
    GRMHead,
    GRMLoss,
    StructXLIPLoss,
    TextConditionedAttentionPool,
    TSLHeads,
    clip_loss,
    consistency_loss,
    fcast_loss,
    fcast_part_loss,
    fcast_whole_loss,
    flair_loss,
    grm_loss,
    gumbel_gate,
    local_structure_loss,
    longclip_loss,
    official_weight_decay,
    siglip_loss,
    token_wise_similarity,
    tsl_loss,
    tsl_similarity_loss,
    vse_hinge_loss,
)
from tests.finetune.host_reads import HostReads

NAN, INF = float("nan"), float("inf")


def _emb(*shape: int, seed: int = 0, grad: bool = False) -> torch.Tensor:
    out = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return out.requires_grad_() if grad else out


X, Y = _emb(4, 8, seed=1), _emb(4, 8, seed=2)
OWNERS = torch.arange(4)
POOL = TextConditionedAttentionPool(8, 2)
SUB, LOCAL, GLOBAL = _emb(4, 3, 8, seed=3), _emb(4, 5, 8, seed=4), _emb(4, 8, seed=5)


def _structxlip(**forward):
    return StructXLIPLoss()(image_embeds=X, edge_embeds=Y, filtered_text_embeds=X, **forward)


#: (case, call, the argument the message must name): every call gets a bad value of one argument
BAD_ARGUMENTS = [
    # contrastive: logit_scale must be a finite scalar >= 0, label_smoothing in [0, 1]
    ("clip (4, 1) scale", lambda: clip_loss(X, Y, torch.ones(4, 1)), "logit_scale"),
    ("clip negative scale", lambda: clip_loss(X, Y, -1.0), "logit_scale"),
    ("clip nan scale", lambda: clip_loss(X, Y, NAN), "logit_scale"),
    ("clip inf scale", lambda: clip_loss(X, Y, INF), "logit_scale"),
    ("clip negative tensor scale", lambda: clip_loss(X, Y, torch.tensor(-1.0)), "logit_scale"),
    ("clip nan tensor scale", lambda: clip_loss(X, Y, torch.tensor(NAN)), "logit_scale"),
    ("clip bool scale", lambda: clip_loss(X, Y, True), "logit_scale"),
    ("clip label smoothing", lambda: clip_loss(X, Y, 10.0, label_smoothing=NAN), "label_smoothing"),
    ("clip integer embeds", lambda: clip_loss(X.long(), Y.long(), 10.0), "image_embeds"),
    ("clip gather", lambda: clip_loss(X, Y, 10.0, gather="yes"), "gather"),
    ("siglip nan scale", lambda: siglip_loss(X, Y, NAN, -10.0), "logit_scale"),
    ("siglip inf bias", lambda: siglip_loss(X, Y, 10.0, INF), "logit_bias"),
    ("siglip nan tensor bias", lambda: siglip_loss(X, Y, 10.0, torch.tensor([NAN])), "logit_bias"),
    ("longclip negative scale", lambda: longclip_loss(X, Y, Y, -1.0), "logit_scale"),
    ("longclip pca_dim", lambda: longclip_loss(X, Y, Y, 10.0, pca_dim=0), "pca_dim"),
    ("longclip label smoothing", lambda: longclip_loss(X, Y, Y, 10.0, label_smoothing=1.5), "label_smoothing"),
    # StructXLIP: owners in [0, B), temperatures finite and > 0, weights finite and >= 0
    ("local owner 99", lambda: local_structure_loss(X, torch.tensor([0, 1, 2, 99]), Y, OWNERS, num_samples=4),
     "chunk_owner"),
    ("local owner -1", lambda: local_structure_loss(X, OWNERS, Y, torch.tensor([0, -1, 2, 3])), "region_owner"),
    ("local nan temperature", lambda: local_structure_loss(X, OWNERS, Y, OWNERS, temperature=NAN), "temperature"),
    ("local zero temperature", lambda: local_structure_loss(X, OWNERS, Y, OWNERS, temperature=0.0), "temperature"),
    ("local nan tensor temperature",
     lambda: local_structure_loss(X, OWNERS, Y, OWNERS, temperature=torch.tensor(NAN)), "temperature"),
    ("local num_samples", lambda: local_structure_loss(X, OWNERS, Y, OWNERS, num_samples=-1), "num_samples"),
    ("structxlip negative weight", lambda: StructXLIPLoss(structure_weight=-1), "structure_weight"),
    ("structxlip nan weight", lambda: StructXLIPLoss(consistency_weight=NAN), "consistency_weight"),
    ("structxlip inf weight", lambda: StructXLIPLoss(local_weight=INF), "local_weight"),
    ("structxlip inf scale init", lambda: StructXLIPLoss(structure_logit_scale_init=INF), "structure_logit_scale_init"),
    ("structxlip nan scale max", lambda: StructXLIPLoss(structure_logit_scale_max=NAN), "structure_logit_scale_max"),
    ("structxlip nan local temperature", lambda: StructXLIPLoss(local_temperature=NAN), "local_temperature"),
    ("structxlip owner 99 (B = 4)", lambda: _structxlip(chunk_embeds=X, chunk_owner=torch.tensor([0, 1, 2, 99]),
                                                        region_embeds=Y, region_owner=OWNERS), "chunk_owner"),
    ("structxlip owner -1", lambda: _structxlip(chunk_embeds=X, chunk_owner=OWNERS, region_embeds=Y,
                                                region_owner=torch.tensor([-1, 1, 2, 3])), "region_owner"),
    ("structxlip official negative scale",
     lambda: StructXLIPLoss(compat="official")(image_embeds=X, edge_embeds=Y, filtered_text_embeds=X,
                                               logit_scale=torch.tensor(-1.0)), "logit_scale"),
    ("official_weight_decay nan floor", lambda: official_weight_decay(2, NAN), "floor"),
    # FAST-GOAL TSL: per-pair weights finite and >= 0
    ("tsl negative weights", lambda: tsl_loss(X, Y, X, Y, weights=torch.tensor([1.0, -1.0, 1.0, 1.0])), "weights"),
    ("tsl nan weights", lambda: tsl_similarity_loss(X, Y, weights=torch.tensor([1.0, NAN, 1.0, 1.0])), "weights"),
    ("tsl integer weights", lambda: tsl_similarity_loss(X, Y, weights=torch.ones(4, dtype=torch.long)), "weights"),
    ("tsl heads eps", lambda: TSLHeads(8, 8, 4, image_eps=NAN), "image_eps"),
    # GRM: margins, weights, temperatures finite and in range
    ("vse nan margin", lambda: vse_hinge_loss(X @ Y.T, margin=NAN), "margin"),
    ("vse negative margin", lambda: vse_hinge_loss(X @ Y.T, margin=-0.2), "margin"),
    ("grm loss nan level weight", lambda: GRMLoss(level_weights=(0.4, NAN, 0.2)), "level_weights"),
    ("grm loss inf recon weight", lambda: GRMLoss(recon_weight=INF), "recon_weight"),
    ("grm loss nan margin", lambda: GRMLoss(margin=NAN), "margin"),
    ("grm head nan tau", lambda: GRMHead(8, tau=NAN), "tau"),
    ("grm head inf keep bias", lambda: GRMHead(8, keep_bias=INF), "keep_bias"),
    ("gumbel nan tau", lambda: gumbel_gate(torch.zeros(2, 2), tau=NAN), "tau"),
    ("token-wise nan slope", lambda: token_wise_similarity(_emb(2, 3, 8), None, _emb(2, 4, 8), None,
                                                          leaky_slope=NAN), "leaky_slope"),
    # FLAIR / F-CAST: scales finite and >= 0, biases finite, K >= 1
    ("flair nan scale", lambda: flair_loss(SUB, LOCAL, GLOBAL, POOL, NAN, -10.0), "logit_scale"),
    ("flair inf bias", lambda: flair_loss(SUB, LOCAL, GLOBAL, POOL, 10.0, -INF), "logit_bias"),
    ("flair negative tensor scale",
     lambda: FLAIRLoss()(SUB, LOCAL, GLOBAL, POOL, torch.tensor(-1.0), -10.0), "logit_scale"),
    ("flair K = 0", lambda: flair_loss(SUB[:, :0], LOCAL, GLOBAL, POOL, 10.0, -10.0), "text_embeds"),
    ("flair seed", lambda: flair_loss(SUB, LOCAL, GLOBAL, POOL, 10.0, -10.0, seed=1.5), "seed"),
    ("pool eps", lambda: TextConditionedAttentionPool(8, 2, eps=NAN), "eps"),
    ("fcast part scale", lambda: fcast_part_loss(SUB, LOCAL, POOL, -1.0, -10.0), "logit_scale"),
    ("fcast whole bias", lambda: fcast_whole_loss(GLOBAL, X, 10.0, NAN), "logit_bias"),
    ("fcast loss whole scale", lambda: fcast_loss(SUB, LOCAL, GLOBAL, X, POOL, 10.0, -10.0, INF, -10.0),
     "logit_scale"),
    ("fcast no segment tokens", lambda: fcast_part_loss(SUB, LOCAL[:, :0], POOL, 10.0, -10.0), "fine"),
]


@pytest.mark.parametrize("call,argument", [pytest.param(c, a, id=i) for i, c, a in BAD_ARGUMENTS])
def test_every_loss_refuses_a_bad_argument_naming_it(call, argument) -> None:
    """Bad shapes, ranges and non-finite numbers are a ValueError naming the argument, never a silent value: before,
    owners 99 / -1 made the local term 0.0, a weight of -1 a negative loss, nan weights and temperatures and an inf
    scale init were accepted, a (4, 1) or negative logit_scale scored."""
    with pytest.raises(ValueError, match=argument):
        call()


def _grm_outputs(batch: int) -> tuple:
    head = GRMHead(8, num_regions=2)
    torch.manual_seed(0)
    return head.encode_image(_emb(batch, 5, 8, seed=6, grad=True)), head.encode_text(_emb(batch, 3, 8, seed=7,
                                                                                             grad=True)), head


def _empty(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape).requires_grad_()


def _empty_cases():
    e, f, g = _empty(0, 8), _empty(0, 8), _empty(0, 8)
    sub, local = _empty(0, 3, 8), _empty(0, 5, 8)
    no_owner = torch.zeros(0, dtype=torch.long)
    scale = torch.tensor(10.0, requires_grad=True)
    image, text, head = _grm_outputs(0)
    return {
        "clip": (lambda: clip_loss(e, f, scale), [e, f, scale]),
        "clip valid": (lambda: clip_loss(e, f, scale, valid=torch.zeros(0, dtype=torch.bool)), [e, f]),
        "siglip": (lambda: siglip_loss(e, f, scale, -10.0), [e, f, scale]),
        "longclip": (lambda: longclip_loss(e, f, g, scale), [e, f, g, scale]),
        "consistency": (lambda: consistency_loss(e, f), [e, f]),
        "local": (lambda: local_structure_loss(e, no_owner, f, no_owner, num_samples=0), [e, f]),
        "structxlip": (lambda: StructXLIPLoss()(image_embeds=e, edge_embeds=f, filtered_text_embeds=g)["loss"],
                       [e, f, g]),
        "tsl": (lambda: tsl_loss(e, f, g, e), [e, f, g]),
        "vse": (lambda: vse_hinge_loss(e @ f.T), [e, f]),
        "grm": (lambda: grm_loss(image, text)["loss"], [image.tokens, text.tokens, *head.parameters()]),
        "flair": (lambda: flair_loss(sub, local, e, POOL, scale, -10.0), [sub, local, e, scale]),
        "fcast": (lambda: fcast_loss(sub, local, e, f, POOL, scale, -10.0, scale, -10.0)["loss"],
                  [sub, local, e, f, scale]),
    }


@pytest.mark.parametrize("name", list(_empty_cases()))
def test_every_loss_gives_zero_with_the_graph_intact_on_an_empty_batch(name) -> None:
    """One documented answer for B = 0: a scalar 0 that backward runs through, with zero gradients. Before,
    clip_loss, longclip_loss and StructXLIPLoss raised a bare ZeroDivisionError, siglip_loss and fcast_whole_loss
    returned nan, flair_loss refused num_images = 0, vse_hinge_loss raised an IndexError from amax."""
    call, leaves = _empty_cases()[name]
    loss = call()
    assert loss.shape == () and loss.item() == 0.0
    loss.backward()
    grads = [leaf.grad for leaf in leaves if leaf.requires_grad]
    assert grads and all(g is None or torch.count_nonzero(g) == 0 for g in grads)
    assert any(g is not None for g in grads)


def test_owner_checks_keep_the_local_term_where_it_is_valid() -> None:
    """The owner check refuses only indices outside the batch: owners in range give the same value with and without
    ``num_samples``, and a sample without regions still skips its chunks as documented."""
    owners = torch.tensor([0, 0, 1, 3])
    regions = torch.tensor([0, 1, 1, 2])
    plain = local_structure_loss(X, owners, Y, regions)
    bounded = local_structure_loss(X, owners, Y, regions, num_samples=4)
    assert torch.equal(plain, bounded) and math.isfinite(plain.item()) and plain.item() > 0


def test_device_checks_read_nothing_back_to_the_host() -> None:
    """The checks of tensor values (a tensor logit_scale, bias and temperature, owner indices, per-pair weights)
    are device-side assertions: the forward and backward of every loss that runs them make no host read
    (``tests/finetune/host_reads.py``: no ``.item()``, ``nonzero``, boolean indexing, ...)."""
    x, y = _emb(4, 8, seed=8, grad=True), _emb(4, 8, seed=9, grad=True)
    log_scale = torch.tensor(math.log(10.0), requires_grad=True)
    with HostReads() as reads:
        scale = log_scale.exp()
        total = clip_loss(x, y, scale) + siglip_loss(x, y, scale, torch.tensor(-10.0))
        total = total + longclip_loss(x, y, y, scale, pca_dim=2)
        total = total + local_structure_loss(x, OWNERS, y, torch.tensor([0, 1, 1, 3]), num_samples=4,
                                             temperature=1 / scale)
        total = total + _structxlip_with_grad(x, y, scale)
        total = total + tsl_loss(x, y, x, y, weights=torch.tensor([1.0, 0.5, 0.0, 2.0]))
        total = total + flair_loss(SUB, LOCAL, x, POOL, scale, torch.tensor(-10.0), seed=3)
        total.backward()
    assert not reads.events, reads.report()


def _structxlip_with_grad(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return StructXLIPLoss(compat="official")(image_embeds=x, edge_embeds=y, filtered_text_embeds=x, chunk_embeds=y,
                                             chunk_owner=OWNERS, region_embeds=x, region_owner=OWNERS,
                                             logit_scale=scale)["loss"]
