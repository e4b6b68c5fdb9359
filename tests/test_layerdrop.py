"""Models that skip layers at random in training (LayerDrop), planned for the step where
every layer runs (NOTE [ Random layer skipping ] in ``_core/step.py``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autoremat
from autoremat import RematError

transformers = pytest.importorskip("transformers")


def _wav2vec2(layerdrop: float = 0.3):
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        vocab_size=20, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        layerdrop=layerdrop, mask_time_prob=0.0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    return model, {"input_values": torch.randn(2, 4000),
                   "labels": torch.randint(1, 20, (2, 20))}


def _grads(model, inputs, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(**inputs).loss.backward()
    return [p.grad for p in model.parameters()]


def test_a_model_that_skips_layers_is_planned_for_every_layer():
    model, inputs = _wav2vec2()
    tape = autoremat.profile(model, inputs, timing=False)
    assert len(tape.blocks) == 4  # every layer ran once (it was refused: "ran 0 times")
    assert any("layerdrop=0.3" in note for note in tape.notes)
    assert model.config.layerdrop == 0.3  # restored
    assert not any(b.chained for b in tape.blocks)  # no multi-block segments
    plan = autoremat.auto(model, inputs, budget="60%")
    assert autoremat.verify(model, inputs, plan, repeats=1).ok  # the step with every layer
    plain = copy.deepcopy(model)
    autoremat.remove(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped block is no reason to warn
        for seed in range(6):  # layers skipped at random: the same ones in both
            ours, theirs = _grads(model, inputs, seed), _grads(plain, inputs, seed)
            assert all((a is None and b is None) or torch.equal(a, b)
                       for a, b in zip(ours, theirs, strict=True)), seed


def test_segments_are_refused_where_layers_are_skipped():
    # a tape that joins blocks (made without LayerDrop) applied to a model with it: the
    # skips between a segment's blocks would not be replayed by its recompute
    model, inputs = _wav2vec2(layerdrop=0.0)
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert all(b.chained for b in tape.blocks[1:])
    plan = autoremat.plan(tape, strategy="sqrt")
    assert any(stop > start + 1 for start, stop, _ in plan.segments)
    model.config.layerdrop = 0.2
    with pytest.raises(RematError, match=r"skips layers at random.*layerdrop=0\.2"):
        autoremat.apply(model, plan)
    model.config.layerdrop = 0.0
    autoremat.apply(model, plan)  # without it, the segments run
    autoremat.remove(model)


def test_a_layer_drop_of_the_models_own_is_named_where_profile_misses_a_block() -> None:
    # a parent that skips layers at random (not a config's layerdrop, which profile
    # turns off itself) made the profile fail at random, saying nothing of skipping
    class Dropping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            for i, layer in enumerate(self.layers):
                if self.training and self.calls > 1 and i == 2:
                    continue  # (skipped from the second step on)
                x = torch.relu(layer(x))
            return x.sum()

    with pytest.raises(autoremat.BlockError, match=r"'layers\.2' never ran.*skips layers "
                                                   r"at random in training.*probability "
                                                   r"to 0 while profiling"):
        autoremat.profile(Dropping(), torch.randn(4, 8), timing=False)


class _LayerDropouts(torch.nn.Module):
    """x-transformers' and vit-pytorch's layer drop: ``layer_dropout`` (one probability)
    or ``layer_dropouts`` (one per layer), read as each layer is reached."""

    def __init__(self, per_layer: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        if per_layer:
            self.layer_dropouts = (0.0, 0.5, 0.5, 0.0)
        else:
            self.layer_dropout = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drops = getattr(self, "layer_dropouts", None) or (self.layer_dropout,) * 4
        for layer, p in zip(self.layers, drops, strict=True):
            if self.training and p > 0 and torch.rand(()) < p:
                continue
            x = torch.relu(layer(x))
        return x.pow(2).mean()


@pytest.mark.parametrize("per_layer", [False, True], ids=["layer_dropout", "layer_dropouts"])
def test_the_layer_drops_of_lucidrains_libraries_are_turned_off_while_measuring(
        per_layer: bool) -> None:
    # x-transformers' decoders and vit-pytorch's CaiT and XCiT skip layers at random by
    # these attributes, and profile failed on them ("never ran as a module call", held-
    # out checks, 2026-12-02)
    torch.manual_seed(0)
    model = _LayerDropouts(per_layer)
    tape = autoremat.profile(model, torch.randn(4, 8), timing=False)
    assert len(tape.blocks) == 4
    key = "layer_dropouts=(0.0, 0.5, 0.5, 0.0)" if per_layer else "layer_dropout=0.5"
    assert any(key in note for note in tape.notes), tape.notes
    assert getattr(model, "layer_dropouts" if per_layer else "layer_dropout") == \
        ((0.0, 0.5, 0.5, 0.0) if per_layer else 0.5)  # restored
    assert not any(b.chained for b in tape.blocks)


def _switch(noise: float):
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, expert_capacity=16, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, router_jitter_noise=noise, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, use_cache=False)
    model = transformers.SwitchTransformersForConditionalGeneration(config).train()
    ids = torch.randint(2, 64, (2, 16))
    return model, {"input_ids": ids, "labels": torch.randint(2, 64, (2, 16))}


@pytest.mark.parametrize("noise", [0.01, 0.0])
def test_experts_chosen_with_noise_are_named_and_warned_about(noise: float) -> None:
    # NOTE [ Experts chosen with noise ] in _profile/profile.py: the router's jitter draws
    # each expert's token count at every step (a held-out SwitchTransformers: 9 of 22
    # plans up to 8.2% above their predictions, one over its budget); none without it
    model, inputs = _switch(noise)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tape = autoremat.profile(model, inputs, loss_fn=lambda out: out.loss, timing=False,
                                 with_selective=False)
    told = [str(w.message) for w in seen if "chooses its experts with noise" in str(w.message)]
    noted = [n for n in tape.notes if "chooses its experts with noise" in n]
    if noise:
        assert len(told) == 1 and noted == [told[0].removeprefix("autoremat: ")]
        assert "(jitter_noise=0.01)" in noted[0]
    else:
        assert not told and not noted


def test_a_threshold_named_router_jitter_noise_is_not_noise() -> None:
    # PhiMoE's router_jitter_noise (0.01 by default) is its sparse mixer's threshold,
    # read in every step alike; only its input_jitter_noise (0 by default) draws
    from autoremat._core.step import router_noise

    config = transformers.PhimoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.PhimoeForCausalLM(config).train()
    assert config.router_jitter_noise > 0 and router_noise(model) == []
    config.input_jitter_noise = 0.1
    noisy = transformers.PhimoeForCausalLM(config).train()
    assert router_noise(noisy) == ["input_jitter_noise=0.1"]
    assert router_noise(noisy.eval()) == []
