"""Tests for autoremat.blocks: finding the chain of repeated blocks to plan over."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat import zoo
from autoremat._core.errors import BlockError
from autoremat._measure.blocks import (
    STACK_SHARE,
    attribute_layers,
    discover_blocks,
    discovery_notes,
    keyed_by_position,
    other_repeated_blocks,
    resolve_blocks,
)

from _steps import ResidualMlp, exact


class Layer(nn.Module):
    """A repeated layer with a nested submodule, so "inside a block" is testable."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.inner = nn.Sequential(nn.Linear(d, d), nn.ReLU())

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.inner(self.fc(x))


class Wrapped(nn.Module):
    """embed -> encoder.layers (a ModuleList inside a wrapper) -> head."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([Layer() for _ in range(n)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = self.embed(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.head(x)


def test_sequential_children_are_the_blocks() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert discover_blocks(model) == ["0", "1", "2", "3", "4"]
    assert resolve_blocks(model, None) == ["0", "1", "2", "3", "4"]


def test_modulelist_inside_a_wrapper() -> None:
    model = Wrapped(n=4)
    assert discover_blocks(model) == [f"encoder.layers.{i}" for i in range(4)]


def test_the_container_holding_most_repeated_parameters_wins() -> None:
    class TwoLists(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(6)])  # 6 x 6 params
            self.big = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])  # 2 x 1056

    assert discover_blocks(TwoLists()) == ["big.0", "big.1"]


class _SideBySide(nn.Module):
    """The experts of a mixture, run side by side on the tokens (soft-moe-pytorch's
    ``Experts``, which the mixture holds)."""

    def __init__(self, width: int, n: int = 4) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                   nn.Linear(4 * width, width))
                                     for _ in range(n))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return sum(w.unsqueeze(-1) * e(x) for w, e in zip(weights.unbind(-1), self.experts,
                                                          strict=True))


class _Mixture(nn.Module):
    def __init__(self, width: int, n: int = 4) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(width, n), _SideBySide(width, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x).softmax(-1))


def test_layers_that_alternate_are_scored_by_every_kind_that_repeats() -> None:
    # soft-moe-pytorch's ViT holds [attention, mixture, attention, mixture]: scored by its
    # attention layers alone, it lost to the list of experts inside each mixture (more
    # parameters), which run side by side, and the plans left attention out
    width = 16
    layers = nn.ModuleList()
    for _ in range(2):
        layers.append(nn.MultiheadAttention(width, 2, batch_first=True))
        layers.append(_Mixture(width))
    holder = nn.Module()
    holder.layers = layers
    experts = sum(p.numel() for p in layers[1].experts.experts.parameters())
    attention = sum(p.numel() for p in layers[0].parameters())
    assert experts > 2 * attention  # the experts alone outweigh the attention layers
    assert discover_blocks(holder) == [f"layers.{i}" for i in range(4)]


def test_nested_cnn_stages_are_flattened_in_order() -> None:
    def stage(n: int) -> nn.Sequential:
        return nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(n)])

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3)
            self.stages = nn.Sequential(stage(2), stage(3))
            self.fc = nn.Linear(4, 10)

    assert discover_blocks(CNN()) == [
        "stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.1.2"
    ]  # fmt: skip


class _Dict(nn.Module):
    """Layers in a ModuleDict under ``keys``, run in that order."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleDict({key: Layer() for key in keys})

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return x


@pytest.mark.parametrize("keys", [[str(i) for i in range(4)],  # torchtitan's
                                  [f"layer{i}" for i in range(4)],
                                  [f"block_{i}_out" for i in range(4)]])
def test_a_module_dict_keyed_by_position_is_a_chain(keys: list[str]) -> None:
    assert keyed_by_position(_Dict(keys).layers)
    assert discover_blocks(_Dict(keys)) == [f"layers.{key}" for key in keys]


@pytest.mark.parametrize("keys", [["student", "teacher"], ["encoder", "decoder"],
                                  ["0", "1", "norm"], ["a1", "b2"]])
def test_a_module_dict_keyed_by_name_is_parts_not_a_chain(keys: list[str]) -> None:
    """Parts need not run one after the other (a teacher under no_grad, two heads on one
    input): not a chain (``profile`` names them in its error, test_validation.py)."""
    assert not keyed_by_position(_Dict(keys).layers)
    assert discover_blocks(_Dict(keys)) == [""]


def test_zoo_containers_are_found() -> None:
    gpt, _ = zoo.build("gpt2", n_layer=3, batch_size=1, seq_len=8)
    assert discover_blocks(gpt) == ["blocks.0", "blocks.1", "blocks.2"]
    llama, _ = zoo.build("llama", n_layer=2, batch_size=1, seq_len=8)
    assert discover_blocks(llama) == ["layers.0", "layers.1"]
    mlp, _ = zoo.build("mlp", widths=(8, 8, 8), batch_size=2)
    assert discover_blocks(mlp) == ["blocks.0", "blocks.1", "blocks.2"]
    resnet, _ = zoo.build("resnet", stage_channels=(4, 8), stem_channels=4, batch_size=1)
    assert discover_blocks(resnet) == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]


