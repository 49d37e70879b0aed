"""QuickGELU MLPs through the fused SiLU kernels: same values and gradients as the stock modules, switched
at load time without touching weights or saved files, and falling back to module calls under adapters."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPModel
from transformers.activations import QuickGELUActivation
from transformers.models.clip.modeling_clip import CLIPMLP

from finetune.models.backends.activations import FastQuickGELU, FastQuickGELUCLIPMLP, quick_gelu_mlp, use_fast_quick_gelu
from finetune.models.adapters import apply_adapter


def _value_and_grads(fn, x: torch.Tensor, weights: torch.Tensor, params: list[torch.Tensor]):
    x = x.clone().requires_grad_()
    y = fn(x)
    grads = torch.autograd.grad((y * weights).sum(), [x, *params])
    return y.detach(), grads


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_fast_quick_gelu_equals_the_stock_activation(dtype: torch.dtype, atol: float) -> None:
    torch.manual_seed(0)
    x = (torch.randn(4, 7, 96) * 4).to(dtype)
    weights = torch.randn(4, 7, 96).to(dtype)
    expected, (expected_grad,) = _value_and_grads(QuickGELUActivation(), x, weights, [])
    got, (grad,) = _value_and_grads(FastQuickGELU(), x, weights, [])
    assert got.dtype == dtype
    assert torch.allclose(got.float(), expected.float(), atol=atol, rtol=atol)
    assert torch.allclose(grad.float(), expected_grad.float(), atol=atol, rtol=atol)
    ref = x.float() * torch.sigmoid(1.702 * x.float())  # the formula, by hand
    assert torch.allclose(got.float(), ref, atol=atol, rtol=atol)


def test_folded_mlp_equals_the_stock_mlp_with_gradients() -> None:
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    x, weights = torch.randn(3, 5, 16) * 3, torch.randn(3, 5, 16)
    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    stock = lambda t: fc2(QuickGELUActivation()(fc1(t)))  # noqa: E731
    expected, expected_grads = _value_and_grads(stock, x, weights, params)
    got, grads = _value_and_grads(lambda t: quick_gelu_mlp(t, fc1, fc2), x, weights, params)
    assert torch.allclose(got, expected, atol=1e-5)
    for g, e in zip(grads, expected_grads):  # the input's and every weight's gradient
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-5)


def test_loaded_clip_uses_it_and_matches_the_stock_transformers_model(load_tiny, tiny_dir) -> None:
    model = load_tiny("tiny-clip")
    mlps = [m for m in model.model.modules() if isinstance(m, CLIPMLP)]
    layers = model.model.config.vision_config.num_hidden_layers + model.model.config.text_config.num_hidden_layers
    assert len(mlps) == layers
    assert all(type(m) is FastQuickGELUCLIPMLP and type(m.activation_fn) is FastQuickGELU for m in mlps)

    stock = CLIPModel.from_pretrained(tiny_dir("tiny-clip")).eval()
    assert not any(type(m) is FastQuickGELUCLIPMLP for m in stock.modules())
    assert stock.state_dict().keys() == model.model.state_dict().keys()
    model.eval()
    torch.manual_seed(0)
    pixels = torch.randn(2, 3, model.image_size, model.image_size)
    ids = model.tokenize(["a small house beside a road", "two chairs"]).input_ids
    with torch.no_grad():
        assert torch.allclose(model.encode_image(pixels).embeds,
                              stock.get_image_features(pixel_values=pixels).pooler_output, atol=1e-5)
        ours = model.encode_text(ids, (ids != model.tokenizer.pad_token_id).long()).embeds
        theirs = stock.get_text_features(input_ids=ids).pooler_output
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_lora_linears_run_as_modules_with_the_fast_activation(load_tiny) -> None:
    model = apply_adapter(load_tiny("tiny-clip"), {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0,
                                                   "include_mlp": True})
    mlp = next(m for m in model.model.modules() if isinstance(m, CLIPMLP))
    assert type(mlp.fc1) is not torch.nn.Linear  # wrapped by peft
    calls: list[str] = []
    mlp.fc1.register_forward_hook(lambda *_: calls.append("fc1"))
    mlp.activation_fn.register_forward_hook(lambda *_: calls.append("act"))
    x = torch.randn(2, 3, mlp.fc1.in_features)
    out = mlp(x)
    assert calls == ["fc1", "act"]  # the LoRA linear ran, so its adapter weights count
    with torch.no_grad():
        expected = mlp.fc2(QuickGELUActivation()(mlp.fc1(x)))
    assert torch.allclose(out, expected, atol=1e-6)


def test_swapping_back_restores_the_transformers_modules(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    n = sum(type(m) is FastQuickGELUCLIPMLP for m in model.model.modules())
    assert use_fast_quick_gelu(model.model, fast=False) == n
    assert not any(isinstance(m, (FastQuickGELU, FastQuickGELUCLIPMLP)) for m in model.model.modules())
    assert sum(type(m) is QuickGELUActivation for m in model.model.modules()) == n
    assert use_fast_quick_gelu(model.model) == n
    assert use_fast_quick_gelu(model.model) == 0  # already switched


def test_other_activations_are_left_alone(load_tiny) -> None:
    model = load_tiny("tiny-siglip")  # gelu_pytorch_tanh
    before = [type(m) for m in model.model.modules()]
    assert use_fast_quick_gelu(model.model) == 0
    assert [type(m) for m in model.model.modules()] == before


def test_open_clip_quick_gelu_models_use_it_and_keep_their_outputs() -> None:
    from open_clip import SimpleTokenizer
    from open_clip.transformer import QuickGELU

    from finetune.models.backends.openclip import build_open_clip

    cfg = {"embed_dim": 32, "quick_gelu": True,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
    model = build_open_clip(cfg, SimpleTokenizer(context_length=77), name_or_path="quickgelu-openclip").eval()
    assert not any(type(m) is QuickGELU for m in model.model.modules())
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fast = model.encode_image(pixels).embeds
        assert use_fast_quick_gelu(model.model, fast=False) == 4  # 2 image + 2 text blocks
        assert sum(type(m) is QuickGELU for m in model.model.modules()) == 4
        stock = model.encode_image(pixels).embeds
    assert torch.allclose(fast, stock, atol=1e-5)
