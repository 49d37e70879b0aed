"""Long-CLIP KPS: the table rule on hand-computed values, stretching every backend, frozen rows,
saving and reloading (also with plain transformers)."""

from __future__ import annotations

import copy

import pytest
import torch

from finetune.models import no_weight_decay_names, param_groups
from finetune.models.longclip import FrozenRowsHook, apply_kps, kps_ratio, stretch_positions
from finetune.models.registry import TINY_NAMES


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def test_stretch_hand_checked_table() -> None:
    old = _column([0, 10, 20, 40, 50])
    # keep 2 rows; gaps 20->40 and 40->50 get 2 rows each; tail extrapolates 50 + k*(50-40)/2
    out = stretch_positions(old, keep=2, ratio=2)
    assert out.squeeze(1).tolist() == [0, 10, 20, 30, 40, 45, 50, 55]


def test_stretch_ratio_from_length_and_cut() -> None:
    old = _column([0, 10, 20, 40, 50])
    # length 9 needs ratio ceil((9-2)/(5-2)) = 3: 2 + 3*3 = 11 rows, cut to 9
    out = stretch_positions(old, keep=2, length=9).squeeze(1)
    expected = [0, 10, 20, (2 * 20 + 40) / 3, (20 + 2 * 40) / 3, 40, (2 * 40 + 50) / 3, (40 + 2 * 50) / 3, 50]
    assert out.shape == (9,)
    assert torch.allclose(out, torch.tensor(expected), atol=1e-5)
    assert stretch_positions(old, keep=2, ratio=2, length=7).squeeze(1).tolist() == [0, 10, 20, 30, 40, 45, 50]


def test_stretch_77_to_248_matches_long_clip_rows() -> None:
    old = torch.randn(77, 8, dtype=torch.float64)
    new = stretch_positions(old)  # defaults: keep 20, ratio 4
    assert new.shape == (248, 8) and new.dtype == torch.float64
    assert torch.equal(new[:20], old[:20])
    assert torch.allclose(new[20], old[20])
    assert torch.allclose(new[21], (3 * old[20] + old[21]) / 4)
    assert torch.allclose(new[243], (old[75] + 3 * old[76]) / 4)
    assert torch.allclose(new[244], old[76])
    assert torch.allclose(new[247], old[76] + 3 * (old[76] - old[75]) / 4)


def test_stretch_siglip_64_rows_to_248_with_ratio_6() -> None:
    old = torch.randn(64, 4, dtype=torch.float64)
    assert kps_ratio(64, 20, 248) == 6
    new = stretch_positions(old, length=248)
    assert new.shape == (248, 4)
    assert torch.equal(new[:20], old[:20])
    # row 247 = 20 + 6*(57-20) + 5: gap (old[57], old[58]) at r = 5
    assert torch.allclose(new[247], (old[57] + 5 * old[58]) / 6)


def test_stretch_keeps_dtype_and_computes_in_float32() -> None:
    old = torch.randn(77, 8).to(torch.bfloat16)
    new = stretch_positions(old)
    ref = stretch_positions(old.float()).to(torch.bfloat16)
    assert new.dtype == torch.bfloat16 and torch.equal(new, ref)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": 5}, "keep=5"),
        ({"length": 3}, "only lengthens"),
        ({"ratio": 1, "length": 20}, "use ratio >= "),
        ({"ratio": 0}, "positive integer"),
    ],
)
def test_stretch_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stretch_positions(torch.zeros(5, 2), **{"keep": 2, **kwargs})


def test_stretch_rejects_non_tables() -> None:
    with pytest.raises(ValueError, match="n >= 2"):
        stretch_positions(torch.zeros(5))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_apply_kps_every_backend(name: str, load_tiny) -> None:
    model = load_tiny(name)
    base = model.max_text_len
    old = model.position_embedding().detach().clone()
    apply_kps(model, 248)
    table = model.position_embedding()
    assert model.max_text_len == 248 and table.shape == (248, old.shape[1])
    assert model.base_text_len == base
    assert model.kps == {"length": 248, "keep": 20, "ratio": kps_ratio(base, 20, 248), "freeze_kept": True}
    assert torch.equal(table.detach(), stretch_positions(old, length=248))
    tok = model.tokenize(["a red circle " * 100])
    assert tok.input_ids.shape[1] == 248 and bool(tok.truncated[0])
    with torch.no_grad():
        out = model.encode_text(tok.input_ids, tok.attention_mask)
    assert out.embeds.shape[0] == 1 and torch.isfinite(out.embeds).all()
    assert apply_kps(model, 248) is model  # the same settings again: a no-op
    with pytest.raises(ValueError, match="already stretched"):
        apply_kps(model, 300)