def test_modulelist_of_sequential_layers_keeps_the_layers() -> None:
    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]
            )

    assert discover_blocks(Mixer()) == ["layers.0", "layers.1", "layers.2"]


def test_model_without_a_chain_is_its_own_block() -> None:
    assert discover_blocks(nn.Linear(3, 3)) == [""]
    # a list of single layers none of which repeats is no chain either (NOTE [ A list of
    # distinct layers ]: the layers would be planned one by one)
    assert discover_blocks(nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.ReLU())) \
        == [""]


class _Stem(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.GELU())


class _Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, 2, x.shape[-1]).mean(2)


class _Distinct(nn.Module):
    """A stem, then a list of layers of classes of their own, a pool among them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = _Stem()
        self.body = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()), _Pool(),
                                   _Stage(16)])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.body:
            x = layer(x)
        return self.head(x.mean(1))


def test_a_list_of_distinct_layers_is_the_chain() -> None:
    # NOTE [ A list of distinct layers ]: no container repeats a layer, so the list
    # holding the most parameters among those of two composite layers or more is the
    # chain, all of its elements (the pool too); profile refused such a model before
    # ("found no chain": 1,381 of 5,038 fuzzed models)
    model, x = _Distinct(), torch.randn(2, 8, 8)
    assert discover_blocks(model) == ["body.0", "body.1", "body.2"]
    tape = autoremat.profile(model, x, timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == ["body.0", "body.1", "body.2"]
    exact(model, x, autoremat.plan(tape, strategy="full"))
    # a repeated container still wins over one of distinct layers holding more
    model.extra = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
    assert discover_blocks(model) == ["extra.0", "extra.1"]


class _HeldStage(nn.Module):
    """Blocks held by ``add_module`` and run over ``children()``, as timm's RegStage."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        for k in range(depth):
            self.add_module(f"b{k + 1}", ResidualMlp(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = block(x)
        return x


class _Norm(nn.Module):
    """A linear layer and a norm, held as attributes."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, out)
        self.norm = nn.LayerNorm(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class _Attributed(nn.Module):
    """A stem, stages and a head held as attributes, no list among them (timm's RegNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = _Norm(8, 16)
        self.s1 = _HeldStage(16, 1)
        self.s2 = _HeldStage(16, 2)
        self.head = _Norm(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.s2(self.s1(self.stem(x))))


def test_layers_held_as_attributes_are_the_chain() -> None:
    # NOTE [ Layers held as attributes ]: profile refused timm's RegNet, Inception v3 and
    # DLA ("found no chain of blocks"); now their attributes are the chain, in order
    torch.manual_seed(0)
    model, x = _Attributed(), torch.randn(4, 32, 8)
    assert discover_blocks(model) == [""]  # no list holds a chain
    assert attribute_layers(model) == ["stem", "s1", "s2", "head"]
    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    tape = autoremat.profile(model, x, loss, timing=False)
    assert [b.name for b in tape.blocks] == ["stem", "s1", "s2", "head"]
    assert any(n.startswith("blocks: the 4 modules the model holds as attributes")
               for n in tape.notes), tape.notes
    for strategy in ("full", "sqrt"):
        exact(model, x, autoremat.plan(tape, strategy=strategy), loss_fn=loss)
    # a single layer holds no chain: still refused, saying what to do
    with pytest.raises(BlockError, match="found no chain of blocks in Linear"):
        autoremat.profile(nn.Linear(4, 4), torch.randn(2, 4), timing=False)


def test_explicit_names_are_kept_in_the_given_order() -> None:
    model = Wrapped(n=3)
    assert resolve_blocks(model, ["encoder.layers.0", "encoder.layers.2"]) == [
        "encoder.layers.0",
        "encoder.layers.2",
    ]
    assert resolve_blocks(model, ("embed", "head")) == ["embed", "head"]


def test_predicate_selects_the_outermost_matches_only() -> None:
    model = Wrapped(n=3)
    # matches every layer and everything inside it (fc, inner, inner.0, ...)
    names = resolve_blocks(model, lambda name, _: name.startswith("encoder.layers."))
    assert names == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    by_type = resolve_blocks(model, lambda _, module: isinstance(module, nn.Linear))
    assert by_type == ["embed"] + [f"encoder.layers.{i}.{s}" for i in range(3)
                                   for s in ("fc", "inner.0")] + ["head"]


def test_predicate_matching_the_root_does_not_return_nested_blocks() -> None:
    assert resolve_blocks(Wrapped(n=2), lambda name, _: True) == [""]


def test_predicate_matching_nothing_is_an_error() -> None:
    with pytest.raises(BlockError, match="matched no module"):
        resolve_blocks(Wrapped(), lambda name, _: name == "decoder")


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        (["encoder.layers.0", "encoder.layers.0.fc"], "is inside block 'encoder.layers.0'"),
        (["encoder.layers.1.inner", "encoder.layers.1"], "is inside block 'encoder.layers.1'"),
        (["", "head"], "is inside block ''"),
        (["head", "head"], "lists a module twice"),
        (["encoder.layer.0"], "Did you mean 'encoder.layers.0'?"),
        (["decoder"], "no submodule named 'decoder' in Wrapped"),
        ([], "no blocks to plan over"),
    ],
)
def test_bad_names_are_rejected(blocks: list[str], message: str) -> None:
    with pytest.raises(BlockError) as info:
        resolve_blocks(Wrapped(), blocks)
    assert message in str(info.value)


def test_a_string_instead_of_a_list_is_rejected_with_the_fix() -> None:
    with pytest.raises(BlockError) as info:
        resolve_blocks(Wrapped(), "encoder.layers.0")  # type: ignore[arg-type]
    assert "not the string 'encoder.layers.0'" in str(info.value)
    assert "blocks=['encoder.layers.0']" in str(info.value)


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.up(x).relu())
        return out


