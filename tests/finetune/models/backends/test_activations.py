"""QuickGELU through the fused SiLU kernel: same values and gradients as the stock activation, switched at load time
without touching weights (at load or at any call) or saved files, linears run as modules (adapters included)."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPModel
from transformers.activations import QuickGELUActivation
from transformers.models.clip.modeling_clip import CLIPMLP

from torch.utils._python_dispatch import TorchDispatchMode

from finetune.models.backends.activations import FastQuickGELU, use_fast_quick_gelu
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


class _OpsOn(TorchDispatchMode):
    """The aten ops that take one of ``tensors`` (by storage) as an input."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        if any(a.untyped_storage().data_ptr() in self.ptrs for a in flat):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True])
def test_no_weight_is_transformed_at_a_call(load_tiny, autocast: bool) -> None:
    """An MLP call reads its weights only in its matrix products (and, under autocast, autocast's cached cast):
    no per-call rescale of fc1 / fc2 (the folded form scaled both at every call, issue 29)."""
    model = load_tiny("tiny-clip")
    mlp = next(m for m in model.model.modules() if isinstance(m, CLIPMLP))
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    x = torch.randn(2, 5, mlp.fc1.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _OpsOn(params) as seen:
        mlp(x).float().sum().backward()
    allowed = {"t", "addmm", "mm", "linear", "view", "_to_copy"}
    assert seen.ops and set(seen.ops) <= allowed, seen.ops
    assert seen.ops.count("_to_copy") <= (4 if autocast else 0)  # each parameter cast once per autocast region


def test_the_optimiser_trains_the_stock_parameters(load_tiny, tiny_dir) -> None:
    """A step of AdamW on the fast model moves the stock parameters: loaded into the stock transformers model they
    give the fast model's embeddings."""
    model = load_tiny("tiny-clip")
    stock = CLIPModel.from_pretrained(tiny_dir("tiny-clip"))
    assert [n for n, _ in model.model.named_parameters()] == [n for n, _ in stock.named_parameters()]
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    pixels = torch.randn(2, 3, model.image_size, model.image_size)
    ids = model.tokenize(["a small house beside a road", "two chairs"])
    model.train()
    loss = model.encode_image(pixels).embeds.square().sum() + model.encode_text(ids.input_ids, ids.attention_mask)\
        .embeds.square().sum()
    loss.backward()
    optimizer.step()
    stock.load_state_dict(model.model.state_dict())
    model.eval(), stock.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(pixels).embeds,
                                   stock.get_image_features(pixel_values=pixels).pooler_output, atol=1e-5, rtol=1e-5)


def test_loaded_clip_uses_it_and_matches_the_stock_transformers_model(load_tiny, tiny_dir) -> None:
    model = load_tiny("tiny-clip")
    mlps = [m for m in model.model.modules() if isinstance(m, CLIPMLP)]
    layers = model.model.config.vision_config.num_hidden_layers + model.model.config.text_config.num_hidden_layers
    assert len(mlps) == layers
    assert all(type(m) is CLIPMLP and type(m.activation_fn) is FastQuickGELU for m in mlps)

    stock = CLIPModel.from_pretrained(tiny_dir("tiny-clip")).eval()
    assert not any(type(m) is FastQuickGELU for m in stock.modules())
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
    n = sum(type(m) is FastQuickGELU for m in model.model.modules())
    assert n == 4 and use_fast_quick_gelu(model.model, fast=False) == n
    assert not any(isinstance(m, FastQuickGELU) for m in model.model.modules())
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
