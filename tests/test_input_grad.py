"""An input that is a leaf requiring grad: every measured step of profile starts with its
``.grad`` None (as verify's steps do), so the step that creates it, and for a
non-contiguous input AccumulateGrad's copy into the input's layout, is what is predicted."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class _Net(nn.Module):
    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(c) for _ in range(3))
        self.head = nn.Linear(c, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.flatten(2).mean(2))


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("grad_set", [False, True])
def test_an_input_requiring_grad_is_predicted_as_verify_measures_it(contiguous: bool,
                                                                   grad_set: bool) -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 3, 16, 16)
    if not contiguous:  # strides (768, 256, 1, 16): its gradient is copied into them
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    x.requires_grad_()
    if grad_set:
        x.grad = torch.ones_like(x)
    before = None if x.grad is None else x.grad.clone()
    y = torch.randint(0, 4, (4,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, repeats=1, timing=False)
    for strategy in ("none", "full"):
        plan = autoremat.plan(tape, strategy=strategy)
        autoremat.apply(model, plan)
        try:
            report = autoremat.verify(model, x, loss_fn=loss_fn)
        finally:
            autoremat.remove(model)
        assert report.plain_peak_bytes == tape.step_peak_bytes, strategy
        assert plan.predicted_peak_bytes >= report.peak_bytes, strategy
        if strategy == "none":
            assert plan.predicted_peak_bytes == report.peak_bytes
    # the user's gradient of the input is left as it was
    assert (x.grad is None) == (before is None)
    if before is not None:
        assert torch.equal(x.grad, before)
