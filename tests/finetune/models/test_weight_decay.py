"""No weight decay on biases, norms, positional tables, class tokens and logit scale/bias."""

from __future__ import annotations

import pytest

from finetune.models import no_weight_decay_names, param_groups
from finetune.models.registry import build_model


def test_hf_clip_names() -> None:
    model = build_model("tiny-clip")
    names = no_weight_decay_names(model)
    for expected in ("model.logit_scale", "model.text_model.embeddings.position_embedding.weight",
                     "model.vision_model.embeddings.position_embedding.weight",
                     "model.vision_model.embeddings.class_embedding",
                     "model.text_model.final_layer_norm.weight", "model.text_model.encoder.layers.0.mlp.fc1.bias"):
        assert expected in names
    for decayed in ("model.text_model.encoder.layers.0.mlp.fc1.weight", "model.text_projection.weight",
                    "model.text_model.embeddings.token_embedding.weight"):
        assert decayed not in names


@pytest.mark.parametrize("name", ["tiny-openclip", "tiny-openclip-siglip", "tiny-siglip"])
def test_positions_and_logit_parameters_of_other_backends(name: str) -> None:
    model = build_model(name)
    names = no_weight_decay_names(model)
    table = next(n for n, p in model.named_parameters() if p is model.position_embedding())
    assert table in names
    assert all(n in names for n, p in model.named_parameters() if p is model.logit_scale or p is model.logit_bias)


def test_param_groups_split_trainable_parameters() -> None:
    model = build_model("tiny-clip")
    model.model.visual_projection.weight.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    skip = no_weight_decay_names(model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert all(by_id[id(p)] not in skip for p in decay["params"])
    assert all(by_id[id(p)] in skip for p in no_decay["params"])
    trainable = sum(p.requires_grad for p in model.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == trainable


def test_one_rule_for_the_trainer_module_and_term_parameters() -> None:
    """The trainer's module prefixes the model's names (``model.``) and holds the objective's own
    parameters (``objective.``): the same rule applies to both, on any prefix."""
    import torch
    from torch import nn

    from finetune.models.weight_decay import skips_weight_decay

    module = nn.Module()
    module.model = build_model("tiny-clip")
    head = nn.Module()
    head.proj = nn.Linear(4, 4)
    head.norm_scale = nn.Parameter(torch.ones(4, 4))  # 2-D, but a norm by name
    head.temperature = nn.Parameter(torch.tensor(0.07))
    module.objective = head
    _, no_decay = param_groups(module, 0.1)
    skipped = {id(p) for p in no_decay["params"]}
    assert id(head.norm_scale) in skipped and id(head.temperature) in skipped and id(head.proj.bias) in skipped
    assert id(head.proj.weight) not in skipped
    assert id(module.model.model.vision_model.embeddings.class_embedding) in skipped
    assert id(module.model.logit_scale) in skipped
    assert skips_weight_decay("model.text_model.embeddings.position_embedding.weight", torch.zeros(3, 3))
    assert not skips_weight_decay("model.text_model.encoder.layers.0.mlp.fc1.weight", torch.zeros(3, 3))
    _, with_extra = param_groups(module, 0.1, extra_no_decay={"objective.proj.weight"})
    assert id(head.proj.weight) in {id(p) for p in with_extra["params"]}
