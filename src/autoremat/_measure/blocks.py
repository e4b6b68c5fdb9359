"""Find the chain of blocks to plan over: the repeated layers of a model.

NOTE [ Which container is the chain ]
    We score every ``nn.ModuleList`` / ``nn.Sequential`` with at least two children, and
    every ``nn.ModuleDict`` keyed by position (torchtitan keeps its layers under
    ``'0'``, ``'1'``, ...; :func:`keyed_by_position`), by the parameters held in its
    children of the classes that come twice or more (repeated layers hold most of a
    model), tie-broken by the number of children. Every repeated class, not only the most
    common one: a list alternating attention and a mixture of experts (soft-moe-pytorch's
    ViT, 2026-12-02) scored by its attention layers alone lost to the list of experts
    inside each mixture, which run side by side, and the plan left attention out. A
    ModuleDict keyed by name (``'student'``, ``'teacher'``)
    holds parts, which need not run one after the other, and is not searched. Its
    children are the blocks, at the level a person writes them: the outermost repeated
    container's elements. One exception: an element that is itself a run of one kind of
    layer (every child of one class: a CNN's stage of residual blocks) is a stage, not a
    block, and is flattened one level, so the chain is the residual blocks, in order (so
    are stages of single layers that differ from each other: a toy CNN's stages of 2 and
    3 convolutions). An element that mixes kinds (``nn.Sequential(Linear, GELU, Linear,
    Tanh)``), or copies of one run of single layers, is a block: flattening it would
    plan over single layers, where checkpointing saves nothing (a layer's input is what
    it saves anyway) and its recompute adds to the peak (27% on six such blocks, every
    layer checkpointed). When the elements are containers, :func:`discovery_notes` says
    which level was taken and why. An element the model cannot call (a ModuleList) is
    never a block: NOTE [ Lists the model iterates over ]. A model with no such container
    is its own single block. Explicit names or a predicate override all of this.

    A stage may also be a module of its own that holds its layers in containers: a CNN's
    stage (Transformers' ResNet and ConvNeXt: ``stages.i.layers``), a hierarchical
    vision transformer's (Swin: ``layers.i.blocks``), a diffusion U-Net's down and up
    blocks (diffusers: ``down_blocks.i.resnets``, ``.attentions``, ``.downsamplers``).
    Planned over as elements, such stages are a few large blocks, and the smallest plan
    stays far from the least a plan over their layers reaches (the smallest feasible
    budget against the plain peak, elements / layers: ResNet 0.83 / 0.76, ConvNeXt
    0.82 / 0.66, Swin 0.74 / 0.49, a diffusers U-Net 0.45 / 0.25, where diffusers' own
    gradient checkpointing, per resnet and attention, reaches 0.27). So where the
    elements differ from each other (in class or parameters, as stages of a growing
    width do) an element that is not a container is a stage when the layers of its
    containers of composite layers (those with children; a list mixing in single layers,
    as a MobileNet's inverted residual holds its convolutions, is the block's own inside)
    hold at least half its parameters and one kind of them comes at least twice, or they
    are in two containers or more (a residual block and an attention, each in its list:
    :func:`_stage_layers`): the chain takes those layers, in the order they run. A plain
    Sequential of single layers, one of them weighted (a convolution with its norm and
    activation: torchvision's Conv2dNormActivation) is a single layer here
    (:func:`_unit`), so torchvision's MobileNetV3, which wraps every convolution of its
    inverted residual so, is planned over its inverted residuals as MobileNetV2 is (until
    2026-11-29, seventeenth session, over the units). A segment may span inverted
    residuals, not the units of two: smallest feasible budget against the plain peak,
    inverted residuals / units, Large 0.46 / 0.48 and Small 0.40 / 0.45 at 224 pixels
    (0.375 / 0.43 for a small one at 96). Not everywhere: a stack without strides whose
    last inverted residual is the widest plans lower over units. Identical elements (a
    transformer's layers) stay blocks, and so does an element whose containers hold parts
    of one each (T5's ``layer``: self-attention, cross-attention, feed-forward). A list of
    two elements or more, each of its own class, some of them stages (a small U-Net's
    cross-attention down block, then a plain one), is a repeated container too: the
    layers inside repeat. Until 2026-11-29 (sixteenth session) such stages were blocks.

NOTE [ A list of distinct layers ]
    A hand-written model often runs a list of layers none of which repeats: a CNN's
    ``nn.ModuleList([ConvBlock, Pool, ResidualBlock, AttentionBlock])``, a
    ``nn.Sequential(Stem(), Stage1(), Stage2())`` of classes of their own. No container
    scores as repeated, and profile refused the model ("found no chain": 1,381 of 5,038
    fuzzed models, 2026-11-30). Where no container repeats a layer, the chain is the
    list (a ModuleList, a Sequential, a ModuleDict keyed by position) holding the most
    parameters among those holding two composite layers or more (with children and
    parameters: blocks, not a run of single layers, NOTE [ Which container is the
    chain ]), all its elements in order, parameter-free ones (a pool) among them. A
    list of single layers (``nn.Sequential(Conv2d, BatchNorm2d, ReLU)``) is still no
    chain.

NOTE [ Lists the model iterates over ]
    A block is a module the model calls, since a checkpoint wraps its call. A ModuleList
    or a ModuleDict has no forward: the model iterates over it and calls what it holds.
    lucidrains' transformers (vit-pytorch, perceiver-pytorch) keep each layer so,
    ``nn.ModuleList([attn, ff])``, and run ``for attn, ff in self.layers: x = attn(x) + x;
    x = ff(x) + x``, the residual in the parent. So wherever the rules above take such a
    list (one without a forward of its own), the chain takes instead the outermost modules
    inside it that are not such lists, in definition order, however deep (a Perceiver's
    ``[cross_attn, cross_ff, ModuleList of [self_attn, self_ff]]``); ``profile`` then puts
    them in the order they run. The parts of such a list need not be of one kind
    (``[attn, ff]``, ``[norm, attn, norm, ff]``) and nothing coarser can be checkpointed;
    where the parent adds the residual between them, no segment of several blocks spans
    two of them (the next one's input is not the last one's output), so the plan
    checkpoints them one by one. Until 2026-11-29 (seventeenth session) such a list was a
    block, and ``profile`` refused it as a container the model does not call.

NOTE [ Stacks beside the chain ]
    An encoder-decoder (T5, BART, ``nn.Transformer``) or a two-tower model (CLIP) has
    two such containers side by side, and a step runs both. Planning over one of them
    leaves the other's activations, often a third of the step, out of reach. So every
    other container that is neither inside nor around the best one and whose repeated
    children hold at least :data:`STACK_SHARE` of the parameters the best one's hold
    joins the chain: a stack, not a stray (a six-``Linear`` head beside a transformer
    holds far less). So does every other container of the chain's kind of block (a
    composite layer: one with children, not a single ``Linear``), whatever it holds: a
    CNN's stages are containers side by side whose parameters grow with their width while
    their activations shrink (torchvision's ResNet-50: ``layer1`` to ``layer4``, the first
    two under a quarter of ``layer4``'s parameters and holding most of the step's
    activations; planned over ``layer3`` and ``layer4`` alone, its smallest feasible budget
    was 0.89 of its peak, over all 16 bottlenecks 0.46; until 2026-11-29, sixteenth
    session). So does a list of one block of the chain's kind (a diffusers U-Net's
    mid-block attention, a decoder of one layer beside a deeper encoder). Stacks come in
    definition order here; ``profile`` puts the blocks
    of a discovered chain in the order they run (a CLIP runs its vision tower first).
    Smaller repeated containers stay out, and ``other_repeated_blocks`` names them.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from torch import nn

from autoremat._core.errors import BlockError, did_you_mean

__all__ = ["STACK_SHARE", "BlockSpec", "attribute_layers", "discover_blocks", "discovery_notes",
           "keyed_by_position", "other_repeated_blocks", "resolve_blocks"]

BlockSpec = None | Sequence[str] | Callable[[str, nn.Module], bool]

_CONTAINERS = (nn.ModuleList, nn.Sequential)

# The share of the chain's repeated parameters another container must hold to join it as
# a stack (NOTE [ Stacks beside the chain ]). T5's and BART's encoder hold about three
# quarters of their decoder's (no cross-attention); a quarter leaves room for shallower
# stacks while keeping out small repeated heads.
STACK_SHARE = 0.25


def param_signature(module: nn.Module) -> str:
    """A short fingerprint of ``module``'s parameters: names, shapes and dtypes, in
    order (what a plan's memory figures depend on; values and devices are not in it).

    Example:
        >>> param_signature(nn.Linear(4, 2)) == param_signature(nn.Linear(4, 2))
        True
        >>> param_signature(nn.Linear(4, 2)) == param_signature(nn.Linear(8, 2))
        False
    """
    text = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}"
                    for name, p in module.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeated_score(container: nn.Module) -> tuple[int, int]:
    children = list(container.children())
    kinds = Counter(type(c) for c in children)
    count = max(kinds.values(), default=0)
    if count < 2 and len(children) >= 2 and any(_stage_layers(c) for c in children):
        # stages of one kind each (a U-Net's cross-attention down block, then a plain
        # one): the layers they hold repeat (NOTE [ Which container is the chain ])
        return (sum(_param_count(c) for c in children), len(children))
    if count < 2:
        return (-1, 0)
    # every kind that repeats, not only the most common: layers that alternate (attention
    # and a mixture of experts, a Mamba layer and an attention) repeat as much as one kind
    covered = sum(_param_count(c) for c in children if kinds[type(c)] >= 2)
    return (covered, len(children))


def keyed_by_position(module: nn.ModuleDict) -> bool:
    """Whether a ModuleDict's keys differ only in their numbers (``'0'``, ``'1'``, ...,
    as torchtitan keeps its layers; ``'layer0'``, ``'layer1'``, ...): a list of layers
    under other keys, searched as a chain. Keys that name parts (``'student'``,
    ``'teacher'``; ``'encoder'``, ``'decoder'``) are not.

    Example:
        >>> keyed_by_position(nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(3)}))
        True
        >>> keyed_by_position(nn.ModuleDict({"student": nn.Linear(2, 2),
        ...                                  "teacher": nn.Linear(2, 2)}))
        False
    """
    return len({re.sub(r"\d+", "", key) for key in module._modules}) == 1 \
        and all(re.search(r"\d", key) for key in module._modules)


def _is_repeated_container(module: nn.Module) -> bool:
    # children(), not _modules: a ModuleList may hold None in places (x-transformers keeps
    # [norm, None, None] per layer), which children() skips
    return _listed(module) and sum(1 for _ in module.children()) >= 2 \
        and _repeated_score(module)[0] >= 0


def _is_run(module: nn.Module) -> bool:
    """A repeated container that is a run of one kind of layer (every child of one class)."""
    return _is_repeated_container(module) and len({type(c) for c in module.children()}) == 1


def _stages(container: nn.Module) -> list[nn.Module]:
    """The children of ``container`` that are stages, flattened into the chain (NOTE [ Which
    container is the chain ]): runs of one kind of layer, when those layers are blocks of
    their own (residual blocks) or the runs differ (a CNN's stages); identical runs of
    single layers are blocks."""
    runs = [c for c in container.children() if _is_run(c)]
    composite = any(next(layer.children(), None) is not None
                    for run in runs for layer in run.children())
    differ = len({param_signature(run) for run in runs}) > 1
    return runs if composite or differ else []


def _listed(module: nn.Module) -> bool:
    return isinstance(module, _CONTAINERS) or (
        isinstance(module, nn.ModuleDict) and keyed_by_position(module))


def _shared_first(model: nn.Module, name: str) -> str | None:
    """Where ``model.named_modules()`` names the module at ``name``, when that is another
    name: the module is held at both (tied layers)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return next((n for n, m in model.named_modules() if m is module and n != name), None)


def _composite(module: nn.Module) -> bool:
    """Whether ``module`` has children: a block of layers, not a single layer."""
    return next(module.children(), None) is not None


def _unit(module: nn.Module) -> bool:
    """Whether ``module`` is one layer with its norm and activation: a plain Sequential of
    single layers, one of them weighted (a convolution or a linear layer; a norm's weight
    is a vector), as torchvision's Conv2dNormActivation is."""
    return isinstance(module, nn.Sequential) \
        and type(module).forward is nn.Sequential.forward \
        and not any(_composite(c) for c in module.children()) \
        and sum(any(p.dim() >= 2 for p in c.parameters()) for c in module.children()) == 1


def _stage_layers(element: nn.Module) -> list[str]:
    """The names, under ``element``, of its layers when it is a stage module (NOTE [ Which
    container is the chain ]): the children of its child containers that hold composite
    layers only (a conv-norm-activation unit is a single layer: :func:`_unit`), where they
    hold at least half its parameters and one kind of them comes at least twice or they
    come from two containers or more; else none."""
    if _listed(element) or isinstance(element, nn.ModuleDict):
        return []
    layers = [(f"{name}.{n}", layer) for name, child in element.named_children()
              if _listed(child)
              and all(_composite(c) and not _unit(c) for c in child.children())
              for n, layer in child.named_children()]
    if not layers or (Counter(type(layer) for _, layer in layers).most_common(1)[0][1] < 2
                      and len({name.split(".")[0] for name, _ in layers}) < 2):
        return []
    held = sum(_param_count(layer) for _, layer in layers)
    return [name for name, _ in layers] if 2 * held >= _param_count(element) else []


def _repeated_containers(model: nn.Module) -> Iterator[tuple[str, tuple[int, int]]]:
    """``(name, score)`` of every ModuleList/Sequential holding repeated children."""
    for name, module in model.named_modules():
        if _is_repeated_container(module):
            yield name, _repeated_score(module)


def _nested(a: str, b: str) -> bool:
    """Whether containers ``a`` and ``b`` are one inside the other (or the same)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def _block_kinds(container: nn.Module) -> set[type[nn.Module]]:
    """The classes of the composite layers (with children of their own: blocks, not single
    layers) the chain takes from ``container``."""
    return {type(layer) for name, layers in _elements(container) for layer in (
        container.get_submodule(f"{name}{under}") for under in layers)
        if _composite(layer)}


def _stacks(model: nn.Module) -> list[str]:
    """The containers the chain is made of, in definition order: the best one and the
    stacks beside it (NOTE [ Stacks beside the chain ])."""
    found = list(_repeated_containers(model))
    best: tuple[tuple[int, int], int, str] | None = None
    for name, score in found:
        depth = name.count(".") if name else -1
        key = (score, -depth, name)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return []
    root, covered = best[2], best[0][0]
    chosen = [root]
    kinds = _block_kinds(model.get_submodule(root))
    for name, score in found:  # named_modules order: definition order
        if any(_nested(name, c) for c in chosen):
            continue
        if (covered > 0 and score[0] >= STACK_SHARE * covered) \
                or kinds & _block_kinds(model.get_submodule(name)):
            chosen.append(name)
    order: dict[str, int] = {}  # definition order
    for name, m in model.named_modules():
        order[name] = len(order)
        # a list of one block of the chain's kind (a U-Net's mid-block attention; a
        # stack of one layer beside a deeper one) joins it too
        if name and _listed(m) and sum(1 for _ in m.children()) == 1 \
                and type(next(iter(m.children()))) in kinds \
                and not any(_nested(name, c) for c in chosen):
            chosen.append(name)
    return sorted(chosen, key=order.__getitem__)


def discover_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's chain of repeated blocks, in definition order; an
    encoder-decoder's stacks one after the other (NOTE [ Stacks beside the chain ]).

    Example:
        >>> import torch.nn as nn
        >>> discover_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
        ['0', '1', '2']
        >>> t = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2,
        ...                    num_decoder_layers=2, dim_feedforward=16, batch_first=True)
        >>> discover_blocks(t)
        ['encoder.layers.0', 'encoder.layers.1', 'decoder.layers.0', 'decoder.layers.1']
    """
    names: list[str] = []
    for root in _stacks(model):
        prefix = f"{root}." if root else ""
        for child_name, layers in _elements(model.get_submodule(root)):
            names.extend(f"{prefix}{child_name}{layer}" for layer in layers)
    # none found, or lists holding nothing the model calls (a list of ParameterLists):
    # a list of distinct layers, else the whole model is one block
    return names or _distinct_layers(model) or [""]


def attribute_layers(model: nn.Module) -> list[str]:
    """Where no list holds a chain, the modules held as attributes by the module holding
    the most parameters among those with two composite layers or more that hold
    parameters, in definition order (NOTE [ Layers held as attributes ]); else none.

    NOTE [ Layers held as attributes ]
        Some models hold their stages as attributes, not in a list: timm's RegNet
        (``s1`` .. ``s4``, each holding its blocks ``b1``, ``b2``, ... by
        ``add_module``), its Inception v3 (``Mixed_5b`` .. ``Mixed_7c``) and DLA
        (``level0`` .. ``level5``). Discovery found no chain there and ``profile``
        refused them (a held-out check, 2026-12-02). The chain is then the children of
        the module holding the most parameters among those holding two composite layers
        with parameters or more (the model, as a rule), as NOTE [ A list of distinct
        layers ] takes a list's: a stem, the stages, a pool, a head, each a block, in the
        order they run. A stage is not flattened into its layers: that its children are
        of one class does not say that they run one after another (an Inception block's
        branches all take its input). The model's own calls come first: a module held at
        several attributes, or a single layer run several times, is planned call by call
        (``_looped_layers`` in ``profile.py``), as before.
    """
    return _distinct_layers(model, listed=False)


def _distinct_layers(model: nn.Module, listed: bool = True) -> list[str]:
    """Where no container repeats a layer, the layers of the list holding the most
    parameters among those with two composite layers or more that hold parameters (NOTE
    [ A list of distinct layers ]); else none. ``listed=False``: of any module
    (:func:`attribute_layers`)."""
    best: tuple[tuple[int, int], str] | None = None
    for name, module in model.named_modules():
        if _listed(module) != listed or (not listed and isinstance(module, nn.ModuleDict)):
            continue
        weighted = [c for c in module.children() if _composite(c) and _param_count(c)]
        key = (_param_count(module), -name.count(".") if name else 1)
        if len(weighted) >= 2 and (best is None or key > best[0]):
            best = (key, name)
    if best is None:
        return []
    prefix = f"{best[1]}." if best[1] else ""
    return [called for child_name, child in model.get_submodule(best[1]).named_children()
            for called in _called_under(child, f"{prefix}{child_name}")]


def _elements(container: nn.Module) -> Iterator[tuple[str, list[str]]]:
    """Each element of the chain's ``container`` by name, with the names under it the
    chain takes (``[""]``: the element itself), NOTE [ Which container is the chain ];
    a container the model does not call stands for the modules inside it that it does
    (NOTE [ Lists the model iterates over ])."""
    stages = _stages(container)
    children = list(container.named_children())
    differ = len({(type(c), param_signature(c)) for _, c in children}) > 1
    for name, child in children:
        if any(child is stage for stage in stages):
            layers = [f".{n}" for n, _ in child.named_children()]
        elif differ and (found := _stage_layers(child)):
            layers = [f".{n}" for n in found]
        else:
            layers = [""]
        yield name, [called for layer in layers for called in _called_under(
            child.get_submodule(layer[1:]) if layer else child, layer)]  # (a ScriptModule
        # has no get_submodule)


def _called(module: nn.Module) -> bool:
    """Whether a model can call ``module``: it is not a ModuleList or ModuleDict without
    a forward of its own, which the model iterates over (``for attn, ff in self.layers``),
    calling what it holds (NOTE [ Lists the model iterates over ])."""
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict)) \
        or type(module).forward is not nn.Module.forward or "forward" in vars(module)