class _EncoderDecoder(nn.Module):
    """Two containers of repeated blocks run one after the other; the decoder holds more
    parameters, and a small repeated head runs last."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.decoder = nn.ModuleList(_Wide() for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder, *self.decoder]:
            x = block(x)
        return self.heads[0](x) + self.heads[1](x)


def test_stacks_beside_the_chain_join_it_and_small_repeats_are_named() -> None:
    import autoremat

    model = _EncoderDecoder()
    names = discover_blocks(model)
    assert names == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    assert other_repeated_blocks(model, names) == ["heads"]
    tape = autoremat.profile(model, torch.randn(4, 8), repeats=1)
    assert [b.name for b in tape.blocks] == names
    assert any("not planned over: heads" in n for n in tape.notes)
    assert "note: planning over the repeated blocks found; also smaller" in str(tape)
    only = autoremat.profile(model, torch.randn(4, 8), blocks=names[2:], repeats=1)
    assert not any("not planned over" in n for n in only.notes)  # blocks given: no note


def test_a_stack_holding_less_than_a_quarter_stays_out() -> None:
    class Uneven(nn.Module):
        def __init__(self, wide: int) -> None:
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # 2 x 72
            self.big = nn.ModuleList(nn.Linear(8, wide) for _ in range(2))

    assert STACK_SHARE == 0.25
    assert discover_blocks(Uneven(wide=8)) == ["small.0", "small.1", "big.0", "big.1"]
    assert discover_blocks(Uneven(wide=64)) == ["big.0", "big.1"]  # 72 < 576 / 4
    assert other_repeated_blocks(Uneven(wide=64), ["big.0", "big.1"]) == ["small"]


class _Stages(nn.Module):
    """torchvision's ResNet: stages as attributes side by side, each a Sequential of
    residual blocks, the width doubling and the resolution halving from one to the next
    (the last holds most parameters, the first most activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Sequential(_Residual(4), _Residual(4))
        self.down2 = nn.Conv2d(4, 16, 3, stride=2, padding=1)
        self.layer2 = nn.Sequential(_Residual(16), _Residual(16))
        self.down3 = nn.Conv2d(16, 64, 3, stride=2, padding=1)
        self.layer3 = nn.Sequential(_Residual(64), _Residual(64))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.stem(x))
        x = self.layer3(self.down3(self.layer2(self.down2(x))))
        return self.head(x.mean((2, 3))).pow(2).mean()


def test_stages_of_the_chains_kind_of_block_join_it_whatever_they_hold() -> None:
    """NOTE [ Stacks beside the chain ]: the first stages hold under a quarter of the
    last's parameters and join it, as blocks of its kind; planned over the last stage
    alone, the smallest plan is higher (a stack of single layers stays out:
    test_a_stack_holding_less_than_a_quarter_stays_out)."""
    import autoremat
    from autoremat._plan.strategies import smallest_feasible_bytes

    torch.manual_seed(0)
    model, x = _Stages(), torch.randn(2, 3, 32, 32)
    assert discover_blocks(model) == [f"layer{i}.{j}" for i in (1, 2, 3) for j in (0, 1)]
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    last = autoremat.profile(model, x, blocks=["layer3.0", "layer3.1"], repeats=1,
                             timing=False, with_selective=False)
    assert smallest_feasible_bytes(tape) < smallest_feasible_bytes(last)


def test_a_list_of_one_block_of_the_chains_kind_joins_it() -> None:
    """NOTE [ Stacks beside the chain ]: a decoder of one layer beside an encoder of three
    joins the chain (it was not a repeated container); a list of one single layer, or of
    another kind of block, stays out."""

    class OneDeep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList(Layer() for _ in range(3))
            self.decoder = nn.ModuleList([Layer()])
            self.head = nn.ModuleList([nn.Linear(8, 8)])
            self.other = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU())])

    assert discover_blocks(OneDeep()) == ["encoder.0", "encoder.1", "encoder.2", "decoder.0"]


