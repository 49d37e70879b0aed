"""The CLIP image tower with a class-token-only last layer equals the transformers forward, with gradients."""

from __future__ import annotations

import pytest
import torch

from finetune.models.adapters import apply_adapter, enable_gradient_checkpointing
from finetune.models.backends.pooled_tower import clip_vision_forward, fast_path_ok


def _pixels(model, n: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, 3, model.image_size, model.image_size)


def _stock(model, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own forward: projected embeddings and last hidden states."""
    out = model.model.vision_model(pixel_values=pixels)
    return model.model.visual_projection(out.pooler_output), out.last_hidden_state


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name


def _training_clip(load_tiny, checkpointing: bool):
    """tiny-clip in training mode, with gradient checkpointing on or off."""
    model = load_tiny("tiny-clip")
    model.train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_embeddings_and_gradients_equal_the_transformers_forward(load_tiny, checkpointing: bool) -> None:
    model = _training_clip(load_tiny, checkpointing)
    vm = model.model.vision_model
    assert fast_path_ok(vm)
    pixels = _pixels(model)
    weights = torch.randn(3, model.model.visual_projection.out_features)

    stock, _ = _stock(model, pixels)
    (stock * weights).sum().backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    ours = model.encode_image(pixels).embeds
    (ours * weights).sum().backward()
    got = _grads(model)
    assert torch.allclose(ours, stock, atol=1e-5)
    # the last layer's query/MLP weights get gradient from the class token only, in both
    _assert_same_grads(got, expected)


def test_states_of_the_first_rows_only(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    pixels = _pixels(model, 4)
    with torch.no_grad():
        stock, last = _stock(model, pixels)
        out = model.encode_image(pixels, states=True, states_rows=2)
        everything = model.encode_image(pixels, states=True)
        pooled, cls, full = clip_vision_forward(model.model.vision_model, pixels, states_rows=0)
    assert out.states.shape == (2, last.shape[1] - 1, last.shape[2])
    assert torch.allclose(out.states, last[:2, 1:], atol=1e-5)
    assert torch.allclose(everything.states, last[:, 1:], atol=1e-5)
    assert torch.allclose(out.embeds, stock, atol=1e-5)
    assert torch.allclose(out.pooled_state, last[:, 0], atol=1e-5)
    assert full is None and cls.shape == pooled.shape == (4, last.shape[2])
    # the pooled state projects to the embedding (the DualEncoder convention)
    assert torch.allclose(model.project_image_states(out.pooled_state), out.embeds, atol=1e-5)


def test_lora_adapter_goes_through_the_fast_path(load_tiny) -> None:
    model = apply_adapter(load_tiny("tiny-clip"), {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a non-zero adapter, so that it changes the output
    vm = model.model.vision_model
    assert fast_path_ok(vm)
    pixels = _pixels(model)
    with torch.no_grad():
        stock, _ = _stock(model, pixels)
        ours = model.encode_image(pixels).embeds
    assert torch.allclose(ours, stock, atol=1e-5)


def test_a_hooked_last_layer_falls_back_to_the_transformers_forward(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    vm = model.model.vision_model
    calls = []
    handle = vm.encoder.layers[-1].register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        assert not fast_path_ok(vm)
        pixels = _pixels(model)
        with torch.no_grad():
            ours = model.encode_image(pixels).embeds
            stock, _ = _stock(model, pixels)
        assert len(calls) == 2  # both went through the layer's own forward
        assert torch.allclose(ours, stock, atol=1e-6)
    finally:
        handle.remove()
    assert fast_path_ok(vm)


def test_other_towers_are_not_taken_for_clip(load_tiny) -> None:
    assert not fast_path_ok(load_tiny("tiny-siglip").model.vision_model)


def _text_grads_match(model, ids: torch.Tensor, mask: torch.Tensor) -> None:
    weights = torch.randn(ids.shape[0], model.model.text_projection.out_features)
    stock = model.model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    (stock * weights).sum().backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    ours = model.encode_text(ids, mask).embeds
    (ours * weights).sum().backward()
    got = _grads(model)
    assert torch.allclose(ours, stock, atol=1e-5)
    _assert_same_grads(got, expected)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_text_embeddings_and_gradients_equal_the_transformers_forward(load_tiny, checkpointing: bool) -> None:
    model = _training_clip(load_tiny, checkpointing)
    assert fast_path_ok(model.model.text_model)
    tok = model.tokenize(["a photo of a cat", "two red circles above a small blue square, far apart", "a"])
    assert tok.attention_mask.sum(1).tolist() != [tok.input_ids.shape[1]] * 3  # rows of different lengths
    _text_grads_match(model, tok.input_ids, tok.attention_mask)


def test_text_fast_path_with_stretched_frozen_positions(load_tiny) -> None:
    from finetune.models.longclip import apply_kps

    model = apply_kps(load_tiny("tiny-clip"), length=248, keep=20, freeze_kept=True)
    model.train()
    tok = model.tokenize(["a long caption " * 30, "a short one"])
    assert tok.input_ids.shape[1] > 77
    _text_grads_match(model, tok.input_ids, tok.attention_mask)
    table = model.position_embedding()
    assert table.grad is None or torch.count_nonzero(table.grad[:20]) == 0  # the kept rows stay frozen


def test_text_groups_share_one_token_lookup_and_equal_encode_text(load_tiny) -> None:
    model = _training_clip(load_tiny, checkpointing=False)
    short = model.tokenize(["a cat", "two dogs"])
    long = model.tokenize(["two red circles above a small blue square, far apart from each other on a wall"])
    groups = [(short.input_ids, short.attention_mask), (long.input_ids, long.attention_mask)]
    assert short.input_ids.shape[1] != long.input_ids.shape[1]
    dim = model.model.text_projection.out_features
    weights = [torch.randn(2, dim), torch.randn(1, dim)]

    expected = [model.encode_text(ids, mask).embeds for ids, mask in groups]
    sum((e * w).sum() for e, w in zip(expected, weights)).backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    lookups = []
    embedding = model.model.text_model.embeddings.token_embedding
    embedding.register_forward_hook(lambda m, a, o: lookups.append(a[0].shape))
    got = model.encode_text_groups(groups)
    sum((g * w).sum() for g, w in zip(got, weights)).backward()
    assert lookups == [torch.Size([short.input_ids.numel() + long.input_ids.numel()])]  # one lookup for both
    for g, e in zip(got, expected):
        assert g.shape == e.shape and torch.allclose(g, e, atol=1e-5)
    _assert_same_grads(_grads(model), expected_grads)


def test_clip_text_states_with_padding_read_nothing_from_the_device():
    """encode_text(states=True) on padded rows: the causal padding mask is made on the device (transformers would
    check the 2-D mask on the host first); states of the real tokens and embeddings as transformers computes them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from host_reads import HostReads

    from finetune.models.registry import build_model

    model = build_model("tiny-clip").eval()
    tok = model.tokenize(["a red circle", "a blue square on the left of a green star near the top", "a dog"])
    with HostReads() as reads:
        out = model.encode_text(tok.input_ids, tok.attention_mask, states=True)
    assert not reads.events, reads.report()
    ref = model.model.text_model(input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True)
    real = tok.attention_mask.bool()
    torch.testing.assert_close(out.states[real], ref.hidden_states[-1][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.embeds, model.model.text_projection(ref.pooler_output), atol=1e-5, rtol=1e-5)


def test_a_states_call_leaves_the_pooled_path_on(load_tiny):
    """transformers installs output-capturing hooks on the layers at the first call with output_hidden_states
    (encode_text(states=True): FAST-GOAL's and GRM's token states); they record nothing afterwards, so the towers
    stay on the pooled path (which a real hook, e.g. a wrapper's, turns off)."""
    from finetune.models.backends.pooled_tower import fast_path_ok

    model = load_tiny("tiny-clip")
    tower = model.model.text_model
    tok = model.tokenize(["a red circle", "a dog"])
    assert fast_path_ok(tower)
    model.encode_text(tok.input_ids, tok.attention_mask, states=True)
    assert any(m._forward_hooks for m in tower.modules())  # transformers' capturing hooks are now installed
    assert fast_path_ok(tower)
    handle = tower.encoder.layers[-1].register_forward_hook(lambda *a: None)
    assert not fast_path_ok(tower)
    handle.remove()
