"""Heads beyond the causal LM's plain one: models that transform the logits before the
loss (Gemma 2's soft-cap, Cohere's logit scale, Granite's logit scaling, BART's logit
bias), and models that take ``cross_entropy`` of their output layer in their own forward
(BERT's masked-LM head, T5's and BART's decoders), chunked by following the model's own
ops (NOTE [ Logit transforms ], NOTE [ Which heads can be chunked ] in
``_mechanism/head.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autoremat
from autoremat import RematError
from autoremat._core.head import HEAD_RTOL, LogitOp, linear_cross_entropy
from autoremat._mechanism import head as mechanism
from autoremat._plan.strategies import smallest_feasible_bytes

from _steps import exact

transformers = pytest.importorskip("transformers")

VOCAB = 3000


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def _build(kind: str):
    torch.manual_seed(0)
    common = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
    if kind == "gemma2":  # logits / 3, tanh, * 3
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, head_dim=16, final_logit_softcapping=3.0))
    elif kind == "cohere":  # logits * 0.25
        model = transformers.CohereForCausalLM(transformers.CohereConfig(
            **common, logit_scale=0.25))
    elif kind == "granite":  # logits / 4
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **common, logits_scaling=4.0))
    else:  # Granite's default config: logits / 1.0, a new tensor all the same
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**common))
    model.config.use_cache = False
    ids = torch.randint(0, VOCAB, (2, 32))
    labels = ids.clone()
    labels[1, :5] = -100
    return model.train(), {"input_ids": ids, "labels": labels}


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with autoremat.track_memory() as mem:
        out = model(**inputs)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, mem.peak_bytes


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite", "granite-default"])
def test_a_transformed_head_is_chunked_with_the_models_own_ops(kind):
    model, inputs = _build(kind)
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert tape.head is not None and "chunked:4" in tape.head.options
    plain, plain_grads, _ = _step(model, inputs)
    plan = autoremat.plan(tape, strategy="none", head="chunked:4")
    autoremat.apply(model, plan)
    out, grads, peak = _step(model, inputs)
    assert out.logits is None  # the full logits are never built
    assert peak <= plan.predicted_peak_bytes
    assert _rel(out.loss, plain.loss) <= HEAD_RTOL[torch.float32]
    assert set(grads) == set(plain_grads)
    assert max(_rel(grads[n], plain_grads[n]) for n in grads) <= HEAD_RTOL[torch.float32]
    assert autoremat.verify(model, inputs, plan, repeats=1).ok
    with torch.no_grad():  # evaluation: the model's own head and transform
        assert model(**inputs).logits.shape[-1] == VOCAB
    autoremat.remove(model)


def test_a_transform_the_config_does_not_name_leaves_the_head_to_the_model(monkeypatch):
    # a model that changes its logits in a way the chunked head does not follow is still
    # profiled and planned: the tape measures no head options and says why
    model, inputs = _build("granite")
    monkeypatch.setattr(mechanism, "_LOGIT_TRANSFORMS", ())  # as if the field were unnamed
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert tape.head is None
    assert any("changed what lm_head returned" in note and "stays as the model computes"
               in note for note in tape.notes), tape.notes
    with pytest.raises(RematError, match=r"measured no chunked head option.*changed what "
                       "lm_head returned"):
        autoremat.plan(tape, strategy="none", head="chunked:4")
    plan = autoremat.plan(tape, budget=smallest_feasible_bytes(tape))  # the model's head
    autoremat.apply(model, plan)
    assert autoremat.verify(model, inputs, plan, repeats=1).ok
    autoremat.remove(model)


def test_leaving_the_transform_out_is_far_outside_the_bound(monkeypatch):
    # the test above can fail: the same plan without the soft-cap's ops
    model, inputs = _build("gemma2")
    model.config.final_logit_softcapping = 0.05  # a cap that changes these small logits
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    plain, plain_grads, _ = _step(model, inputs)
    autoremat.apply(model, autoremat.plan(tape, strategy="none", head="chunked:4"))
    monkeypatch.setattr(mechanism, "_logit_op", lambda *args: None)  # every op escapes ...
    with pytest.raises(RematError, match="tanh"):  # ... and is refused, naming it
        _step(model, inputs)
    monkeypatch.undo()
    monkeypatch.setattr(LogitOp, "__call__", lambda self, x: x)  # the ops do nothing
    out, grads, _ = _step(model, inputs)
    assert _rel(out.loss, plain.loss) > 100 * HEAD_RTOL[torch.float32]
    assert max(_rel(grads[n], plain_grads[n]) for n in grads) > 100 * HEAD_RTOL[torch.float32]
    autoremat.remove(model)


@pytest.mark.parametrize(("dtype", "upcast"), [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("ops", [
    (LogitOp("div", 30.0), LogitOp("tanh"), LogitOp("mul", 30.0)),
    (LogitOp("mul", 0.0625),),
    (LogitOp("float"), LogitOp("div", 5.0), LogitOp("tanh"))], ids=str)
def test_logit_ops_per_chunk_within_the_bound(ops, dtype, upcast):
    torch.manual_seed(0)
    h = torch.randn(300, 32).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, 32) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, VOCAB, (300,))
    y[::7] = -100
    z = F.linear(h, w)
    for op in ops:
        z = op(z)
    plain = F.cross_entropy(z.float() if upcast else z, y)
    plain.backward()
    gh, gw = h.grad, w.grad
    h.grad = w.grad = None
    for chunks in (1, 4, 16):
        loss = linear_cross_entropy(h, w, y, chunks=chunks, upcast=upcast, ops=ops)
        loss.backward()
        if chunks == 1:
            assert torch.equal(loss, plain)  # the model's ops, in its order and dtype
        assert _rel(loss, plain) <= HEAD_RTOL[torch.float32]
        assert _rel(h.grad, gh) <= HEAD_RTOL[dtype] and _rel(w.grad, gw) <= HEAD_RTOL[dtype]
        h.grad = w.grad = None


def test_traced_logits_record_transforms_and_mark_anything_else():
    hidden = torch.randn(2, 3, 8)
    traced = mechanism._TracedLogits.of(hidden, (), {})
    capped = torch.tanh(traced / 30.0) * 30.0
    assert isinstance(capped, mechanism._TracedLogits) and capped._root is hidden
    assert [str(op) for op in capped._ops] == ["/ 30", "tanh", "* 30"]
    assert capped.shape == hidden.shape and capped._state == {}  # metadata: nothing marked
    sliced = capped[:, :-1]
    assert not isinstance(sliced, mechanism._TracedLogits)
    assert capped._state == {"escaped": "__getitem__"}
    other = mechanism._TracedLogits.of(hidden, (), {})
    _ = other * torch.ones(8)  # times a tensor: not a logit transform
    assert other._state["escaped"] in ("mul", "__mul__")


# --- heads whose cross_entropy the model's forward takes (kind "ce") --------------------------

def _build_ce(kind: str):
    torch.manual_seed(0)
    if kind == "bert-mlm":  # every 5th token masked, the rest ignored
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=64))
        ids = torch.randint(0, VOCAB, (2, 32))
        labels = torch.full_like(ids, -100)
        labels[:, ::5] = ids[:, ::5]
        model.config.use_cache = False
        return model.train(), {"input_ids": ids, "labels": labels}
    if kind == "bart-causal":  # a *ForCausalLM whose forward takes nn.CrossEntropyLoss of
        # logits.view(-1, vocab_size), unshifted, not its loss_function
        model = transformers.BartForCausalLM(transformers.BartConfig(
            vocab_size=VOCAB, d_model=64, decoder_layers=2, decoder_attention_heads=4,
            decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False))
        ids = torch.randint(0, VOCAB, (2, 32))
        labels = ids.clone()
        labels[0, -3:] = -100
        return model.train(), {"input_ids": ids, "labels": labels}
    if kind == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
            num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0))
    else:  # bart, with a logit bias that is not zero: followed per chunk
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
            decoder_ffn_dim=128, max_position_embeddings=64))
        model.final_logits_bias.normal_()
    for config in (model.config, getattr(model.get_decoder(), "config", model.config)):
        config.use_cache = False
    ids = torch.randint(0, VOCAB, (2, 32))
    labels = torch.randint(0, VOCAB, (2, 16))
    labels[0, -3:] = -100
    return model.train(), {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("kind", ["bert-mlm", "t5", "bart", "bart-causal"])
def test_a_cross_entropy_in_the_forward_is_chunked(kind):
    model, inputs = _build_ce(kind)
    tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert tape.head is not None and tape.head.kind == "ce"
    assert tape.head.name == next(n for n, m in model.named_modules()
                                  if m is model.get_output_embeddings())
    keep = smallest_feasible_bytes(tape)
    assert smallest_feasible_bytes(tape, head="auto") < keep  # the head was the floor
    plain, plain_grads, _ = _step(model, inputs)
    plan = autoremat.plan(tape, strategy="none", head="chunked:4")
    autoremat.apply(model, plan)
    out, grads, peak = _step(model, inputs)
    assert out.logits is None and peak <= plan.predicted_peak_bytes
    assert _rel(out.loss, plain.loss) <= HEAD_RTOL[torch.float32]
    largest = max(float(g.abs().max()) for g in plain_grads.values())
    for name, g in plain_grads.items():  # NOTE [ Gradients that cancel ] in _verify.py
        scale = max(float(g.abs().max()), 1e-2 * largest)
        assert float((grads[name] - g).abs().max()) <= HEAD_RTOL[torch.float32] * scale, name
    assert autoremat.verify(model, inputs, plan, repeats=1).ok
    with torch.no_grad():
        assert model(**inputs).logits.shape[-1] == VOCAB
    autoremat.remove(model)
    assert "forward" not in vars(model.get_output_embeddings())


def test_a_cross_entropy_the_head_does_not_compute_is_refused():
    layer = torch.nn.Linear(8, 50)
    install = mechanism.HeadInstall(mechanism.HeadSite("ce", "x", 50), 2, layer, layer, [])
    traced = mechanism._TracedLogits.of(torch.randn(6, 8), (), {
        "vocab": 50, "ce": mechanism._ChunkedCrossEntropy(layer, 2, install)})
    target = torch.randint(0, 50, (6,))
    assert torch.allclose(F.cross_entropy(traced.view(-1, 50), target),
                          F.cross_entropy(layer(traced._root), target))
    assert install.calls == 1
    with pytest.raises(RematError, match=r"label_smoothing=0\.1"):
        F.cross_entropy(traced, target, label_smoothing=0.1)
    with pytest.raises(RematError, match="not as rows"):
        F.cross_entropy(mechanism._TracedLogits.of(torch.randn(2, 3, 8), (), traced._state),
                        target.view(2, 3))


def test_a_model_that_fails_on_its_sliced_logits_keeps_its_head_and_says_why():
    """ProphetNet slices its n-gram streams' logits and takes ``nll_loss`` of their
    ``log_softmax``: under a chunked head that ran on the hidden states it took for
    logits and failed ("Target 83 is out of bounds"), and the profile failed with it.
    The op the head cannot follow is named instead, the head kept; the plans are exact,
    and the estimate takes its ``assert`` on values to hold (NOTE [ Checks of values on
    meta ] in _estimate/fake.py)."""
    torch.manual_seed(0)
    model = transformers.ProphetNetForConditionalGeneration(transformers.ProphetNetConfig(
        vocab_size=200, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
        num_decoder_attention_heads=4, ngram=2, max_position_embeddings=64,
        use_cache=False)).train()
    ids = torch.randint(5, 200, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    assert tape.head is None
    assert any("ran '__getitem__' on its loss head's logits" in n for n in tape.notes)
    plan = autoremat.plan(tape, smallest_feasible_bytes(tape))
    assert plan.recompute_blocks > 0
    exact(model, inputs, plan, repeats=1)
    est = autoremat.estimate(model, inputs, device="cpu", selective=False)
    assert est.step_peak_bytes == tape.step_peak_bytes