class _TwoTowers(nn.Module):
    """Two stacks defined text first, run image first (as CLIP's forward does)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.image = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for block in self.image:
            y = block(y)
        z = x
        for block in self.text:
            z = block(z)
        return (y * z).sum()


def test_a_discovered_chain_is_planned_in_the_order_it_runs() -> None:
    import autoremat

    model = _TwoTowers()
    assert discover_blocks(model) == ["text.0", "text.1", "image.0", "image.1"]
    tape = autoremat.profile(model, torch.randn(4, 8, requires_grad=True), repeats=1,
                             with_selective=False)
    assert [b.name for b in tape.blocks] == ["image.0", "image.1", "text.0", "text.1"]
    assert any("in the order they run" in n for n in tape.notes)
    assert [b.chained for b in tape.blocks] == [False, True, False, True]
    with pytest.raises(BlockError, match="list the blocks in the order they run"):
        autoremat.profile(model, torch.randn(4, 8), blocks=discover_blocks(model), repeats=1)



def test_blocks_a_predicate_chose_are_planned_in_the_order_they_run() -> None:
    """A predicate gives a set, not an order (a diffusers UNet's resnets and attentions
    are defined up, down, mid and run down, mid, up): its blocks go in the order they
    run, as found ones do, where a list in another order is refused (above)."""
    import autoremat

    model, x = _TwoTowers(), torch.randn(4, 8, requires_grad=True)
    tape = autoremat.profile(model, x, blocks=lambda name, m: isinstance(m, nn.Linear),
                             repeats=1, with_selective=False)
    assert [b.name for b in tape.blocks] == ["image.0", "image.1", "text.0", "text.1"]
    assert any("the predicate chose run in another order" in n for n in tape.notes)
    plan = autoremat.plan(tape, strategy="full")
    autoremat.apply(model, plan)
    try:
        assert autoremat.verify(model, x, plan).max_grad_diff == 0.0
    finally:
        autoremat.remove(model)
    in_order = autoremat.profile(model, x, blocks=lambda name, m: name.startswith("text."),
                                 repeats=1, with_selective=False)
    assert not any("another order" in n for n in in_order.notes)

class _CallsForward(nn.Module):
    """Calls its layers' forward methods directly, as SqueezeBERT's encoder does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer.forward(x)
        return x.pow(2).sum()


def test_blocks_called_through_their_forward_method_are_refused_with_why() -> None:
    import autoremat

    with pytest.raises(BlockError, match=r"'layers\.0' never ran as a module call .*"
                                         r"layer\.forward\(\.\.\.\)"):
        autoremat.profile(_CallsForward(), torch.randn(4, 8), repeats=1)
    with pytest.raises(BlockError, match=r"'layers' is a ModuleList, a container the model "
                                         r"does not call: .*'layers\.0', 'layers\.1'"):
        autoremat.profile(_CallsForward(), torch.randn(4, 8), blocks=["layers"], repeats=1)


class _MixedBlocks(nn.Module):
    """The most ordinary model: a ModuleList of Sequential(Linear, GELU, Linear, Tanh)."""

    def __init__(self, n: int = 6, d: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.Tanh())
            for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_list_of_mixed_sequentials_is_a_chain_of_the_sequentials() -> None:
    model = _MixedBlocks()
    assert discover_blocks(model) == [f"layers.{i}" for i in range(6)]  # not 24 layers
    assert other_repeated_blocks(model, discover_blocks(model)) == []
    (note,) = discovery_notes(model)
    assert note.startswith("blocks: the 6 elements of 'layers' (each a Sequential of "
                           "Linear, GELU, Linear, Tanh), not the layers inside them")


@pytest.mark.slow
def test_a_list_of_mixed_sequentials_is_planned_over_the_sequentials() -> None:
    # was planned over the 24 layers inside them: every "block" checkpointed raised the
    # peak (27%), and the tape's note blamed skip connections
    import autoremat

    torch.manual_seed(0)
    model, x = _MixedBlocks(), torch.randn(128, 64)
    names = [f"layers.{i}" for i in range(6)]
    tape = autoremat.profile(model, x, repeats=1, with_selective=False, timing=False)
    assert [b.name for b in tape.blocks] == names
    assert any("the 6 elements of 'layers'" in n and "Linear, GELU, Linear, Tanh" in n
               for n in tape.notes)
    assert not any("skip connections" in n for n in tape.notes)
    assert tape.ckpt_step_peak_bytes < tape.step_peak_bytes  # full checkpointing helps
    for plan in (autoremat.plan(tape, "75%"), autoremat.plan(tape, strategy="full")):
        autoremat.apply(model, plan)
        report = autoremat.verify(model, x, repeats=1)
        autoremat.remove(model)
        assert report.grads_equal
        assert report.peak_bytes <= plan.predicted_peak_bytes < tape.step_peak_bytes


def test_the_stages_of_a_cnn_are_flattened_and_the_notes_say_which_level() -> None:
    def stage(n: int) -> nn.Sequential:
        return nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(n)])

    stages = nn.Sequential(stage(2), stage(3))
    assert discover_blocks(stages) == ["0.0", "0.1", "1.0", "1.1", "1.2"]
    assert discovery_notes(stages) == [
        "blocks: the 5 layers of the 2 stages in the model (each stage a run of Conv2d), "
        "not the stages themselves. Pass blocks=[...] to plan at another level"]
    assert discovery_notes(Wrapped()) == []  # no choice between levels: no note


def test_copies_of_one_run_of_layers_are_blocks_but_a_stage_of_blocks_is_flattened() -> None:
    pairs = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(3))
    assert discover_blocks(pairs) == ["0", "1", "2"]  # checkpointing one Linear saves nothing
    stages = nn.ModuleList(nn.Sequential(Layer(), Layer()) for _ in range(2))
    assert discover_blocks(stages) == ["0.0", "0.1", "1.0", "1.1"]  # residual-style blocks


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.GroupNorm(2, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.conv(x)).relu()


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(x.flatten(2).transpose(1, 2)).chunk(3, -1)
        y = self.out(nn.functional.scaled_dot_product_attention(q, k, v))
        return x + y.transpose(1, 2).reshape(b, c, h, w)