def _called_under(module: nn.Module, name: str) -> list[str]:
    """``[name]`` where ``module`` is called; else the names (``name`` and below) of the
    outermost modules inside it that are, in definition order (NOTE [ Lists the model
    iterates over ])."""
    if _called(module):
        return [name]
    return [called for child_name, child in module.named_children()
            for called in _called_under(child, f"{name}.{child_name}")]


def _kinds(module: nn.Module) -> str:
    return ", ".join(type(c).__name__ for c in module.children())


def discovery_notes(model: nn.Module) -> list[str]:
    """Why :func:`discover_blocks` planned at the level it did, when the repeated
    container it found holds containers (a choice between their elements and the layers
    inside them); empty otherwise (NOTE [ Which container is the chain ]).

    Example:
        >>> import torch.nn as nn
        >>> m = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        ...                   for _ in range(3))
        >>> discover_blocks(m)
        ['0', '1', '2']
        >>> print(discovery_notes(m)[0])  # doctest: +ELLIPSIS
        blocks: the 3 elements of the model (each a Sequential of Linear, GELU, Linear), ...
    """
    notes = []
    for root in _stacks(model):
        container = model.get_submodule(root)
        where = repr(root) if root else "the model"
        children = list(container.children())
        stages = _stages(container)
        blocks = [c for c in children if _is_repeated_container(c) and _called(c)
                  and not any(c is s for s in stages)]
        if blocks:
            notes.append(
                f"blocks: the {len(children)} elements of {where} (each a "
                f"{type(blocks[0]).__name__} of {_kinds(blocks[0])}), not the layers inside "
                f"them: a layer checkpointed alone saves nothing (its input is what it "
                f"saves anyway) and its recompute adds to the peak. Pass blocks=[...] to "
                f"plan at another level")
        if stages:
            layers = sum(len(layers) for name, layers in _elements(container)
                         if any(container.get_submodule(name) is s for s in stages))
            kind = type(next(iter(stages[0].children()))).__name__
            notes.append(
                f"blocks: the {layers} layers of the {len(stages)} stages in {where} (each "
                f"stage a run of {kind}), not the stages themselves. Pass blocks=[...] to "
                f"plan at another level")
        lists = [(name, layers) for name, layers in _elements(container)
                 if not _called(module := container.get_submodule(name))
                 and not any(module is stage for stage in stages)]
        if lists:
            first = container.get_submodule(lists[0][0])
            notes.append(
                f"blocks: the {sum(len(layers) for _, layers in lists)} modules the model "
                f"calls inside the {len(lists)} elements of {where} (each a "
                f"{type(first).__name__} of {_kinds(first)}), not the elements themselves: "
                f"the model iterates over them and does not call them, so a checkpoint "
                f"cannot hold one. Pass blocks=[...] to plan at another level")
        modules = [(name, layers) for name, layers in _elements(container)
                   if layers != [""] and _called(container.get_submodule(name)) and not any(
                       container.get_submodule(name) is stage for stage in stages)]
        if modules:
            kinds = sorted({layer.split(".")[1] for _, layers in modules for layer in layers})
            notes.append(
                f"blocks: the {sum(len(layers) for _, layers in modules)} layers of "
                f"{len(modules)} stage(s) in {where} (modules that differ from each other, "
                f"holding their layers in {', '.join(repr(k) for k in kinds)}), not the "
                f"stages themselves: a plan over a few large stages stays far above the "
                f"least one over their layers reaches. Pass blocks=[...] to plan at another "
                f"level")
    return notes


