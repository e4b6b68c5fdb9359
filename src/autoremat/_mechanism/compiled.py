"""What a plan's decisions become when the model runs under ``torch.compile``.

NOTE [ Plans under torch.compile ]
    Dynamo traces non-reentrant ``torch.utils.checkpoint`` into a higher-order op, and
    AOT Autograd's partitioner then decides, op by op, what the compiled forward saves
    and what the compiled backward recomputes; a ``context_fn`` made by
    ``create_selective_checkpoint_contexts`` tags ops MUST_SAVE or PREFER_RECOMPUTE for
    it. Our eager machinery cannot be traced: the selective dispatch modes
    (``selective.py``) run Python per op, the RNG replay reads generator states
    (``rng.py``) and a multi-block segment opens checkpoint's frame from hooks
    (``segments.py``). So a wrapped block looks at ``torch.compiler.is_compiling()``
    when it is called, and under compile runs a plain non-reentrant checkpoint:

    * ``recompute``: no ``context_fn`` (PyTorch's own policy: recompute what it can);
    * a save-set by op kind: a policy saving the outputs of those kinds;
    * a keep-set (op positions in the eager tape): a policy saving the k-th call of
      each kept op, keyed by (op name, occurrence) (``keep_keys`` in ``_core/saves.py``). The traced
      graph can name ops differently from eager dispatch (``native_dropout`` for
      ``bernoulli_`` and ``div_``, ``_safe_softmax``...): an op the key names but
      the trace does not have is simply not saved. Dead ops need no stand-in: the
      partitioner recomputes only what backward reads.

    Random ops are left to compile, as in PyTorch's plain checkpoint: Inductor seeds
    them so that the recompute draws the forward's numbers, and with
    ``fallback_random`` on (or the ``aot_eager`` backend) the partitioner saves them.
    What each lowering saves and costs differs from eager, so a plan for a compiled
    step is made from a tape measured compiled (``profile(..., compile=True)``).
    Multi-block segments have no lowering (there is no single function to trace) and
    are refused under compile.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoremat._core.errors import RematError
from autoremat._core.saves import KeepKey
from autoremat._core.step import OWN_STEP
from autoremat._measure.ops import IGNORED_OPS, op_kind

__all__ = [
    "LEAST_COMPILE_BUDGET",
    "budgeted_inductor",
    "compile_budget",
    "compile_budget_hook",
    "compiled_context",
    "compiled_forwards",
    "compiled_parts",
    "forget_compiled",
    "is_compiling",
    "refuse_under_compile",
    "uncompiled",
]


def is_compiling() -> bool:
    """Whether Dynamo is tracing the caller (``torch.compiler.is_compiling``)."""
    return bool(torch.compiler.is_compiling())


def _contexts(save: frozenset[str], keep: frozenset[KeepKey]) -> Any:
    """Fresh SAC contexts for one checkpointed call (the occurrence counts are per call)."""
    calls: Counter[tuple[bool, str]] = Counter()  # forward and recompute count apart

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in IGNORED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = str(op)
        occurrence = calls[ctx.is_recompute, name]
        calls[ctx.is_recompute, name] += 1
        if op_kind(name) in save or (name, occurrence) in keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def compiled_context(save_ops: Iterable[str] = (),
                     keep: Iterable[KeepKey] = ()) -> functools.partial[Any] | None:
    """The ``context_fn`` a selective block uses under compile; ``None`` when it saves
    nothing (a plain recompute). A ``functools.partial`` of constants, as Dynamo needs.

    Example:
        >>> compiled_context() is None
        True
        >>> callable(compiled_context(["matmul"]))
        True
    """
    save, kept = frozenset(save_ops), frozenset(keep)
    if not save and not kept:
        return None
    return functools.partial(_contexts, save, kept)


@torch.compiler.disable
def refuse_under_compile(what: str, why: str = "a multi-block segment opens checkpoint's "
                         "frame from module hooks") -> None:
    """Raise a :class:`RematError` from code Dynamo is tracing. The function is excluded
    from tracing, so Dynamo breaks the graph before it and the error reaches the caller
    as it would in eager (a ``raise`` traced by Dynamo could fall back to eager code
    where the check no longer sees compile)."""
    raise RematError(f"{what} cannot run under torch.compile: {why}, which Dynamo cannot "
                     "trace. Re-plan for the compiled step from a tape measured compiled "
                     "(autoremat.plan(autoremat.profile(model, inputs, compile=True), "
                     "budget)), which checkpoints blocks one by one and offloads nothing, or "
                     "run this plan eagerly")


def forget_compiled(model: nn.Module) -> None:
    """Drop Dynamo's compiled code for the forwards of ``model``'s modules (their classes',
    and any a module holds of its own) and for ``nn.Module``'s call.

    autoremat compiles a model several times while it measures (each plan changes what
    Dynamo guards on); each compile adds an entry for the same code objects, and past
    Dynamo's recompile limit (8 by default) a later compile, the user's own, silently
    runs those frames eagerly: a zoo gpt2 then measured 6.06 MB where its plan had
    measured 5.79 MB compiled. Dropping the entries after each measurement leaves the
    user's compile a fresh start. Other models of the same classes compile again on
    their next call."""
    codes = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
    for module in model.modules():
        for forward in (type(module).forward, module.__dict__.get("forward")):
            code = getattr(forward, "__code__", None)
            if code is not None:
                codes.add(code)
    for code in codes:
        torch._C._dynamo.eval_frame.reset_code(code)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (``model`` itself if not compiled)."""
    inner = model
    while isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):
        inner = inner._orig_mod
    return inner