class _Down(nn.Module):
    """A diffusion U-Net's down block: residual blocks and attentions interleaved, held in
    two lists, then a downsampler (diffusers' CrossAttnDownBlock2D)."""

    def __init__(self, width: int, attention: bool = True, layers: int = 2) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(_Residual(width) for _ in range(layers))
        self.attentions = nn.ModuleList(_Attention(width)
                                        for _ in range(layers if attention else 0))
        self.downsample = nn.Conv2d(width, width, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(x)
            if self.attentions:
                x = self.attentions[i](x)
        return self.downsample(x)


class _Plain(_Down):
    def __init__(self, width: int) -> None:
        super().__init__(width, attention=False)


class _StagedUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.downs = nn.ModuleList([_Down(8), _Down(8), _Plain(8)])
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for down in self.downs:
            x = down(x)
        return self.head(x).pow(2).mean()


def test_stage_modules_that_differ_are_planned_over_their_layers_in_the_order_they_run(
        ) -> None:
    """NOTE [ Which container is the chain ]: down blocks of a U-Net (of two classes)
    holding their residual blocks and attentions in lists are stages: the
    chain is their layers, in the order they run, and its smallest plan is below the one
    over the down blocks, measured to its prediction."""
    import autoremat
    from autoremat._plan.strategies import smallest_feasible_bytes

    torch.manual_seed(0)
    model, x = _StagedUNet(), torch.randn(2, 3, 32, 32)
    layers = [f"downs.{i}.{kind}.{j}" for i in range(3)
              for kind in ("resnets", "attentions")[:2 if i < 2 else 1] for j in range(2)]
    assert discover_blocks(model) == layers
    notes = discovery_notes(model)
    assert len(notes) == 1 and "the 10 layers of 3 stage(s) in 'downs'" in notes[0] \
        and "'attentions', 'resnets'" in notes[0]
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    run_order = [f"downs.{i}.{kind}.{j}" for i in range(3) for j in range(2)
                 for kind in ("resnets", "attentions")[:2 if i < 2 else 1]]
    assert [b.name for b in tape.blocks] == run_order
    stages = autoremat.profile(model, x, blocks=["downs.0", "downs.1", "downs.2"],
                               repeats=1, timing=False, with_selective=False)
    least = smallest_feasible_bytes(tape)
    assert least < smallest_feasible_bytes(stages)
    exact(model, x, autoremat.plan(tape, budget=least), repeats=1)


class _SmallUNet(nn.Module):
    """Down blocks one of each class, the first with one residual block and one attention
    (diffusers' small test U-Nets: ``layers_per_block=1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.downs = nn.ModuleList([_Down(8, layers=1), _Plain(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down in self.downs:
            x = down(x)
        return x.pow(2).mean()


def test_a_list_of_stages_each_of_its_own_class_is_a_chain_of_their_layers() -> None:
    """NOTE [ Which container is the chain ]: no class comes twice in the list, but its
    stages hold layers that repeat (in two lists, or one kind twice)."""
    import autoremat

    model, x = _SmallUNet(), torch.randn(2, 8, 16, 16)
    assert discover_blocks(model) == ["downs.0.resnets.0", "downs.0.attentions.0",
                                      "downs.1.resnets.0", "downs.1.resnets.1"]
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == discover_blocks(model)


class _Experts(nn.Module):
    """A layer holding its experts in a list of its own (a mixture of experts)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                   nn.Linear(2 * width, width))
                                     for _ in range(4))


class _Sublayers(nn.Module):
    """T5's block: a list of its parts, one of each kind."""

    def __init__(self, first: bool, width: int = 8) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Layer(width), nn.Sequential(nn.Linear(width, width))])
        self.bias = nn.Embedding(4, 2) if first else None


def _norm_act(c_in: int, c_out: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, groups=groups),
                         nn.BatchNorm2d(c_out), nn.ReLU6())


class _InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: its convolutions in one Sequential, two of them
    composite (convolution, norm, activation), the last a single layer."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(_norm_act(c_in, 2 * c_in),
                                  _norm_act(2 * c_in, 2 * c_in, groups=2 * c_in),
                                  nn.Conv2d(2 * c_in, c_out, 1), nn.BatchNorm2d(c_out))


def test_identical_layers_and_layers_of_parts_stay_blocks() -> None:
    """NOTE [ Which container is the chain ]: a stage module is flattened only where the
    elements differ and its lists hold one kind of layer at least twice: identical layers
    holding experts, and T5-like blocks (the first with a position bias) whose list holds
    one part of each kind, stay blocks; so do MobileNet's blocks of differing widths,
    whose list mixes composite and single layers."""
    assert discover_blocks(nn.ModuleList(_Experts() for _ in range(3))) == ["0", "1", "2"]
    blocks = nn.ModuleList(_Sublayers(first=i == 0) for i in range(3))
    assert discover_blocks(blocks) == ["0", "1", "2"]
    assert discovery_notes(blocks) == []
    mobile = nn.Sequential(_norm_act(3, 8), _InvertedResidual(8, 8),
                           _InvertedResidual(8, 16), _InvertedResidual(16, 16))
    assert discover_blocks(mobile) == ["0", "1", "2", "3"]


