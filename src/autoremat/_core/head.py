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
    Per chunk, the logits, the (upcast) log-softmax and its gradient are the same ops on
    the same rows as the plain head's, and the incoming gradient of each token's loss is
    the same float (``1/N``: the plain mean divides by the count ``N``; the chunked sum is
    divided by the same ``N``). What differs is only the order of summation:
    * the loss: one sum over all tokens in the plain kernel, a sum of per-chunk sums here;
    * the weight (and bias) gradient: one matmul over all tokens in the plain head, an
      accumulation of one matmul per chunk here (in the weight's dtype: in bf16 each
      chunk's partial sum is rounded once);
    * the hidden states' gradient: the same rows through the same matmul, but a BLAS may
      choose another kernel for a matmul of fewer rows (on this CPU: bitwise equal at
      hundreds of rows per chunk, not at 4), and then every gradient below the head
      differs in the last bits too.
    With one chunk every figure is the plain head's, bit for bit (a test checks it).
    ``tests/test_head.py`` measures the rest and bounds it; ``verify`` judges a chunked
    head with those bounds (:data:`HEAD_RTOL`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError, check_whole

__all__ = ["HEAD_RTOL", "LMHead", "linear_cross_entropy"]

# Relative bounds (of max |x|) that a chunked head's loss and gradients stay within,
# against the plain head, by dtype of the head: NOTE [ What a chunked head changes in
# numerics ]; measured in tests/test_head.py, with room.
HEAD_RTOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float64: 1e-12,
    torch.bfloat16: 2e-2,
    torch.float16: 4e-3,
}


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

    def replay(self, chunks: int) -> Callable[[], Tensor]:
        """The call over ``chunks`` chunks on stand-ins made now (zeros, labels 0): a
        function that runs it and returns the loss (its graph holds the gradients)."""
        shape, dtype, device, grad = self.hidden
        hidden = torch.zeros(shape, dtype=dtype, device=device, requires_grad=grad)
        labels = torch.zeros(self.labels[0], dtype=self.labels[1], device=device)
        denominator = torch.ones((), dtype=self.denominator[0], device=self.denominator[1])
        return lambda: _ChunkedLinearCrossEntropy.apply(
            hidden, self.weight, self.bias, labels, denominator, chunks, self.ignore_index,
            self.upcast)


# Told as each chunked forward starts ("start", what it was given) and ends ("end", None);
# set by a profile that measures the head (NOTE [ One head option measured, the others
# replayed ]); None: nobody listens.
HEAD_WATCH: ContextVar[Callable[[str, HeadCall | None], None] | None] = \
    ContextVar("autoremat_head_watch", default=None)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_t CE(h_t W^T + b, y_t) / denominator`` over row chunks; NOTE [ A chunked head ]."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                labels: Tensor, denominator: Tensor, chunks: int, ignore_index: int,
                upcast: bool) -> Tensor:
        # (a profile measures the head eager only; Dynamo cannot trace a ContextVar)
        watch = None if torch.compiler.is_compiling() else HEAD_WATCH.get()
        if watch is not None:
            watch("start", HeadCall(
                hidden=(tuple(hidden.shape), hidden.dtype, hidden.device, hidden.requires_grad),
                weight=weight, bias=bias, labels=(tuple(labels.shape), labels.dtype),
                denominator=(denominator.dtype, denominator.device),
                ignore_index=ignore_index, upcast=upcast))
        n = hidden.shape[0]  # hidden (N, C), labels (N,)
        want = (hidden.requires_grad, weight.requires_grad,
                bias is not None and bias.requires_grad)
        scale = torch.ones((), dtype=torch.float32, device=hidden.device) / denominator
        d_hidden = torch.empty_like(hidden) if want[0] else None  # (N, C)
        d_weight = torch.empty_like(weight) if want[1] else None  # (V, C)
        d_bias = torch.zeros_like(bias) if want[2] and bias is not None else None
        total: Tensor | None = None
        size = -(-n // chunks)  # rows per chunk, rounded up
        for first, start in enumerate(range(0, n, size)):
            rows = slice(start, min(start + size, n))
            h, y = hidden[rows], labels[rows]  # (n_c, C), (n_c,)
            logits = F.linear(h, weight, bias)  # (n_c, V)
            source = logits.float() if upcast else logits
            # the ops autograd runs for cross_entropy(source, y, reduction="sum") and its
            # backward, called directly: the same floats, and no autograd inside a forward
            # (which torch.compile would have to leave)
            logp = torch.log_softmax(source, -1)
            part, counted = torch.ops.aten.nll_loss_forward(logp, y, None, 2, ignore_index)
            total = part if total is None else total + part
            if not any(want):
                continue
            d_logp = torch.ops.aten.nll_loss_backward(scale.to(logp.dtype), logp, y, None, 2,
                                                      ignore_index, counted)
            d_logits = torch.ops.aten._log_softmax_backward_data(d_logp, logp, -1,
                                                                 source.dtype)
            del logp, d_logp, source
            d_logits = d_logits.to(logits.dtype)  # the backward of .float()
            del logits
            if d_hidden is not None:
                torch.mm(d_logits, weight, out=d_hidden[rows])  # (n_c, V) @ (V, C)
            if d_weight is not None:
                if first == 0:
                    torch.mm(d_logits.t(), h, out=d_weight)  # (V, n_c) @ (n_c, C)
                else:
                    d_weight.addmm_(d_logits.t(), h)
            if d_bias is not None:
                d_bias += d_logits.sum(0)
            del d_logits
        if total is None:  # no rows: the plain mean of nothing is nan, as here
            total = torch.zeros((), dtype=torch.float32 if upcast else hidden.dtype,
                                device=hidden.device)
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
        return (*out, None, None, None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                         bias: Tensor | None = None, chunks: int = 1,
                         ignore_index: int = -100,
                         num_items_in_batch: Tensor | int | None = None,
                         upcast: bool = False) -> Tensor:
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
    loss: Tensor = _ChunkedLinearCrossEntropy.apply(
        flat, weight, bias, targets, denominator, chunks, ignore_index, upcast)
    return loss


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

    def forward(self, hidden: Tensor,  # type: ignore[override]
                labels: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        if labels is None:
            return super().forward(hidden), None
        if self.chunks is not None and torch.is_grad_enabled():
            if self.shift:
                hidden, labels = hidden[..., :-1, :], labels[..., 1:]
            return None, linear_cross_entropy(
                hidden, self.weight, labels, bias=self.bias, chunks=self.chunks,
                ignore_index=self.ignore_index, upcast=self.upcast)
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