def test_apply_kps_below_current_length_is_an_error(load_tiny) -> None:
    model = load_tiny("tiny-clip")
    with pytest.raises(ValueError, match="below the model's 77 text positions"):
        apply_kps(model, 64)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_long_caption_last_sentence_matters_only_after_kps(name: str, load_tiny) -> None:
    words = " ".join(f"the red circle {i} is left of the blue square" for i in range(14))
    a, b = words + ". The star is green.", words + ". The star is yellow."
    short = load_tiny(name)
    long = load_tiny(name, max_text_len=248)
    for model, differs in ((short, False), (long, True)):
        tok = model.tokenize([a, b])
        with torch.no_grad():
            emb = model.encode_text(tok.input_ids, tok.attention_mask).embeds
        assert bool(tok.truncated.all()) is (not differs)
        assert (not torch.allclose(emb[0], emb[1], atol=1e-6)) is differs
    assert short.tokenize([a]).input_ids.shape[1] == short.max_text_len
    assert long.tokenize([a]).input_ids.shape[1] <= 248


def _train_text_steps(model, steps: int = 3) -> None:
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2)
    tok = model.tokenize(["a red circle on the left " * 8, "a blue square " * 3])
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model.encode_text(tok.input_ids, tok.attention_mask).embeds.pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-openclip", "tiny-siglip"])
def test_kept_rows_stay_bit_identical_through_adamw(name: str, load_tiny) -> None:
    model = load_tiny(name, max_text_len=248)
    table_name = next(n for n, p in model.named_parameters() if p is model.position_embedding())
    assert table_name in no_weight_decay_names(model)
    before = model.position_embedding().detach().clone()
    _train_text_steps(model)
    after = model.position_embedding().detach()
    assert torch.equal(after[:20], before[:20])
    assert not torch.equal(after[20:], before[20:])


def test_unfrozen_kept_rows_train(load_tiny) -> None:
    model = load_tiny("tiny-clip", max_text_len=248, kps={"freeze_kept": False})
    before = model.position_embedding().detach().clone()
    _train_text_steps(model)
    assert not torch.equal(model.position_embedding().detach()[:20], before[:20])


def test_freeze_survives_deepcopy_and_reload(load_tiny, tmp_path) -> None:
    model = load_tiny("tiny-clip", max_text_len=248)
    clone = copy.deepcopy(model)
    module = clone.model.text_model.embeddings.position_embedding
    assert sum(isinstance(h, FrozenRowsHook) for h in module._forward_hooks.values()) == 1
    before = clone.position_embedding().detach().clone()
    _train_text_steps(clone)
    assert torch.equal(clone.position_embedding().detach()[:20], before[:20])

    from finetune import load_model

    model.save_pretrained(str(tmp_path / "stretched"))
    again = load_model(str(tmp_path / "stretched"))
    assert again.kps == model.kps and again.base_text_len == 77 and again.max_text_len == 248
    before = again.position_embedding().detach().clone()
    _train_text_steps(again)
    assert torch.equal(again.position_embedding().detach()[:20], before[:20])


@pytest.mark.parametrize(("name", "cls_name"), [("tiny-clip", "CLIPModel"), ("tiny-siglip", "SiglipModel")])
def test_saved_stretched_model_reloads_in_plain_transformers(name: str, cls_name: str, load_tiny, tmp_path) -> None:
    import transformers

    model = load_tiny(name, max_text_len=248)
    model.save_pretrained(str(tmp_path / "m"))
    plain = getattr(transformers, cls_name).from_pretrained(str(tmp_path / "m"))
    assert plain.config.text_config.max_position_embeddings == 248
    assert plain.text_model.embeddings.position_embedding.weight.shape[0] == 248
    tok = model.tokenize(["a red circle on the left " * 30])
    assert tok.input_ids.shape[1] > 77
    with torch.no_grad():
        ours = model.encode_text(tok.input_ids, tok.attention_mask).embeds
        mask = tok.attention_mask if model.family == "clip" else None
        theirs = plain.get_text_features(input_ids=tok.input_ids, attention_mask=mask).pooler_output
    assert torch.allclose(ours, theirs, atol=1e-6)