class _InPlaceActivations(nn.Module):
    """torchvision's VGG: in-place ReLUs as layers of their own in one Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3))).pow(2).mean()


def test_blocks_found_that_change_their_input_in_place_run_between_the_others() -> None:
    """A block whose forward writes its input cannot be checkpointed (its checkpoint
    keeps that input for the recompute): found, it leaves the chain with a note (profile
    refused the model), and a block after it, whose input it wrote, is not chained to
    the one before (a segment cannot replay the write between them). Plans at the least
    budget and at every other block are exact; named in blocks=, it is refused."""
    import autoremat
    from autoremat._core.errors import RematError
    from autoremat._plan.strategies import smallest_feasible_bytes

    torch.manual_seed(0)
    model, x = _InPlaceActivations(), torch.randn(2, 3, 16, 16)
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == ["features.0", "features.2", "features.4",
                                             "features.5", "features.7"]
    assert any("4 of the blocks found change their input in place" in n for n in tape.notes)
    assert [b.chained for b in tape.blocks[1:]] == [False, False, True, False]
    for plan in (autoremat.plan(tape, budget=smallest_feasible_bytes(tape)),
                 autoremat.plan(tape, strategy="every:2")):
        exact(model, x, plan, repeats=1)
    with pytest.raises(RematError, match="changed its input in place"):
        autoremat.profile(model, x, blocks=[f"features.{i}" for i in range(9)], repeats=1,
                          timing=False, with_selective=False)


class SelfCheckpointed(nn.Module):
    """Blocks the model checkpoints itself with torch.utils.checkpoint."""

    def __init__(self, reentrant: bool, n: int = 4) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.layers = nn.ModuleList([Layer() for _ in range(n)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):  # type: ignore[no-untyped-def]
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return self.head(x).sum()


@pytest.mark.parametrize(("reentrant", "said"), [
    (False, r"ran again in backward: the model checkpoints them itself"),
    (True, r"ran with gradients off .* reentrant torch\.utils\.checkpoint"),
])
def test_a_model_that_checkpoints_its_blocks_itself_is_told_so(reentrant: bool,
                                                                said: str) -> None:
    import autoremat

    model = SelfCheckpointed(reentrant)
    with pytest.warns(UserWarning) if reentrant else contextlib.nullcontext(), \
            pytest.raises(BlockError, match=said) as caught:
        autoremat.profile(model, torch.randn(4, 8), timing=False)
    assert "gradient_checkpointing_disable" in str(caught.value)


class ReturnsNothing(nn.Module):
    """A block that keeps its result on itself and returns None."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out: torch.Tensor | None = None

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.out = self.fc(x)


def test_blocks_that_return_nothing_are_told_so() -> None:
    import autoremat

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([ReturnsNothing() for _ in range(3)])

        def forward(self, x):  # type: ignore[no-untyped-def]
            for layer in self.layers:
                layer(x)
                x = layer.out
            return x.sum()

    with pytest.raises(BlockError, match=r"they return no tensor \(None"):
        autoremat.profile(Model(), torch.randn(4, 8), timing=False,
                          blocks=[f"layers.{i}" for i in range(3)])


class _PreNormAttention(nn.Module):
    """lucidrains' pre-norm attention, returning the update (the parent adds the residual)."""

    def __init__(self, width: int = 8, context: int | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(context or width, 2 * width)

    def forward(self, x, context=None):  # type: ignore[no-untyped-def]
        h = self.norm(x)  # (B, T, C)
        k, v = self.kv(h if context is None else context).chunk(2, dim=-1)  # (B, S, C)
        return torch.softmax(self.q(h) @ k.transpose(1, 2), dim=-1) @ v


def _feed_forward(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                         nn.Linear(4 * width, width))


class _Lucidrains(nn.Module):
    """vit-pytorch's transformer: each layer a ModuleList of its parts, which the forward
    unpacks and calls, adding the residuals itself. ``ff_first``: the list holds them in
    another order than they run; ``norms``: ``[norm, attn, norm, ff]``."""

    def __init__(self, depth: int = 3, width: int = 8, *, ff_first: bool = False,
                 norms: bool = False) -> None:
        super().__init__()
        self.ff_first, self.norms = ff_first, norms
        self.layers = nn.ModuleList(nn.ModuleList(self._parts(width)) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def _parts(self, width: int) -> list[nn.Module]:
        if self.ff_first:
            return [_feed_forward(width), _PreNormAttention(width)]
        if self.norms:
            return [nn.LayerNorm(width), _PreNormAttention(width), nn.LayerNorm(width),
                    _feed_forward(width)]
        return [_PreNormAttention(width), _feed_forward(width)]

    def forward(self, x):  # type: ignore[no-untyped-def]
        for layer in self.layers:
            if self.norms:
                norm1, attn, norm2, ff = layer
                x = attn(norm1(x)) + x
                x = ff(norm2(x)) + x
                continue
            ff, attn = layer if self.ff_first else reversed(layer)
            x = attn(x) + x
            x = ff(x) + x
        return self.head(x.mean(1)).square().mean()


class _Perceiver(nn.Module):
    """perceiver-pytorch: each layer a ModuleList of a cross-attention to the data, a
    feed-forward and a ModuleList of self-attention layers, each a ModuleList again."""

    def __init__(self, depth: int = 2, per_cross: int = 2, width: int = 8,
                 data_width: int = 4) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, width))
        self.layers = nn.ModuleList(nn.ModuleList([
            _PreNormAttention(width, context=data_width), _feed_forward(width),
            nn.ModuleList(nn.ModuleList([_PreNormAttention(width), _feed_forward(width)])
                          for _ in range(per_cross))]) for _ in range(depth))

    def forward(self, data):  # type: ignore[no-untyped-def]
        x = self.latents.expand(data.shape[0], -1, -1)  # (B, 4, C)
        for cross_attn, cross_ff, self_attns in self.layers:
            x = cross_attn(x, context=data) + x
            x = cross_ff(x) + x
            for attn, ff in self_attns:
                x = attn(x) + x
                x = ff(x) + x
        return x.square().mean()


