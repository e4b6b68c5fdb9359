"""Tests for autoremat.zoo: the built-in models and their sample batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autoremat import zoo
from autoremat._core.errors import RematError

from conftest import SMALL

# SMALL sizes keep the tests fast; the defaults are exercised once in test_default_sizes
# the container each model keeps its repeated blocks in, and its length at the defaults
_BLOCKS = {
    "gpt2": ("blocks", 6),
    "llama": ("layers", 6),
    "mlp": ("blocks", 12),
    "resnet": ("stages", 3),
}
_DEFAULT_BATCH = {"gpt2": 4, "llama": 4, "mlp": 1024, "resnet": 16}


def _run(model: nn.Module, inputs: Any) -> zoo.LMOutput:
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    assert isinstance(out, zoo.LMOutput)
    return out


def _tensors(inputs: Any) -> list[Tensor]:
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def test_names_and_registry() -> None:
    assert zoo.names() == ["gpt2", "llama", "mlp", "resnet"]
    assert all(zoo.ZOO[name].name == name and zoo.ZOO[name].description for name in zoo.names())
    with pytest.raises(TypeError):
        zoo.ZOO["extra"] = zoo.ZOO["mlp"]  # type: ignore[index]


@pytest.mark.parametrize("name", zoo.names())
def test_forward_backward_gives_finite_grad_to_every_parameter(name: str) -> None:
    model, inputs = zoo.build(name, **SMALL[name])
    assert model.training and all(m.training for m in model.modules())
    out = _run(model, inputs)
    assert out.loss is not None and out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.requires_grad
        assert p.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: {pname} has a non-finite gradient"
    # at least the first block's weights actually move the loss
    first_block = getattr(model, _BLOCKS[name][0])[0]
    assert any(p.grad.abs().sum() > 0 for p in first_block.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", zoo.names())
def test_default_sizes(name: str) -> None:
    model, inputs = zoo.build(name)
    attr, length = _BLOCKS[name]
    assert len(getattr(model, attr)) == length
    out = _run(model, inputs)
    assert out.logits.shape[0] == _DEFAULT_BATCH[name]
    assert out.loss is not None and torch.isfinite(out.loss)


@pytest.mark.parametrize("name", zoo.names())
def test_same_seed_gives_identical_weights_data_and_outputs(name: str) -> None:
    model_a, inputs_a = zoo.build(name, seed=3, **SMALL[name])
    out_a = _run(model_a, inputs_a)  # train mode: dropout masks come from the seeded RNG
    model_b, inputs_b = zoo.build(name, seed=3, **SMALL[name])
    out_b = _run(model_b, inputs_b)

    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(
        torch.equal(a, b) for a, b in zip(_tensors(inputs_a), _tensors(inputs_b), strict=True)
    )
    assert torch.equal(out_a.logits, out_b.logits)
    assert out_a.loss is not None and out_b.loss is not None
    assert torch.equal(out_a.loss, out_b.loss)

    model_c, _ = zoo.build(name, seed=4, **SMALL[name])
    weights_a = [p for p in model_a.parameters() if p.dim() > 1]
    weights_c = [p for p in model_c.parameters() if p.dim() > 1]
    assert not all(torch.equal(a, c) for a, c in zip(weights_a, weights_c, strict=True))


def test_overrides_change_sizes() -> None:
    gpt, inputs = zoo.build("gpt2", n_layer=3, n_embd=64, batch_size=5, seq_len=200)
    assert isinstance(gpt, zoo.GPT) and len(gpt.blocks) == 3
    assert gpt.wte.weight.shape == (1024, 64)
    assert inputs["idx"].shape == inputs["targets"].shape == (5, 200)
    assert torch.equal(inputs["idx"][:, 1:], inputs["targets"][:, :-1])  # next-token targets

    llama, inputs = zoo.build("llama", n_layer=1, n_kv_head=4, batch_size=3, seq_len=24)
    assert isinstance(llama, zoo.Llama) and len(llama.layers) == 1
    k_proj = llama.get_submodule("layers.0.attn.k_proj")
    assert isinstance(k_proj, nn.Linear) and k_proj.out_features == 128  # 4 kv heads of 32: MHA
    assert inputs["input_ids"].shape == (3, 24) and torch.equal(
        inputs["labels"], inputs["input_ids"]
    )

    mlp, (x, y) = zoo.build("mlp", widths=(32, 48), d_in=20, n_classes=3, batch_size=7)
    assert isinstance(mlp, zoo.MLPChain) and len(mlp.blocks) == 2
    assert x.shape == (7, 20) and y.shape == (7,) and int(y.max()) < 3
    assert _run(mlp, (x, y)).logits.shape == (7, 3)

    resnet, (images, labels) = zoo.build("resnet", blocks_per_stage=3, batch_size=2, image_size=24)
    assert isinstance(resnet, zoo.ResNet)
    assert [len(list(stage.children())) for stage in resnet.stages] == [3, 3, 3]
    assert images.shape == (2, 3, 24, 24) and labels.shape == (2,)


def test_gpt2_ties_lm_head_and_llama_does_not() -> None:
    gpt, _ = zoo.build("gpt2", dtype=torch.bfloat16, **SMALL["gpt2"])
    assert isinstance(gpt, zoo.GPT)
    assert gpt.lm_head.weight is gpt.wte.weight
    llama, _ = zoo.build("llama", **SMALL["llama"])
    assert isinstance(llama, zoo.Llama)
    assert llama.lm_head.weight is not llama.embed_tokens.weight
    # the rotary tables are derived from the config, not saved
    assert not any("rope" in key for key in llama.state_dict())
    assert {name for name, _ in llama.named_buffers()} == {"rope_cos", "rope_sin"}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_language_models_are_causal(name: str) -> None:
    model, inputs = zoo.build(name, **SMALL[name])
    model.eval()  # no dropout, so the only difference can come from the changed token
    ids = next(iter(inputs.values()))  # idx or input_ids, (B, T)
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 1024
    with torch.no_grad():
        before = model(ids).logits  # (B, T, vocab)
        after = model(changed).logits
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("name", zoo.names())
def test_dtype(name: str) -> None:
    model, inputs = zoo.build(name, dtype=torch.bfloat16, **SMALL[name])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for tensor in _tensors(inputs):
        assert tensor.dtype in (torch.bfloat16, torch.long)
    out = _run(model, inputs)
    assert out.logits.dtype == torch.bfloat16
    assert out.loss is not None
    out.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("name", zoo.names())
def test_meta_device_allocates_nothing_and_runs(name: str) -> None:
    model, inputs = zoo.build(name, device="meta")  # default sizes: nothing is allocated
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert all(t.is_meta for t in _tensors(inputs))
    out = _run(model, inputs)
    assert out.logits.is_meta and out.loss is not None and out.loss.is_meta
    assert out.logits.shape[0] == _DEFAULT_BATCH[name]
    out.loss.backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


def test_entry_build_runs_without_the_wrapper() -> None:
    model, (x, y) = zoo.ZOO["mlp"].build(widths=(16,), batch_size=4)
    assert _run(model, (x, y)).logits.shape == (4, 10)


def test_no_targets_gives_no_loss() -> None:
    model, inputs = zoo.build("gpt2", **SMALL["gpt2"])
    out = model(inputs["idx"])
    assert out.loss is None and out.logits.shape == (2, 16, 1024)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("gtp2", {}, "unknown zoo model 'gtp2'. Did you mean 'gpt2'?"),
        ("lama", {}, "Did you mean 'llama'?"),
        ("transformer", {}, "Available: gpt2, llama, mlp, resnet"),
        ("gpt2", {"n_layers": 2}, "unknown option 'n_layers'. Did you mean 'n_layer'?"),
        ("llama", {"batchsize": 2}, "Did you mean 'batch_size'?"),
        ("mlp", {"seq_len": 8}, "mlp: unknown option 'seq_len'"),
        ("resnet", {"depth": 18}, "Valid options: in_channels, stem_channels"),
        ("gpt2", {"seq_len": 2048}, "also pass block_size=2048"),
        ("llama", {"n_kv_head": 3}, "n_head=4 must be a multiple of n_kv_head=3"),
        ("gpt2", {"n_head": 5}, "n_embd=128 must be divisible by n_head=5"),
        ("mlp", {"widths": ()}, "widths must name at least one block width"),
    ],
)
def test_errors_name_the_problem(name: str, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(RematError) as info:
        zoo.build(name, **overrides)
    assert message in str(info.value)


def test_unknown_option_message_without_close_match_lists_valid_options() -> None:
    with pytest.raises(RematError) as info:
        zoo.build("mlp", zzz=1)
    assert "Did you mean" not in str(info.value)
    assert "d_in, widths, n_classes, norm_every, dropout, batch_size" in str(info.value)


@pytest.mark.parametrize(("name", "option"), [
    ("gpt2", {"n_layer": 0}), ("llama", {"n_head": -2}), ("mlp", {"widths": (64, 0)}),
    ("gpt2", {"batch_size": 0}),
])
def test_a_count_or_size_below_one_is_refused_before_building(name: str,
                                                              option: dict[str, object]) -> None:
    """n_layer=0 used to build a model with no blocks, refused later as 'found no chain'."""
    key = next(iter(option))
    with pytest.raises(RematError, match=rf"option {key}=.* must be a (tuple of )?whole "
                                         rf"numbers? >= 1"):
        zoo.build(name, **option)
