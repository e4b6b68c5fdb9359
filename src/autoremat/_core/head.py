"""The loss head over token chunks: output projection and cross-entropy without the full
logits, and :class:`LMHead`, the building block a model of one's own uses for it.

NOTE [ A chunked head ]
    A language model's head turns the last hidden states ``h`` (N tokens x C) into logits
    (N x V, the vocabulary) and takes their cross-entropy. With a real vocabulary the
    logits, the log-softmax the loss saves, and the loss's two backward temporaries are
    the largest tensors of the step (GPT-2 small at batch 8 x 1024: 5.4 GiB of a 9.6 GiB
    step in bf16). Computed over chunks of rows, only one chunk's logits live at a time.
    Each chunk's gradients are taken at once, in the forward (the loss is the last thing
    the step computes, so nothing can change them before backward): the gradient of its
    hidden rows goes into one (N x C) buffer and the projection's weight gradient is
    accumulated into one (V x C) buffer, so there is no recompute (the same FLOPs as the
    plain head) and no per-chunk weight-gradient temporary (1 GiB on Llama-3-8B's head).
    Backward hands the two buffers over, scaled by the loss's incoming gradient.

NOTE [ What a chunked head changes in numerics ]
    The loss is the plain head's ops on the same rows (the logits, the log-softmax in
    float32 where the head upcasts, ``nll_loss``), so with one chunk it is the plain
    loss bit for bit; over several it is a sum of per-chunk sums. The gradients are the
    same mathematics in another order (NOTE [ The softmax gradient in place ]): each
    row's ``1/N`` is applied to the (n_c x C) products rather than to the (n_c x V)
    softmax, and the weight (and bias) gradient is accumulated over chunks in float32
    (NOTE [ The weight gradient in float32 ]). So no gradient is the plain head's bit
    for bit, not even with one chunk; all differ in the last bits, and every gradient
    below the head with them. Measured in ``tests/test_head.py`` (CPU, 1024 tokens):
    float32, relative to max |g|, at most 2e-6 for any chunk count; bfloat16, 7.5e-3
    against the plain head, whose own error against float64 is 5.3e-3 while the chunked
    head's is 3.9e-3 (hidden states) and 2.6e-3 (weight) at 1 to 128 chunks: the chunked
    head is the closer of the two to exact arithmetic, and does not drift with the chunk
    count. Through a whole bfloat16 model the gradients below the head differ more, as
    the plain step's own do (a held-out tied model: 3.3e-2, each step 2.4-2.6e-2 from
    float64). ``verify`` judges a chunked head with :data:`HEAD_RTOL`.

NOTE [ The softmax gradient in place ]
    The plain head's backward makes four passes over each (rows x V) tensor after the
    logits: ``log_softmax``, a dense ``nll_loss_backward`` (zeros, then one value per
    row), ``_log_softmax_backward_data`` (``d - exp(logp) * sum(d)``, a new tensor) and,
    where it upcasts, the copy back to the weight's dtype. Here the log-softmax is taken
    in place over the (upcast) logits, ``exp_`` turns it into the softmax in place, and
    one ``scatter_add_`` of -1 per counted row makes it ``softmax - one_hot``, the
    gradient of each row's loss, unscaled: two passes instead of four, one buffer
    instead of three. Each row's scale (``1/N``, 0 for an ignored row) is applied to
    the small products: ``d_hidden = g * (d_logits @ W)`` and
    ``d_weight += d_logits.T @ (g * h)``, in float32 before any rounding to a 16-bit
    dtype (a 16-bit ``1/N`` would scale every gradient by the same rounding error).

NOTE [ One buffer for every chunk ]
    Each chunk's logits are written into one (rows x V) buffer made before the first
    chunk (and its upcast into one float32 buffer), not into tensors made per chunk:
    they hold the same bytes at the same time, but a CPU hands a freed block of that
    size back to the system and faults it in again, page by page, for the next chunk
    (20 ms of a 60 ms matmul at 256 x 50257 in float32). The log-softmax, the softmax
    and its gradient are taken in place in the wider buffer; the gradient's copy back to
    the weight's dtype overwrites the logits, which are no longer needed by then.

NOTE [ The weight gradient in float32 ]
    With a 16-bit weight, adding each chunk's part of the weight gradient into a 16-bit
    buffer rounds the running sum once per chunk: the error grows with the chunk count
    (bfloat16, 1024 tokens: 5.3e-3 of max |g| from float64 with one chunk, 8.6e-3 with
    128; on the project's H200 run ``chunked:32`` of a 1B Llama exceeded the 2e-2
    bound). So the sum is kept in a float32 buffer, rounded to the weight's dtype once
    at the end. On CUDA each chunk's product takes 16-bit operands and adds into the
    float32 buffer in the same matmul (``addmm`` with ``out_dtype``; where a build lacks
    it, or cannot trace it (torch 2.11's meta kernel: a fake estimate or a compiled head
    there), the chunk's part is rounded once to 16 bits and added: a (V x C) temporary); on
    the CPU, whose 16-bit matmuls are emulated and several times slower, the product runs
    in float32 from the float32 softmax. The buffer costs (V x C) x 2 bytes more than a
    16-bit one while the head runs, which the profile measures with the rest of each head
    option.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError, check_whole

__all__ = ["HEAD_RTOL", "LMHead", "linear_cross_entropy"]

# Relative bounds (of max |x|) that a chunked head's loss and gradients stay within,
# against the plain head, by dtype of the head: NOTE [ What a chunked head changes in
# numerics ]; measured in tests/test_head.py, with room. bfloat16's was 2e-2 until a
# held-out model with bfloat16 parameters, a final norm and a tied head measured 3.3e-2
# (the final norm's bias), each head 2.4-2.6e-2 from a float64 step: as accurate, and
# two such results differ by up to the sum of their errors.
HEAD_RTOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float64: 1e-12,
    torch.bfloat16: 5e-2,
    torch.float16: 4e-3,
}


@dataclass(frozen=True)
class LogitOp:
    """One elementwise op a model applies to its logits between the projection and the
    loss (NOTE [ Logit transforms ]): ``mul`` / ``div`` by ``operand``, ``tanh``, or
    ``float`` (an upcast), ``add`` a bias over the vocabulary (``tensor``)."""

    name: Literal["mul", "div", "add", "tanh", "float"]
    operand: float = 1.0
    tensor: Tensor | None = field(default=None, compare=False)  # "add": a (V,) bias

    def __call__(self, x: Tensor) -> Tensor:
        if self.name == "add" and self.tensor is not None:
            return x + self.tensor.to(x.device)
        if self.name == "mul":
            return x * self.operand
        if self.name == "div":
            return x / self.operand
        if self.name == "tanh":
            return torch.tanh(x)
        return x.float()

    def __str__(self) -> str:
        return {"mul": f"* {self.operand:g}", "div": f"/ {self.operand:g}", "add": "+ bias",
                "tanh": "tanh", "float": ".float()"}[self.name]


def _transformed(logits: Tensor, ops: tuple[LogitOp, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """``ops`` applied to one chunk's ``logits`` as the model applies them, with the local
    graph to take their backward: ``(z, x, z)`` where ``x`` is the detached input that
    requires grad (with no ops: ``(logits, logits, logits)``)."""
    if not ops:
        return logits, logits, logits
    x = logits.detach().requires_grad_()
    with torch.enable_grad():
        z = x
        for op in ops:
            z = op(z)
    return z.detach(), x, z


@dataclass(frozen=True)
class HeadCall:
    """What one call of the chunked head was given, enough to run the same call again on
    stand-in values (its allocations depend on shapes, not values): NOTE [ One head option
    measured, the others replayed ] in ``_profile/options.py``."""

    hidden: tuple[tuple[int, ...], torch.dtype, torch.device, bool]  # shape, dtype, device, grad
    weight: Tensor
    bias: Tensor | None
    labels: tuple[tuple[int, ...], torch.dtype]
    denominator: tuple[torch.dtype, torch.device]
    ignore_index: int
    upcast: bool
    ops: tuple[LogitOp, ...] = ()
    backend: str = ""  # NOTE [ Head backends ]

    @staticmethod
    def of(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
           denominator: Tensor, ignore_index: int, upcast: bool, ops: tuple[LogitOp, ...],
           backend: str) -> HeadCall:
        """What a call given these arguments was given."""
        return HeadCall(
            hidden=(tuple(hidden.shape), hidden.dtype, hidden.device, hidden.requires_grad),
            weight=weight, bias=bias, labels=(tuple(labels.shape), labels.dtype),
            denominator=(denominator.dtype, denominator.device), ignore_index=ignore_index,
            upcast=upcast, ops=ops, backend=backend)

    def _stand_ins(self) -> tuple[Tensor, Tensor, Tensor]:
        """Hidden states (zeros), labels (0) and a denominator (1) of the call's shapes,
        dtypes and devices, made now."""
        shape, dtype, device, grad = self.hidden
        hidden = torch.zeros(shape, dtype=dtype, device=device, requires_grad=grad)
        labels = torch.zeros(self.labels[0], dtype=self.labels[1], device=device)
        denominator = torch.ones((), dtype=self.denominator[0], device=self.denominator[1])
        return hidden, labels, denominator

    def replay(self, chunks: int, backend: str | None = None) -> Callable[[], Tensor]:
        """The call over ``chunks`` chunks on stand-ins made now (zeros, labels 0): a
        function that runs it and returns the loss (its graph holds the gradients), by
        ``backend`` (default: the call's own)."""
        hidden, labels, denominator = self._stand_ins()
        who = self.backend if backend is None else backend
        return lambda: _head_loss(who, hidden, self.weight, self.bias, labels, denominator,
                                  chunks, self.ignore_index, self.upcast, self.ops)

    def replay_step(self, chunks: int | None, backend: str = "") -> Callable[[], object]:
        """Forward and backward of the call over ``chunks`` chunks on stand-ins, or with
        ``chunks=None`` of the plain head a model computes (the logits, the model's ops,
        the upcast, ``cross_entropy``): a function that runs it, its gradients taken with
        ``torch.autograd.grad`` (nothing lands in ``.grad``)."""
        hidden, labels, denominator = self._stand_ins()
        wrt = [t for t in (hidden, self.weight, self.bias) if t is not None and t.requires_grad]

        def loss() -> Tensor:
            if chunks is not None:
                return _head_loss(backend, hidden, self.weight, self.bias, labels,
                                  denominator, chunks, self.ignore_index, self.upcast, self.ops)
            z = F.linear(hidden, self.weight, self.bias)
            for op in self.ops:
                z = op(z)
            return F.cross_entropy(z.float() if self.upcast else z, labels,
                                   ignore_index=self.ignore_index, reduction="sum") / denominator

        return lambda: torch.autograd.grad(loss(), wrt) if wrt else loss()


HeadKind = Literal["hf", "ce", "module"]
HEAD_KINDS: tuple[HeadKind, ...] = ("hf", "ce", "module")


@dataclass(frozen=True)
class HeadAt:
    """Where a model's loss head is, as a plan records it: ``kind`` "hf" (``name`` is a
    Hugging Face causal LM's ``lm_head``), "ce" (the output layer whose
    ``cross_entropy`` the model's forward takes) or "module" (an :class:`LMHead`).
    Plan files write it ``"kind:name"`` (:meth:`parse` reads that back)."""

    kind: HeadKind
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> HeadAt:
        """``"kind:name"`` back into a site; a ``RematError`` saying what is wrong."""
        kind, _, name = text.partition(":") if isinstance(text, str) else ("", "", "")
        if kind not in HEAD_KINDS or not name:
            raise RematError(f"a head site is 'hf:<name>', 'ce:<name>' or 'module:<name>', "
                             f"got {text!r}")
        return cls(kind, name)  # type: ignore[arg-type]


# Told as each chunked forward starts ("start", what it was given) and ends ("end", None);
# set by a profile that measures the head (NOTE [ One head option measured, the others
# replayed ]); None: nobody listens.
HEAD_WATCH: ContextVar[Callable[[str, HeadCall | None], None] | None] = \
    ContextVar("autoremat_head_watch", default=None)


def _accumulates_wide(weight: Tensor) -> bool:
    """Whether the projection's weight gradient is accumulated over chunks in float32
    (NOTE [ The weight gradient in float32 ])."""
    return weight.dtype in (torch.bfloat16, torch.float16)


def _float32_matmul(device: torch.device) -> bool:
    """Whether a 16-bit head's weight gradient is multiplied in float32 on ``device``:
    on the CPU, whose 16-bit matmuls are emulated and several times slower (NOTE [ The
    weight gradient in float32 ])."""
    return device.type == "cpu"


def _has_kernel(op: str, device: torch.device) -> bool:
    """Whether ``op`` has a kernel for ``device``'s backend (a mixed-precision matmul that
    a build or a device may lack)."""
    key = {"cuda": "CUDA", "meta": "Meta", "xpu": "XPU"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def _dtype_out_on_meta() -> bool:
    """Whether ``addmm.dtype_out`` runs on meta tensors, which a fake estimate and a
    compile trace give it. torch 2.11's meta kernel for it is the plain ``addmm``
    decomposition, which takes ``out_dtype`` for ``beta`` (TypeError "got multiple values
    for argument 'beta'"); its CUDA kernel is fine."""
    m = torch.empty(1, 1, device="meta", dtype=torch.bfloat16)
    out = torch.empty(1, 1, device="meta")
    try:
        torch.ops.aten.addmm.dtype_out(out, m, m, torch.float32, beta=0, out=out)
    except TypeError:  # a capability probe: its answer is the False, not an error
        return False
    return True


# probed once, at import: outside any step's dispatch mode
_DTYPE_OUT_ON_META = _dtype_out_on_meta()


def _traced(t: Tensor) -> bool:
    """Whether ``t`` holds no data: a meta tensor or a fake one (estimate, compile)."""
    return t.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(t)


def _accumulate(d_weight: Tensor, d_logits: Tensor, d_low: Tensor, h: Tensor, g: Tensor,
                first: bool) -> None:
    """``d_weight += d_logits.T @ (g * h)`` (``=`` for the ``first`` chunk): one chunk's
    part of the weight gradient (``d_logits`` (n_c, V) unscaled, in float32 where the
    head upcasts, ``d_low`` the same in the weight's dtype; ``g`` (n_c, 1) float32, each
    row's scale), in ``d_weight``'s dtype (NOTE [ The weight gradient in float32 ])."""
    if d_weight.dtype == h.dtype:  # (V, n_c) @ (n_c, C), into the weight's own dtype
        a, b = d_low.t(), (h * g).to(h.dtype)
    elif _float32_matmul(h.device):
        a, b = d_logits.t().float(), h.float() * g
    elif _has_kernel("aten::addmm.dtype_out", h.device) and (
            _DTYPE_OUT_ON_META or not _traced(h)):  # 16-bit products, summed in float32
        torch.ops.aten.addmm.dtype_out(d_weight, d_low.t(), (h * g).to(h.dtype),
                                       torch.float32, beta=0 if first else 1, out=d_weight)
        return
    else:  # one rounding of the chunk's part to the weight's dtype, none across chunks
        part = torch.mm(d_low.t(), (h * g).to(h.dtype))
        d_weight.copy_(part) if first else d_weight.add_(part)
        return
    torch.mm(a, b, out=d_weight) if first else d_weight.addmm_(a, b)


# NOTE [ A batch with no counted token ]
#     A batch whose labels are all ``ignore_index`` (a micro-batch of padding) has a
#     denominator of 0: the plain mean's loss is nan and its gradients are 0 (each row's
#     is 0 times the scale). Scaled as ``counted * (1 / denominator)``, the chunked head
#     made them 0 * inf = nan, and an optimizer step wrote nan into 39 parameter tensors
#     of a held-out Qwen2 (2026-11-30). Each row's scale is the scale where it is counted
#     and 0 where it is not, the bias's sum of no row stays 0, and another backend's loss
#     is nan with no gradient there.


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_t CE(h_t W^T + b, y_t) / denominator`` over row chunks; NOTE [ A chunked head ]."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                labels: Tensor, denominator: Tensor, chunks: int, ignore_index: int,
                upcast: bool, ops: tuple[LogitOp, ...] = ()) -> Tensor:
        # (a profile measures the head eager only; Dynamo cannot trace a ContextVar)
        watch = None if torch.compiler.is_compiling() else HEAD_WATCH.get()
        if watch is not None:
            watch("start", HeadCall.of(hidden, weight, bias, labels, denominator,
                                       ignore_index, upcast, ops, ""))
        n = hidden.shape[0]  # hidden (N, C), labels (N,)
        want = (hidden.requires_grad, weight.requires_grad,
                bias is not None and bias.requires_grad)
        scale = torch.ones((), dtype=torch.float32, device=hidden.device) / denominator
        wide = _accumulates_wide(weight)  # NOTE [ The weight gradient in float32 ]
        d_hidden = torch.empty_like(hidden) if want[0] else None  # (N, C)
        d_weight = torch.empty_like(weight, dtype=torch.float32 if wide else weight.dtype) \
            if want[1] else None  # (V, C), written by the first chunk
        d_bias = torch.zeros_like(bias, dtype=torch.float32) \
            if want[2] and bias is not None else None  # (V,)
        total: Tensor | None = None
        size = -(-n // chunks)  # rows per chunk, rounded up
        # NOTE [ One buffer for every chunk ]
        vocab = weight.shape[0]
        wide_dtype = torch.float32 if upcast or any(op.name == "float" for op in ops) \
            else weight.dtype
        logits_buf = hidden.new_empty((min(size, n), vocab), dtype=weight.dtype)
        wide_buf = logits_buf if wide_dtype == weight.dtype else \
            hidden.new_empty((min(size, n), vocab), dtype=wide_dtype)
        if any(want):  # NOTE [ The softmax gradient in place ], for every row at once
            counted_all = labels != ignore_index  # (N,)
            # (N, 1): each row's gradient; an uncounted row's is 0 even over a denominator
            # of 0 (NOTE [ A batch with no counted token ])
            g_all = torch.where(counted_all, scale, 0.0).unsqueeze(1)
            minus_all = counted_all.to(wide_dtype).neg().unsqueeze(1)  # (N, 1): -1 or 0
            target_all = torch.where(counted_all, labels, 0).unsqueeze(1)  # (N, 1)
            del counted_all
        # NOTE [ Chunks as views made at once ]
        #     Each chunk's rows of every (N, ...) tensor are views made by one split
        #     before the loop, not one slice per tensor per chunk, and the weight is
        #     transposed once: the same views and kernels, 8 fewer ops a chunk (of 19: a
        #     dispatch each, on the CPU's side of a GPU step and under a profile's
        #     tracker, which replays the head at every chunk count).
        chunk_h, chunk_y = hidden.split(size), labels.split(size)  # (n_c, C), (n_c,)
        weight_t = weight.t()  # (C, V)
        if any(want):  # views of the rows' gradients, scales, signs and targets
            chunk_dh = d_hidden.split(size) if d_hidden is not None else None
            chunk_g, chunk_minus = g_all.split(size), minus_all.split(size)
            chunk_target = target_all.split(size)
        for k, (h, y) in enumerate(zip(chunk_h, chunk_y, strict=True)):
            first = k == 0
            rows = h.shape[0]  # size, or fewer in the last chunk
            # (n_c, V), as F.linear computes them
            logits = logits_buf if rows == size else logits_buf[:rows]
            if bias is None:
                torch.mm(h, weight_t, out=logits)
            else:
                torch.addmm(bias, h, weight_t, out=logits)
            z, x, graph = _transformed(logits, ops)  # NOTE [ Logit transforms ]
            if not ops and wide_buf is logits_buf:
                source = logits
            else:  # the upcast (or the ops' result, which their graph may hold)
                source = (wide_buf if rows == size else wide_buf[:rows]).copy_(z)
            # log-softmax in place (the same kernel, the same floats as out of place)
            logp = torch._log_softmax(source, -1, False, out=source)
            part, _ = torch.ops.aten.nll_loss_forward(logp, y, None, 2, ignore_index)
            total = part if total is None else total + part
            if not any(want):
                continue
            # NOTE [ The softmax gradient in place ]
            g, minus = chunk_g[k], chunk_minus[k]  # (n_c, 1) each
            d_logits = logp.exp_()  # the softmax, over the log-softmax's buffer
            d_logits.scatter_add_(1, chunk_target[k], minus)  # softmax - one-hot, unscaled
            del logp, source, z
            if ops:  # back through the model's ops, unscaled as the rest
                d_logits, = torch.autograd.grad(graph, x, d_logits.to(graph.dtype))
            del x, graph
            d_low = d_logits if d_logits.dtype == logits.dtype else \
                logits.copy_(d_logits)  # the backward of the upcast, over the logits
            del logits
            if d_hidden is not None:  # (n_c, V) @ (V, C), each row then scaled by its g
                assert chunk_dh is not None  # for mypy: split with d_hidden
                torch.mul(torch.mm(d_low, weight), g, out=chunk_dh[k])
            if d_weight is not None:  # (V, n_c) @ (n_c, C), the rows of h scaled by g
                _accumulate(d_weight, d_logits, d_low, h, g, first)
            if d_bias is not None:  # the sum of the counted rows, scaled at the end
                d_bias -= torch.mv(d_logits.t(), minus.squeeze(1))
            # nothing of a chunk outlives it: the forward ends at the same level for any
            # chunk count (NOTE [ One head option measured, the others replayed ])
            del d_logits, d_low, g, minus
        del logits_buf, wide_buf, chunk_h, chunk_y
        if any(want):
            del g_all, minus_all, target_all, chunk_g, chunk_minus, chunk_target, chunk_dh
        # split makes one chunk of no rows where there are none: the sum of nothing, 0,
        # over a denominator of 0 is the plain mean's nan
        assert total is not None  # for mypy: the loop ran at least once
        if wide and d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        if d_bias is not None and bias is not None:  # (a sum of no row stays 0)
            d_bias = torch.where(d_bias == 0, d_bias, d_bias * scale).to(bias.dtype)
        ctx.grads = (d_hidden, d_weight, d_bias) if any(want) else None
        loss = total / denominator.to(total.dtype)
        if watch is not None:
            watch("end", None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grads = ctx.grads
        if grads is None:
            raise RematError(
                "the chunked loss head computed its gradients in forward and handed them "
                "over in the first backward; a second backward through the same loss "
                "(retain_graph=True, two backward calls off one forward, or double "
                "backward) is not supported by it. Run one backward per forward, or plan "
                "with head='keep' (autoremat.plan(tape, ..., head='keep'))")
        ctx.grads = None  # handed over once: the engine may then take them as .grad
        out = [g.mul_(grad.to(g.dtype)) if g is not None else None for g in grads]
        return (*out, None, None, None, None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                         bias: Tensor | None = None, chunks: int = 1,
                         ignore_index: int = -100,
                         num_items_in_batch: Tensor | int | None = None,
                         upcast: bool = False, ops: tuple[LogitOp, ...] = (),
                         backend: str = "") -> Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, computed over
    ``chunks`` chunks of tokens so that only one chunk's logits exist at a time.

    Args:
        hidden: ``(..., C)`` hidden states, one row per token.
        weight: ``(V, C)`` the output projection (``nn.Linear(C, V).weight``).
        labels: ``(...)`` class indices, ``ignore_index`` for tokens that do not count.
        chunks: how many chunks of rows (1: one, with the plain head's numerics).
        num_items_in_batch: the loss is the sum over counted tokens divided by this
            (Hugging Face's gradient accumulation); ``None``: the mean over counted tokens.
        upcast: compute the log-softmax in float32 (as Hugging Face's loss does).
        ops: elementwise ops the model applies to the logits before the loss, in order
            (a soft-cap is ``(LogitOp("div", c), LogitOp("tanh"), LogitOp("mul", c))``):
            applied to each chunk's logits (NOTE [ Logit transforms ]).
        backend: whose kernel computes it: ``""`` autoremat's own, ``"torch"``,
            ``"liger"`` or ``"cce"`` (NOTE [ Head backends ]).

    Returns:
        The scalar loss; its backward hands over gradients computed in forward
        (NOTE [ A chunked head ]). Only one backward per forward.

    Example:
        >>> h, w = torch.randn(6, 4), torch.randn(10, 4)
        >>> y = torch.tensor([1, 2, 3, -100, 5, 6])
        >>> plain = F.cross_entropy(h @ w.T, y)
        >>> torch.allclose(linear_cross_entropy(h, w, y, chunks=3), plain)
        True
    """
    check_whole("chunks", chunks, 1, "chunks of tokens the loss head is computed in")
    if hidden.shape[:-1] != labels.shape:
        raise RematError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and labels "
                         f"{tuple(labels.shape)} must have one label per row of hidden")
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, C)
    targets = labels.reshape(-1).to(flat.device)  # (N,)
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum().float()
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=flat.device).float()
    return _head_loss(backend, flat, weight, bias, targets, denominator, chunks,
                      ignore_index, upcast, tuple(ops))


# NOTE [ Head backends ]
#     Besides autoremat's own chunked head, three kernels compute a linear layer and its
#     cross-entropy without the full logits: torch's ``F.linear_cross_entropy`` with
#     ``LinearCrossEntropyOptions`` (torch 2.13; ``batch_chunk_size`` from the chunk
#     count, its own accumulation policy for the device), Liger-Kernel's
#     ``LigerFusedLinearCrossEntropyLoss`` and cut-cross-entropy's
#     ``linear_cross_entropy`` (gradient filtering off: ``filter_eps=None``, since it
#     drops small gradients), the last two on CUDA only. Each takes the sum over counted
#     tokens, divided here by the same denominator as autoremat's, so the loss means the
#     same; none follows a model's logit transform or autoremat's ``upcast`` to the
#     letter (their own accumulation dtypes instead), which ``verify``'s bound judges. A
#     backend is measured in the profile like a chunk count (NOTE [ What a head option
#     costs ] in ``_profile/options.py``) and chosen only by a plan's cost.
HEAD_BACKEND_NAMES = {"": "autoremat", "torch": "torch", "liger": "liger-kernel",
                      "cce": "cut-cross-entropy"}
# the kernels by the names ``profile(..., with_head=[...])`` takes, and their backends
HEAD_KERNELS = {"autoremat": "", "torch": "torch", "liger": "liger", "cce": "cce"}


def backend_unavailable(backend: str, device: torch.device, *, bias: bool = False,
                        ops: tuple[LogitOp, ...] = ()) -> str:
    """Why ``backend`` cannot compute a loss head on ``device`` ("" where it can; NOTE
    [ Head backends ])."""
    if backend == "":
        return ""
    name = HEAD_BACKEND_NAMES.get(backend)
    if name is None:
        return f"no head backend {backend!r} (one of {sorted(HEAD_BACKEND_NAMES.values())})"
    if ops:
        return (f"{name} does not apply the model's logit transform "
                f"({', '.join(map(str, ops))})")
    if backend == "torch":
        if getattr(torch.nn, "LinearCrossEntropyOptions", None) is None:
            return f"torch {torch.__version__} has no LinearCrossEntropyOptions (2.13 has)"
        return ""
    module = "liger_kernel" if backend == "liger" else "cut_cross_entropy"
    if importlib.util.find_spec(module) is None:
        return f"{name} is not installed (pip install {name})"
    if device.type != "cuda":
        return f"{name}'s kernels run on CUDA, not {device.type}"
    if backend == "cce" and bias:
        return f"{name} takes no bias of the output layer"
    return ""


def _head_loss(backend: str, flat: Tensor, weight: Tensor, bias: Tensor | None,
               targets: Tensor, denominator: Tensor, chunks: int, ignore_index: int,
               upcast: bool, ops: tuple[LogitOp, ...]) -> Tensor:
    """The loss of ``flat`` (N, C) through ``weight`` against ``targets`` by ``backend``
    (NOTE [ Head backends ]): its gradients taken as its kernel takes them."""
    if backend == "":
        loss: Tensor = _ChunkedLinearCrossEntropy.apply(
            flat, weight, bias, targets, denominator, chunks, ignore_index, upcast, ops)
        return loss
    why = backend_unavailable(backend, flat.device, bias=bias is not None, ops=ops)
    if why:
        raise RematError(f"the loss head's backend {backend!r} cannot run here: {why}; "
                         f"profile and plan on this machine")
    watch = None if torch.compiler.is_compiling() else HEAD_WATCH.get()
    if watch is not None:
        watch("start", HeadCall.of(flat, weight, bias, targets, denominator, ignore_index,
                                   upcast, ops, backend))
    total = _backend_sum(backend, flat, weight, bias, targets, chunks, ignore_index)
    denominator = denominator.to(total.dtype)
    # NOTE [ A batch with no counted token ]: nan, as the plain mean, with no gradient
    none = denominator == 0
    loss = torch.where(none, (total / denominator).detach(),
                       total / torch.where(none, 1.0, denominator))
    if watch is not None:
        watch("end", None)
    return loss


def _backend_sum(backend: str, flat: Tensor, weight: Tensor, bias: Tensor | None,
                 targets: Tensor, chunks: int, ignore_index: int) -> Tensor:
    """The summed cross-entropy by another library's kernel (NOTE [ Head backends ])."""
    wide = torch.float32 if flat.dtype in (torch.bfloat16, torch.float16) else None
    if backend == "torch":
        options = torch.nn.LinearCrossEntropyOptions(  # type: ignore[attr-defined]
            chunking_method=None, batch_chunk_size=max(1, -(-flat.shape[0] // chunks)))
        out: Tensor = F.linear_cross_entropy(  # type: ignore[attr-defined]
            flat, weight, targets, linear_bias=bias, reduction="sum",
            ignore_index=ignore_index, options=options)
        return out
    if backend == "liger":
        liger = importlib.import_module("liger_kernel.transformers")
        loss = liger.LigerFusedLinearCrossEntropyLoss(
            ignore_index=ignore_index, reduction="sum", accum_dtype=wide)
        out = loss(weight, flat, targets, bias)
        return out
    cce = importlib.import_module("cut_cross_entropy")
    out = cce.linear_cross_entropy(flat, weight, targets, ignore_index=ignore_index,
                                   reduction="sum", filter_eps=None)
    return out


class LMHead(nn.Linear):
    """An output projection that also takes the loss, so that a plan can chunk it.

    Use it for a model of your own in place of ``nn.Linear(C, vocab)`` plus
    ``F.cross_entropy``: ``logits, loss = self.lm_head(x, labels)``. Unplanned (or with
    a plan that keeps the head) it runs exactly those two ops; under a plan whose head
    is chunked it returns ``(None, loss)`` in a step with gradients and never builds the
    full logits (NOTE [ A chunked head ]); without gradients (evaluation) it returns the
    logits as unplanned. Parameters and state-dict keys are ``nn.Linear``'s.

    Args:
        in_features, out_features, bias: as ``nn.Linear`` (``out_features``: the vocabulary).
        shift: position ``t`` predicts label ``t + 1`` (labels are the input ids), as
            Hugging Face's causal LM loss does; ``False``: labels are already aligned.
        ignore_index: labels that do not count.
        upcast: take the cross-entropy of the logits in float32.

    Example:
        >>> head = LMHead(8, 50)
        >>> logits, loss = head(torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5)))
        >>> logits.shape, loss.shape
        (torch.Size([2, 5, 50]), torch.Size([]))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 shift: bool = False, ignore_index: int = -100, upcast: bool = False,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.shift = shift
        self.ignore_index = ignore_index
        self.upcast = upcast
        self.chunks: int | None = None  # set by a plan with a chunked head
        self.backend = ""  # and whose kernel runs it (NOTE [ Head backends ])

    def forward(self, hidden: Tensor,  # type: ignore[override]
                labels: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        if labels is None:
            return super().forward(hidden), None
        if self.chunks is not None and torch.is_grad_enabled():
            if self.shift:
                hidden, labels = hidden[..., :-1, :], labels[..., 1:]
            return None, linear_cross_entropy(
                hidden, self.weight, labels, bias=self.bias, chunks=self.chunks,
                ignore_index=self.ignore_index, upcast=self.upcast, backend=self.backend)
        logits = super().forward(hidden)  # (..., T, V)
        source = logits.float() if self.upcast else logits
        if self.shift:  # position t predicts label t + 1: all but the last position
            source, labels = source[..., :-1, :], labels[..., 1:]
        loss = F.cross_entropy(source.reshape(-1, source.size(-1)), labels.reshape(-1),
                               ignore_index=self.ignore_index)
        return logits, loss

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", shift={self.shift}, ignore_index="
                f"{self.ignore_index}, upcast={self.upcast}"
                + (f", chunks={self.chunks}" if self.chunks is not None else ""))