def test_lists_the_model_iterates_over_give_the_modules_it_calls() -> None:
    """NOTE [ Lists the model iterates over ]: a ModuleList has no forward, so a layer
    kept as one (lucidrains' ``[attn, ff]``, ``[norm, attn, norm, ff]``, a Perceiver's
    lists in lists) is not a block: the chain is the modules inside that the model calls,
    however deep, and the notes say so. A Sequential of such parts stays a block."""
    assert discover_blocks(_Lucidrains()) == [f"layers.{i}.{j}" for i in range(3)
                                              for j in range(2)]
    assert discover_blocks(_Lucidrains(norms=True)) == [f"layers.{i}.{j}" for i in range(3)
                                                        for j in range(4)]
    assert discover_blocks(_Perceiver()) == [
        name for i in range(2) for name in (
            f"layers.{i}.0", f"layers.{i}.1",
            *(f"layers.{i}.2.{j}.{k}" for j in range(2) for k in range(2)))]
    notes = discovery_notes(_Lucidrains())
    assert len(notes) == 1 and notes[0].startswith(
        "blocks: the 6 modules the model calls inside the 3 elements of 'layers' (each a "
        "ModuleList of _PreNormAttention, Sequential), not the elements themselves")
    assert "the 12 modules the model calls" in discovery_notes(_Perceiver())[0]
    called = nn.ModuleList(nn.Sequential(_PreNormAttention(), _feed_forward()) for _ in range(3))
    assert discover_blocks(called) == ["0", "1", "2"]
    # a list holding nothing the model calls leaves the model as its own block
    assert discover_blocks(nn.ModuleList(nn.ModuleList() for _ in range(2))) == [""]


@pytest.mark.parametrize("model", [_Lucidrains(), _Lucidrains(ff_first=True),
                                   _Lucidrains(norms=True), _Perceiver()],
                         ids=["attn-ff", "listed-ff-first", "norm-attn-norm-ff", "perceiver"])
def test_lists_the_model_iterates_over_are_planned_over_what_it_calls(
        model: nn.Module) -> None:
    """profile plans over the modules the model calls inside its lists, in the order they
    run (profile refused the model: 'a container the model does not call'), as it does
    with them named; plans at the least budget and checkpointing every block are exact."""
    import autoremat
    from autoremat._plan.strategies import smallest_feasible_bytes

    torch.manual_seed(0)
    x = torch.randn(2, 6, 4 if isinstance(model, _Perceiver) else 8)
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    names = [b.name for b in tape.blocks]
    found = discover_blocks(model)
    if isinstance(model, _Lucidrains) and model.ff_first:  # listed ff, attn; run attn, ff
        found = [f"layers.{i}.{j}" for i in range(3) for j in (1, 0)]
    assert names == found
    assert any("modules the model calls inside" in n for n in tape.notes)
    named = autoremat.profile(model, x, blocks=found, repeats=1, timing=False,
                              with_selective=False)
    assert smallest_feasible_bytes(tape) == smallest_feasible_bytes(named)
    for plan in (autoremat.plan(tape, budget=smallest_feasible_bytes(tape)),
                 autoremat.plan(tape, strategy="full")):
        exact(model, x, plan, repeats=1)


def _unit(c_in: int, c_out: int, groups: int = 1, act: bool = True) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: a convolution, its norm and its activation."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out), *([nn.Hardswish()] if act else []))