def other_repeated_blocks(model: nn.Module, chosen: Sequence[str]) -> list[str]:
    """Containers of repeated blocks that ``chosen`` leaves out (a small repeated head
    beside the layers, or a stack the caller's ``blocks=[...]`` did not list), so that
    callers can say so.

    Example:
        >>> import torch.nn as nn
        >>> class WithHeads(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        ...         self.heads = nn.ModuleList(nn.Linear(16, 1) for _ in range(2))
        >>> m = WithHeads()
        >>> discover_blocks(m), other_repeated_blocks(m, discover_blocks(m))
        (['layers.0', 'layers.1', 'layers.2'], ['heads'])
        >>> other_repeated_blocks(m, ['layers.0'])
        ['heads']
    """
    taken = [n for n in chosen if n]
    out: list[str] = []
    for name, score in _repeated_containers(model):
        if not name or score[0] == 0:  # the model itself; or parameter-free repeats
            continue
        inside = any(t == name or t.startswith(name + ".") for t in taken)
        outside = any(name.startswith(t + ".") for t in [*taken, *out])
        if not (inside or outside):
            out.append(name)
    return out


def resolve_blocks(model: nn.Module, blocks: BlockSpec) -> list[str]:
    """Turn the ``blocks`` argument of :func:`autoremat.profile` into module names.

    Raises:
        BlockError: a name that is not a submodule (with a close match when there is
            one), nested names, or a predicate that matches nothing.
    """
    modules = dict(model.named_modules())
    if blocks is None:
        names = discover_blocks(model)
    elif callable(blocks):
        names = []
        for name, module in model.named_modules():
            if any(outer == "" or name.startswith(f"{outer}.") for outer in names):
                continue  # inside a block already chosen: keep the outermost
            if blocks(name, module):
                names.append(name)
        if not names:
            raise BlockError("the blocks predicate matched no module; check it against "
                             "[name for name, _ in model.named_modules()]")
    elif isinstance(blocks, str):
        raise BlockError(f"blocks must be a list of module names, not the string {blocks!r}; "
                         f"write blocks=[{blocks!r}]")
    elif not isinstance(blocks, (list, tuple)) or not all(isinstance(n, str) for n in blocks):
        raise BlockError(f"blocks must be None (find the chain), a list of module names or a "
                         f"predicate (name, module) -> bool, got {type(blocks).__name__} "
                         f"{blocks!r}")
    else:
        names = list(blocks)
        for name in names:
            if name not in modules:
                first = _shared_first(model, name)
                if first is not None:
                    raise BlockError(
                        f"{name!r} in {type(model).__name__} is the module also at "
                        f"{first!r} (one module, held twice): name it as {first!r}, whose "
                        f"calls in the step are planned one by one (its call at {name!r} "
                        f"among them)")
                raise BlockError(f"no submodule named {name!r} in {type(model).__name__}."
                                 + did_you_mean(name, [n for n in modules if n]))
        if len(set(names)) != len(names):
            raise BlockError(f"blocks lists a module twice: {names}")
        for a in names:
            for b in names:
                if a != b and (a == "" or b.startswith(f"{a}.")):
                    raise BlockError(f"block {b!r} is inside block {a!r}; give blocks that "
                                     f"do not nest")
    if not names:
        raise BlockError("no blocks to plan over; pass blocks=[...] with module names")
    return names
