"""Loss-head kernels besides autoremat's own as measured head options (NOTE [ Head
backends ] in ``_core/head.py``): torch's ``linear_cross_entropy`` for real on this CPU,
and Liger-Kernel's API through a stand-in (its kernels need CUDA), which tests what
autoremat does with it: measured, planned, installed, verified."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import autoremat
from autoremat import RematError
from autoremat._core import head as head_module
from autoremat._profile import options as options_module

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyOptions"),
                                reason="this torch has no LinearCrossEntropyOptions")


def _gpt2(vocab: int = 4096):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=64))
    model.config.use_cache = False
    ids = torch.randint(0, vocab, (2, 64))
    labels = ids.clone()
    labels[0, :7] = -100
    return model.train(), {"input_ids": ids, "labels": labels}


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with autoremat.track_memory() as mem:
        out = model(**inputs)
        out.loss.backward()
    return out, mem.peak_bytes


def _check(model, inputs, tape, head):
    plain, _ = _step(model, inputs)
    plan = autoremat.plan(tape, strategy="none", head=head)
    assert plan.head.head_key == head
    assert autoremat.Plan.from_json(plan.to_json()).head == plan.head
    autoremat.apply(model, plan)
    out, peak = _step(model, inputs)
    assert out.logits is None and peak <= plan.predicted_peak_bytes
    assert abs(float(out.loss.detach()) - float(plain.loss.detach())) \
        <= 1e-5 * abs(float(plain.loss.detach()))
    assert autoremat.verify(model, inputs, plan, repeats=1).ok
    autoremat.remove(model)


def test_torchs_linear_cross_entropy_is_a_measured_head_option():
    model, inputs = _gpt2()
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False,
                             with_head=["autoremat", "torch"])
    assert tape.head is not None
    assert set(tape.head.options) == {"chunked:4", "chunked:32", "torch:4", "torch:32"}
    assert tape.head.options["torch:4"].backend == "torch"
    for head in ("torch:4", "torch:32"):
        _check(model, inputs, tape, head)
    loaded = autoremat.Tape.from_json(tape.to_json())
    assert loaded.head == tape.head


def test_by_default_a_cpu_profile_measures_autoremats_own_head():
    # torch's is slower on a CPU (benchmarks/results/head_kernels_*.md)
    model, inputs = _gpt2()
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert set(tape.head.options) == {"chunked:4", "chunked:32"}


class _StandInLiger:
    """Liger-Kernel's LigerFusedLinearCrossEntropyLoss, its API in plain torch."""

    def __init__(self, ignore_index=-100, reduction="mean", accum_dtype=None):
        self.ignore_index, self.reduction = ignore_index, reduction

    def __call__(self, weight, hidden, target, bias=None):
        return F.cross_entropy(F.linear(hidden, weight, bias).float(), target,
                               ignore_index=self.ignore_index, reduction=self.reduction)


def test_a_kernel_library_is_measured_planned_and_installed(monkeypatch):
    liger = types.ModuleType("liger_kernel")
    liger.transformers = types.ModuleType("liger_kernel.transformers")
    liger.transformers.LigerFusedLinearCrossEntropyLoss = _StandInLiger
    monkeypatch.setitem(sys.modules, "liger_kernel", liger)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger.transformers)
    real = head_module.backend_unavailable

    def on_cuda_here(backend, device, **kwargs):  # the stand-in runs on this CPU
        return "" if backend == "liger" else real(backend, device, **kwargs)
    for module in (head_module, options_module, autoremat._mechanism.head):
        monkeypatch.setattr(module, "backend_unavailable", on_cuda_here)
    model, inputs = _gpt2()
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False,
                             with_head=["autoremat", "liger", "cce"])
    assert set(tape.head.options) == {"chunked:4", "chunked:32", "liger"}
    assert any("cce" in note for note in tape.notes)  # asked for, not measured: said
    _check(model, inputs, tape, "liger")
    monkeypatch.setattr(autoremat._mechanism.head, "backend_unavailable", real)
    monkeypatch.delitem(sys.modules, "liger_kernel")  # what a machine without it has
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers")
    with pytest.raises(RematError, match="cannot run here"):  # where it is missing
        autoremat.apply(model, autoremat.plan(tape, strategy="none", head="liger"))


@pytest.mark.parametrize(("with_head", "match"), [
    (["autoremat", "fused"], "with_head must be"), ("torch", "with_head must be"),
    ([], "with_head must be")])
def test_unknown_kernels_are_refused_before_any_work(with_head, match):
    model, inputs = _gpt2()
    with pytest.raises(RematError, match=match):
        autoremat.profile(model, inputs, with_head=with_head)


def test_a_head_option_the_tape_lacks_is_refused_with_the_ones_it_has():
    model, inputs = _gpt2()
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    with pytest.raises(RematError, match="chunked:32"):
        autoremat.plan(tape, head="torch:4")
    with pytest.raises(RematError, match="head must be"):
        autoremat.plan(tape, head="fused:4")
    # a tape that measured none offers none (it listed 'chunked', then suggested it)
    bare = autoremat.profile(model, inputs, timing=False, with_selective=False,
                             with_head=False)
    for head in ("chunked", "chunked:4"):
        with pytest.raises(RematError, match=rf"^head '{head}': this tape measured no chunked "
                           r"head option, so it offers 'keep' and 'auto'"):
            autoremat.plan(bare, head=head)