class _SqueezeExcite(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(width, 4, 1), nn.Conv2d(4, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.fc2(self.fc1(x.mean((2, 3), keepdim=True)).relu()).sigmoid()


class _InvertedResidualV3(nn.Module):
    """torchvision's MobileNetV3 block: every convolution a unit of its own (the last
    without activation), a squeeze-excite between them, in one Sequential."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        wide = 3 * c_in
        self.block = nn.Sequential(_unit(c_in, wide), _unit(wide, wide, groups=wide),
                                   _SqueezeExcite(wide), _unit(wide, c_out, act=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y + x if y.shape == x.shape else y


class _MobileNetV3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_unit(3, 8), _InvertedResidualV3(8, 8),
                                      _InvertedResidualV3(8, 16), _InvertedResidualV3(16, 16),
                                      _unit(16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).pow(2).mean()


def test_conv_norm_activation_units_are_the_inside_of_a_block() -> None:
    """NOTE [ Which container is the chain ]: an inverted residual holding its
    convolutions as conv-norm-activation units (torchvision's MobileNetV3) is a block, as
    MobileNetV2's is, not a stage of units (the chain went into each ``.block``), and the
    plans over the inverted residuals are exact. A stage module whose list holds small
    MLPs (two weighted layers each) is still planned over them."""
    import autoremat
    from autoremat._plan.strategies import smallest_feasible_bytes

    torch.manual_seed(0)
    model, x = _MobileNetV3(), torch.randn(2, 3, 32, 32)
    assert discover_blocks(model) == [f"features.{i}" for i in range(5)]
    assert discovery_notes(model) == []
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == [f"features.{i}" for i in range(5)]
    for plan in (autoremat.plan(tape, budget=smallest_feasible_bytes(tape)),
                 autoremat.plan(tape, strategy="every:2")):
        exact(model, x, plan, repeats=1)

    class MLPs(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                    nn.Linear(2 * width, width))
                                      for _ in range(2))

    stages = nn.ModuleList([MLPs(8), MLPs(16)])
    assert discover_blocks(stages) == ["0.mlps.0", "0.mlps.1", "1.mlps.0", "1.mlps.1"]


def test_a_shared_module_named_at_its_second_place_is_refused_naming_the_first() -> None:
    # named_modules() names a module held twice once, at its first place; the second
    # was "no submodule named", though model.get_submodule finds it
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(8, 8)
            self.layers = nn.ModuleList([shared, nn.Linear(8, 8), shared])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.sum()

    with pytest.raises(BlockError, match=r"'layers\.2' in Tied is the module also at "
                                         r"'layers\.0'.*name it as 'layers\.0'"):
        autoremat.profile(Tied(), torch.randn(4, 8), blocks=["layers.1", "layers.2"])
    with pytest.raises(BlockError, match=r"no submodule named 'layers\.3'"):
        autoremat.profile(Tied(), torch.randn(4, 8), blocks=["layers.3"])


class _AddedInPlace(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).add_(x)  # a view of the Linear's output on a 3-D input


class _ScaledInPlace(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


class _Listed(nn.Module):
    def __init__(self, entries: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(entries)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _with_relus() -> list[nn.Module]:
    return [m for _ in range(3) for m in (_AddedInPlace(), nn.ReLU(inplace=True))]


@pytest.mark.parametrize("entries, given, chain", [
    (_with_relus, False, ["blocks.0", "blocks.2", "blocks.4"]),
    (_with_relus, True, ["blocks.0", "blocks.2", "blocks.4"]),
    (lambda: [_AddedInPlace(), _AddedInPlace(), _AddedInPlace(), _ScaledInPlace()], False,
     ["blocks.0", "blocks.1", "blocks.2"]),
], ids=["relu-found", "relu-given", "scaled-next"])
def test_a_block_output_view_written_in_place_after_it_stays_in_the_chain(
        entries: Any, given: bool, chain: list[str]) -> None:
    """NOTE [ An output view changed in place ] (_measure/measured.py): the hook marking
    a block's backward sat on its output view's node, which an in-place ReLU after the
    block (or a next block scaling its input in place) cuts out of the graph: profile
    refused the model ("backward runs through none of the blocks found", "no gradient
    reached"), or left the last block out as frozen."""
    torch.manual_seed(0)
    model, x = _Listed(entries()), torch.randn(2, 3, 8)
    tape = autoremat.profile(model, x, timing=False, blocks=chain if given else None)
    assert [b.name for b in tape.blocks] == chain
    exact(model, x, autoremat.plan(tape, strategy="every:2"))


class _Holes(nn.Module):
    """x-transformers' layout: a ModuleList per layer of (a ModuleList of norms with
    ``None`` in the places of the norms it leaves out, the layer, its residual), which
    the model iterates over and never calls."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.ModuleList([nn.LayerNorm(d), None, None]), ResidualMlp(d),
                           nn.Identity()]) for _ in range(n))
        self.unused = nn.ModuleList([None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for (norm, _, _), layer, residual in self.layers:
            x = residual(layer(norm(x)))
        return x


def test_lists_that_hold_none_in_places_are_searched_by_the_modules_they_hold() -> None:
    # a ModuleList of [norm, None, None] (and one of None only) counts its modules, not
    # its places: the search had taken it for a list of three and failed on it
    # (IndexError, a held-out x-transformers Decoder)
    torch.manual_seed(0)
    model, x = _Holes(), torch.randn(4, 8)
    tape = autoremat.profile(model, x, loss_fn=lambda y: y.pow(2).mean(), timing=False,
                             with_selective=False, with_head=False)
    names = [b.name for b in tape.blocks]
    assert "layers.0.1" in names and "layers.2.1" in names, names
    assert not any(name.endswith(("1.1.0", ".unused")) for name in names), names
    exact(model, x, autoremat.plan(tape, strategy="full"), repeats=1)