def compiled_parts(model: nn.Module, given: nn.Module | None = None) -> list[str]:
    """Names of what runs compiled: the model (``torch.compile(model)``) or modules
    compiled in place (``module.compile()``, regional compilation)."""
    found = ["the model"] if given is not None and given is not model else []
    found += [repr(name or type(model).__name__) for name, m in model.named_modules()
              if getattr(m, "_compiled_call_impl", None) is not None]
    return found


@contextmanager
def compiled_forwards(model: nn.Module, names: Sequence[str], backend: str) -> Iterator[None]:
    """Compile the named submodules' forwards (regional compilation) for a region, over
    whatever forward they have now (a checkpoint wrapper included); module hooks stay
    outside the compiled code, so marks at block boundaries still run between blocks."""
    modules = [model.get_submodule(n) for n in names]
    before = [m.__dict__.get("forward") for m in modules]
    try:
        for module in modules:
            module.forward = torch.compile(module.forward, backend=backend)  # type: ignore[method-assign]
        yield
    finally:
        for module, forward in zip(modules, before, strict=True):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward  # type: ignore[method-assign]


# NOTE [ Compile's own memory budget, exact ]
#     torch.compile's partitioner takes a byte budget of its own
#     (torch._functorch.config.activation_memory_budget, a fraction of the activations it
#     would save): below 1 it recomputes what a knapsack over the whole graph picks,
#     fused into the backward, the fastest way to some budgets. It also recomputes random
#     ops there, which draw new numbers in backward (pytorch#190758): with dropout on, the
#     gradients are wrong (0.54 of the largest gradient on zoo gpt2). A joint-graph pass
#     run before the partitioner (Inductor's joint_custom_pre_pass) tags every random op
#     MUST_SAVE, as a selective-checkpoint policy would, so the partitioner saves its
#     draws and recomputes only the rest: the gradients are then the compiled plain
#     step's (zoo gpt2, budget 0.5: max |diff| 9.6e-8, the compiled plain step's own
#     rounding) at the same peak. Both settings hold only while a graph is compiled, so
#     autoremat.compile_model patches them around each call of the compiled model (a
#     recompile included); a plan that rests on them refuses to run without them
#     (compile_budget_hook). A budget of 0 is never used: there the partitioner saves
#     the graph's inputs alone, without looking at the tags, and dropout was drawn again
#     in backward (a held-out pre-norm transformer: gradients 14% of the largest off
#     under Inductor); ``LEAST_COMPILE_BUDGET`` stands for it.
LEAST_COMPILE_BUDGET = 0.01  # the smallest of compile's budgets a plan rests on (NOTE above)
_RANDOM_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in (
        "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn",
        "randn_like", "randint", "randint_like", "randperm", "multinomial", "normal",
        "normal_", "uniform", "uniform_", "exponential_", "geometric_", "cauchy_",
        "log_normal_", "poisson")
    if hasattr(torch.ops.aten, name))


def _save_random_draws(graph: torch.fx.Graph) -> None:
    """Tag every random op of a joint graph MUST_SAVE (NOTE [ Compile's own memory
    budget, exact ])."""
    for node in graph.nodes:
        if node.op == "call_function" and \
                getattr(node.target, "overloadpacket", None) in _RANDOM_OPS:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


@functools.cache
def _random_draws_pass() -> Any:
    """The pass as Inductor's cache wants it: a ``CustomGraphPass`` with a ``uuid`` (one,
    made on first use)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class SaveRandomDraws(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            _save_random_draws(graph)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

    return SaveRandomDraws()


@contextmanager
def compile_budget(fraction: float) -> Iterator[None]:
    """Compile's ``activation_memory_budget`` at ``fraction``, with random draws saved
    (NOTE [ Compile's own memory budget, exact ]), for graphs compiled inside."""
    with functorch_config.patch(activation_memory_budget=fraction), \
            inductor_config.patch(joint_custom_pre_pass=_random_draws_pass()):
        yield


@functools.cache
def budgeted_inductor(fraction: float) -> Any:
    """A Dynamo backend: Inductor under :func:`compile_budget` at ``fraction``, one object
    per fraction. Dynamo reuses compiled code only for the backend that compiled it, and
    nothing else it guards on tells a graph compiled under one budget from another (the
    settings are read while compiling; hooks on a module are not guarded), so a model
    compiled again under another budget would otherwise run the old graph."""

    def backend(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        with compile_budget(fraction):
            return compile_fx(graph, example_inputs)

    backend.__name__ = f"inductor_budget_{fraction:g}"
    return backend


@torch.compiler.disable
def _refuse_without_budget(fraction: float, compiling: bool) -> None:
    how = ("compiled without it (torch.compile)" if compiling else "run eagerly")
    raise RematError(
        f"this plan keeps every block and rests on torch.compile's own memory budget "
        f"(activation_memory_budget={fraction:g}, random draws saved), but the model was "
        f"{how}, which would be over the plan's budget; compile it with "
        f"autoremat.compile_model(model), or plan again without compile's budget")


def compile_budget_hook(fraction: float) -> Any:
    """A forward pre-hook for the model of a plan that rests on compile's budget: it
    refuses an eager call, and a compile that does not set ``fraction`` (the check runs
    while Dynamo traces, when the setting is read)."""

    def hook(module: nn.Module, args: Any) -> None:
        if not is_compiling():
            # an evaluation has no backward and no budget at stake, and autoremat's own
            # steps (verify's eager ones) run this plan as what it is eagerly, every block
            # kept: its budget is judged compiled
            if torch.is_grad_enabled() and not OWN_STEP.get():
                _refuse_without_budget(fraction, compiling=False)
        elif functorch_config.activation_memory_budget != fraction:
            _refuse_without_budget(fraction, compiling=True)

    return hook
