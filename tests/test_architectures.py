"""Every model that trains, planned or refused for its true reason (issue 36).

Architectures beyond the zoo and the Hugging Face set of test_estimate.py / test_layerdrop.py:
encoder-only (masked LM and a sequence classifier), decoders with ALiBi, a sliding window
and logit soft-caps, multi-latent attention with shared and routed experts, parallel
residuals, encoder-decoders, speech models that skip layers at random (LayerDrop), a
two-tower contrastive model, vision transformers and convolutions, and a diffusion
transformer written here in plain PyTorch. Each is built small from its config class (random
init, dropout on, train mode) and run through the pipeline:

1. ``profile``, once per architecture (shared by the tests below);
2. ``plan`` + ``apply`` at three budgets between the plain peak and the smallest feasible
   one, the head kept: loss and gradients ``torch.equal`` to the plain model's
   (``assert_same_step``) and the measured peak <= the predicted peak <= the budget;
3. on the models with a language-model loss head, the same with ``head="auto"``: a plan
   that chunks the head is judged as docs/loss-head.md states it (``verify``: every
   gradient within the bound for its dtype, the full logits never built);
4. ``estimate`` on meta equal to the profiled CPU step peak to the byte (plain, every
   block checkpointed, and each loss head option; NOTE [ Strides on meta ] and NOTE
   [ Losses that keep their unreduced storage ] in ``_estimate/fake.py`` made Swin and
   the DiT exact, which were 0.8% and 0.3% off), or a refusal whose message names the true
   cause and the fix (NOTE [ Why I-BERT's step cannot be estimated ]).

The models that skip layers at random are also checked on steps that skip them, and
HuBERT with its config's SpecAugment (masks drawn from numpy's RNG) through ``verify``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat import Decision, Plan, RematError, Tape
from autoremat._core.step import run_step
from autoremat._plan.strategies import smallest_feasible_bytes

from _steps import assert_same_step, exact, step

transformers = pytest.importorskip("transformers")

_VOCAB = 1000  # large enough for the loss head to matter beside two small layers
_SEQ = 32
_BATCH = 2
_DROPOUT = 0.1


# --- the batches ---------------------------------------------------------------------------


def _tokens(seq: int = _SEQ, vocab: int = _VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (_BATCH, seq), generator=torch.Generator().manual_seed(seed))


def _causal_batch() -> dict[str, Any]:
    """Two sequences as a tokenizer pads them (the second 5 tokens short), padding not
    counted in the loss."""
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _masked_lm_batch() -> dict[str, Any]:
    """A masked-LM batch: a quarter of the tokens replaced by the mask id (2) and counted."""
    ids = _tokens()
    chosen = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.25
    chosen[:, 0] = True  # at least one counted token per row
    labels = ids.masked_fill(~chosen, -100)
    return {"input_ids": ids.masked_fill(chosen, 2), "attention_mask": torch.ones_like(ids),
            "labels": labels}


def _seq2seq_batch() -> dict[str, Any]:
    return {"input_ids": _tokens(), "attention_mask": torch.ones(_BATCH, _SEQ, dtype=torch.long),
            "labels": _tokens(seq=_SEQ // 2, seed=4)}


def _images(size: int = 32, batch: int = _BATCH) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(5))


# --- the models ----------------------------------------------------------------------------

_ENCODER: dict[str, Any] = {
    "vocab_size": _VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "hidden_dropout_prob": _DROPOUT,
    "attention_probs_dropout_prob": _DROPOUT}
_DECODER: dict[str, Any] = {
    "vocab_size": _VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "attention_dropout": _DROPOUT,
    "use_cache": False}


def _roberta() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.RobertaForMaskedLM(t.RobertaConfig(**_ENCODER, max_position_embeddings=_SEQ + 2,
                                                 pad_token_id=1))
    return model, _masked_lm_batch()


def _ibert() -> tuple[nn.Module, dict[str, Any]]:
    """A RoBERTa whose activation quantizers read their running range in a Python ``if``
    (NOTE [ Why I-BERT's step cannot be estimated ])."""
    t = transformers
    model = t.IBertForMaskedLM(t.IBertConfig(**_ENCODER, max_position_embeddings=_SEQ + 2,
                                             pad_token_id=1))
    return model, _masked_lm_batch()


def _rembert() -> tuple[nn.Module, dict[str, Any]]:
    """Eager attention only, its bidirectional mask built from a mask of ones the model
    makes (no attention_mask in the batch), and Transformers' padding check on the ids:
    both read values, which estimate follows on meta."""
    t = transformers
    model = t.RemBertForMaskedLM(t.RemBertConfig(
        **_ENCODER, input_embedding_size=32, output_embedding_size=64,
        max_position_embeddings=_SEQ, pad_token_id=0))
    batch = _masked_lm_batch()
    del batch["attention_mask"]
    return model, batch


def _funnel() -> tuple[nn.Module, dict[str, Any]]:
    """Blocks in stages that pool the sequence to half its length, with the padding
    check on the ids."""
    t = transformers
    model = t.FunnelForMaskedLM(t.FunnelConfig(
        vocab_size=_VOCAB, d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[2, 2],
        num_decoder_layers=1, hidden_dropout=_DROPOUT, attention_dropout=_DROPOUT,
        pad_token_id=0))
    batch = _masked_lm_batch()
    del batch["attention_mask"]
    return model, batch


def _electra() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.ElectraForSequenceClassification(t.ElectraConfig(
        **_ENCODER, embedding_size=32, max_position_embeddings=_SEQ, num_labels=3))
    batch = _causal_batch()
    batch["labels"] = torch.tensor([0, 2])
    return model, batch


def _deberta_v2() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.DebertaV2ForMaskedLM(t.DebertaV2Config(
        **_ENCODER, max_position_embeddings=_SEQ, relative_attention=True, position_buckets=8,
        pos_att_type=["p2c", "c2p"]))
    return model, _masked_lm_batch()


def _deepseek_v3() -> tuple[nn.Module, dict[str, Any]]:
    # multi-latent attention; layer 0 dense, layer 1 one shared expert + top-2 of 4 routed
    t = transformers
    config = t.DeepseekV3Config(
        **{**_DECODER, "num_key_value_heads": 4}, moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)
    return t.DeepseekV3ForCausalLM(config), _causal_batch()


def _bloom() -> tuple[nn.Module, dict[str, Any]]:  # ALiBi position biases
    t = transformers
    model = t.BloomForCausalLM(t.BloomConfig(
        vocab_size=_VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=_DROPOUT,
        attention_dropout=_DROPOUT, use_cache=False))
    return model, _causal_batch()


def _falcon() -> tuple[nn.Module, dict[str, Any]]:  # ALiBi, multi-query, parallel attention
    t = transformers
    model = t.FalconForCausalLM(t.FalconConfig(
        vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        alibi=True, multi_query=True, parallel_attn=True, hidden_dropout=_DROPOUT,
        attention_dropout=_DROPOUT, use_cache=False))
    return model, _causal_batch()


def _deepseek_v2() -> tuple[nn.Module, dict[str, Any]]:
    # multi-latent attention without a query compression; two shared experts, top-2 of 4
    t = transformers
    config = t.DeepseekV2Config(
        **{**_DECODER, "num_key_value_heads": 4}, moe_intermediate_size=32,
        n_shared_experts=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)
    return t.DeepseekV2ForCausalLM(config), _causal_batch()


def _mamba() -> tuple[nn.Module, dict[str, Any]]:  # a state-space model, no attention
    t = transformers
    model = t.MambaForCausalLM(t.MambaConfig(vocab_size=_VOCAB, hidden_size=64, state_size=8,
                                             num_hidden_layers=2, use_cache=False))
    return model, _causal_batch()


def _gemma2() -> tuple[nn.Module, dict[str, Any]]:
    # sliding window (16) shorter than the sequence, attention and final logit soft-caps
    t = transformers
    model = t.Gemma2ForCausalLM(t.Gemma2Config(
        **_DECODER, head_dim=16, sliding_window=16, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0))
    return model, _causal_batch()


def _phi3() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.Phi3ForCausalLM(t.Phi3Config(**_DECODER, resid_pdrop=_DROPOUT,
                                           embd_pdrop=_DROPOUT, pad_token_id=0))
    return model, _causal_batch()


def _gpt_neox() -> tuple[nn.Module, dict[str, Any]]:  # parallel residual, partial rotary
    t = transformers
    config = {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}
    model = t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**config, hidden_dropout=_DROPOUT,
                                                 rotary_pct=0.5))
    return model, _causal_batch()


def _pegasus() -> tuple[nn.Module, dict[str, Any]]:  # sinusoidal positions, pre-norm
    t = transformers
    model = t.PegasusForConditionalGeneration(t.PegasusConfig(
        vocab_size=_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=_SEQ, dropout=_DROPOUT,
        attention_dropout=_DROPOUT, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    return model, _seq2seq_batch()


def _hubert() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.HubertForCTC(t.HubertConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        vocab_size=20, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        layerdrop=0.3, hidden_dropout=_DROPOUT, attention_dropout=_DROPOUT,
        mask_time_prob=0.0))  # SpecAugment draws from numpy: test_spec_augment below
    audio = torch.randn(_BATCH, 4000, generator=torch.Generator().manual_seed(6))
    labels = torch.randint(1, 20, (_BATCH, 20), generator=torch.Generator().manual_seed(7))
    return model, {"input_values": audio, "labels": labels}


def _whisper() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=_VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, d_model=64, max_source_positions=32, max_target_positions=32,
        encoder_layerdrop=0.3, decoder_layerdrop=0.3, dropout=_DROPOUT,
        attention_dropout=_DROPOUT, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, use_cache=False))
    features = torch.randn(_BATCH, 16, 64, generator=torch.Generator().manual_seed(6))
    return model, {"input_features": features, "labels": _tokens(seq=16, seed=4)}


def _patchtst() -> tuple[nn.Module, dict[str, Any]]:
    """A time-series transformer over patches of each channel, whose blocks batch-norm a
    transposed view (NOTE [ Strides on meta ]: the layout batch norm writes)."""
    t = transformers
    model = t.PatchTSTForPrediction(t.PatchTSTConfig(
        num_input_channels=3, context_length=64, patch_length=8, patch_stride=8,
        prediction_length=16, d_model=32, num_attention_heads=4, num_hidden_layers=2,
        ffn_dim=64, attention_dropout=_DROPOUT, ff_dropout=_DROPOUT))
    g = torch.Generator().manual_seed(6)
    return model, {"past_values": torch.randn(4, 64, 3, generator=g),
                   "future_values": torch.randn(4, 16, 3, generator=g)}


class _ActionLoss(nn.Module):
    """A model whose output has no loss, and the loss of its actions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: Any) -> torch.Tensor:
        return self.model(**batch).action_preds.pow(2).mean()


def _decision_transformer() -> tuple[nn.Module, dict[str, Any]]:
    """GPT-2 blocks over states, actions and returns interleaved: the model stacks the
    batch's attention mask three times and reshapes it (NOTE [ Following a mask's
    values ]: estimate follows its values there)."""
    t = transformers
    model = t.DecisionTransformerModel(t.DecisionTransformerConfig(
        state_dim=8, act_dim=3, hidden_size=64, n_layer=2, n_head=4, n_inner=128,
        max_ep_len=64, n_positions=256, resid_pdrop=_DROPOUT, attn_pdrop=_DROPOUT))
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(_BATCH, 16, dtype=torch.long)
    mask[1, :3] = 0  # a shorter episode, padded on the left
    return _ActionLoss(model), {"states": torch.randn(_BATCH, 16, 8, generator=g),
                   "actions": torch.randn(_BATCH, 16, 3, generator=g),
                   "rewards": torch.randn(_BATCH, 16, 1, generator=g),
                   "returns_to_go": torch.randn(_BATCH, 16, 1, generator=g),
                   "timesteps": torch.arange(16).expand(_BATCH, 16), "attention_mask": mask}


def _paligemma() -> tuple[nn.Module, dict[str, Any]]:
    """A vision tower whose pooling head's output the model drops (its graph freed when
    dropped), image tokens in the text, and a check that they match the image features
    (``torch_compilable_check``, on values: taken to hold on meta)."""
    t = transformers
    vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=32, patch_size=8,
                                  attention_dropout=_DROPOUT)
    text = t.GemmaConfig(**{**_DECODER, "num_key_value_heads": 1, "head_dim": 16})
    model = t.PaliGemmaForConditionalGeneration(t.PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=_VOCAB - 1,
        projection_dim=64))
    ids = _tokens().clamp(max=_VOCAB - 2)
    ids[:, :16] = _VOCAB - 1  # (32 / 8) ** 2 image tokens first
    labels = ids.masked_fill(ids == _VOCAB - 1, -100)
    return model, {"input_ids": ids, "pixel_values": _images(), "labels": labels,
                   "token_type_ids": (ids != _VOCAB - 1).long()}


def _siglip() -> tuple[nn.Module, dict[str, Any]]:  # two towers, sigmoid contrastive loss
    t = transformers
    config = t.SiglipConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 32,
                     "attention_dropout": _DROPOUT, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 4,
                       "attention_dropout": _DROPOUT})
    # eight pairs: a contrastive loss compares every image with every text of the batch
    ids = torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    return t.SiglipModel(config), {"input_ids": ids, "pixel_values": _images(batch=8),
                                   "return_loss": True}


def _vit() -> tuple[nn.Module, dict[str, Any]]:
    t = transformers
    model = t.ViTForImageClassification(t.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=32, patch_size=4, num_labels=10, hidden_dropout_prob=_DROPOUT,
        attention_probs_dropout_prob=_DROPOUT))
    return model, {"pixel_values": _images(), "labels": torch.tensor([3, 7])}


def _convnext() -> tuple[nn.Module, dict[str, Any]]:  # stochastic depth (drop path) on
    t = transformers
    model = t.ConvNextForImageClassification(t.ConvNextConfig(
        hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, image_size=64, num_labels=10,
        drop_path_rate=0.1))
    return model, {"pixel_values": _images(size=64, batch=4), "labels": torch.tensor([3, 7, 0, 1])}


def _swin() -> tuple[nn.Module, dict[str, Any]]:  # shifted windows, patch merging
    t = transformers
    model = t.SwinForImageClassification(t.SwinConfig(
        image_size=32, patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
        window_size=4, num_labels=10, hidden_dropout_prob=_DROPOUT,
        attention_probs_dropout_prob=_DROPOUT, drop_path_rate=0.1))
    return model, {"pixel_values": _images(), "labels": torch.tensor([3, 7])}


def _efficientnet() -> tuple[nn.Module, dict[str, Any]]:
    # BatchNorm in every block (a recompute must not update its statistics twice), squeeze
    # and excitation, stochastic depth
    t = transformers
    model = t.EfficientNetForImageClassification(t.EfficientNetConfig(
        image_size=32, width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=320,
        num_labels=10, drop_connect_rate=0.2))
    return model, {"pixel_values": _images(), "labels": torch.tensor([3, 7])}


# --- a diffusion transformer in plain PyTorch ----------------------------------------------


class _DiTBlock(nn.Module):
    """A DiT block: attention and MLP, each modulated (shift, scale, gate) by the
    conditioning vector through adaLN."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Dropout(dropout), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        # x: (B, N, D) tokens, c: (B, D) conditioning
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class _DiT(nn.Module):
    """A class-conditional diffusion transformer on latents: noises ``latents`` at step
    ``t`` (cosine schedule), predicts the noise and returns the MSE loss."""

    def __init__(self, size: int = 16, channels: int = 4, patch: int = 2, dim: int = 64,
                 depth: int = 2, heads: int = 4, classes: int = 10, freq_dim: int = 64,
                 steps: int = 1000, dropout: float = _DROPOUT) -> None:
        super().__init__()
        self.patch, self.channels, self.freq_dim, self.steps = patch, channels, freq_dim, steps
        self.patchify = nn.Conv2d(channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, dim) * 0.02)
        self.time = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.label = nn.Embedding(classes, dim)
        self.blocks = nn.ModuleList(_DiTBlock(dim, heads, dropout) for _ in range(depth))
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, patch * patch * channels)

    def timestep_embedding(self, t: torch.Tensor) -> torch.Tensor:
        # made without a device argument, as many DiTs write it: on the CPU here
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]  # (B, half)
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, freq_dim)

    def forward(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        alpha = torch.cos(t.float() / self.steps * math.pi / 2)[:, None, None, None]
        noisy = alpha * latents + (1 - alpha**2).sqrt() * noise
        x = self.patchify(noisy).flatten(2).transpose(1, 2) + self.pos  # (B, N, D)
        cond = self.time(self.timestep_embedding(t)) + self.label(y)  # (B, D)
        for block in self.blocks:
            x = block(x, cond)
        shift, scale = self.final_ada(cond).unsqueeze(1).chunk(2, dim=-1)
        x = self.out(self.final_norm(x) * (1 + scale) + shift)  # (B, N, p*p*C)
        p = self.patch
        x = x.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return F.mse_loss(x, noise)


def _dit() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(8)
    latents = torch.randn(_BATCH, 4, 16, 16, generator=gen)
    noise = torch.randn(_BATCH, 4, 16, 16, generator=gen)
    return _DiT(), (latents, noise, torch.tensor([10, 700]), torch.tensor([1, 4]))


def test_a_dit_whose_timestep_embedding_is_made_on_the_cpu_is_estimated() -> None:
    # the quick tier's test of this file: the sinusoidal embedding's arange and exp name no
    # device (the case estimate once refused as reading tensor values)
    torch.manual_seed(0)
    model = _DiT(size=8, dim=32, depth=2, heads=2).train()
    gen = torch.Generator().manual_seed(8)
    inputs = (torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 8, 8, generator=gen),
              torch.tensor([10, 700]), torch.tensor([1, 4]))
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == ["blocks.0", "blocks.1"]
    est = autoremat.estimate(model, inputs, device="cpu", selective=False)
    assert est.step_peak_bytes == tape.step_peak_bytes


def test_hgnet_segments_are_predicted_to_the_byte() -> None:
    """HGNetV2's stages end in a ReLU, which saves its output, the next stage's input: in
    a segment, the recomputed stage holds it past the next one's backward, where a
    checkpointed stage's window frees it (NOTE [ The peak model ]). Its segment plans
    measured over their predictions (7,272 B here; 149,792 B at 57 MiB), the smallest
    one over its budget."""
    torch.manual_seed(0)
    t = transformers
    model = t.HGNetV2ForImageClassification(t.HGNetV2Config(
        embedding_size=16, hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 2, 1],
        stem_channels=[3, 8, 16], stage_in_channels=[16, 32, 64, 96],
        stage_mid_channels=[8, 16, 24, 32], stage_out_channels=[32, 64, 96, 128],
        stage_num_blocks=[1, 1, 2, 1], stage_downsample=[False, True, True, True],
        stage_light_block=[False, False, True, True], stage_kernel_size=[3, 3, 5, 5],
        stage_numb_of_layers=[3, 3, 3, 3], num_labels=3)).train()
    inputs = {"pixel_values": _images(), "labels": torch.tensor([0, 2])}
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    for plan in (autoremat.plan(tape, None, "sqrt"),
                 autoremat.plan(tape, smallest_feasible_bytes(tape))):
        exact(model, inputs, plan, repeats=1)


# --- a VAE's middle in plain PyTorch (diffusers' layout) ----------------------------------


class _VaeResnet(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(8, channels), nn.GroupNorm(8, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class _VaeAttention(nn.Module):
    """diffusers' attention over a feature map: its output comes back channels-last
    (``transpose(-1, -2).reshape(b, c, h, w)``), and the group norm and convolution after
    it run on that layout (NOTE [ Group norm on meta ], NOTE [ Strides on meta ])."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(8, channels)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(channels, channels)
                                                        for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        o = F.scaled_dot_product_attention(self.to_q(t)[:, None], self.to_k(t)[:, None],
                                           self.to_v(t)[:, None])[:, 0]
        return (self.to_out(o).transpose(-1, -2).reshape(b, c, h, w) + x) / 1.0


class _VaeMiddle(nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList([_VaeResnet(channels), _VaeAttention(channels),
                                     _VaeResnet(channels), _VaeAttention(channels),
                                     _VaeResnet(channels)])
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.conv_out(h), x)


def test_a_vae_whose_attention_returns_channels_last_is_estimated_to_the_byte() -> None:
    """Its group norms and convolutions run on the channels-last output of its attention:
    on meta they took the CUDA kernels' layout (a copy the CPU does not make) and the
    contiguous one, and diffusers' AutoencoderKL was estimated 3.3% under its CPU step."""
    torch.manual_seed(0)
    model, x = _VaeMiddle().train(), _images(size=16)
    tape = autoremat.profile(model, x, repeats=1, timing=False, with_selective=False)
    est = autoremat.estimate(model, x, device="cpu", selective=False)
    assert (est.step_peak_bytes, est.ckpt_step_peak_bytes) == \
        (tape.step_peak_bytes, tape.ckpt_step_peak_bytes)


# --- a torchtitan-style Llama in plain PyTorch ----------------------------------------------


def _rotary(dim: int, end: int) -> torch.Tensor:
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64, as torchtitan keeps it


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


class _TitanBlock(nn.Module):
    """torchtitan's Llama block: grouped-query attention with rotary embeddings applied
    in complex numbers, SDPA, a SwiGLU feed-forward, RMSNorm."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.attention_norm(x)
        q = _rotate(self.wq(h).view(b, n, self.heads, self.head_dim), freqs_cis)
        k = _rotate(self.wk(h).view(b, n, self.kv_heads, self.head_dim), freqs_cis)
        v = self.wv(h).view(b, n, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, n, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Titan(nn.Module):
    """torchtitan's Llama layout: the layers in a ModuleDict keyed ``'0'``, ``'1'``, ...
    (``self.layers[str(layer_id)]``), the rotary table a non-persistent complex buffer
    passed to every layer, logits out (the loop takes the loss)."""

    def __init__(self, vocab: int = _VOCAB, dim: int = 64, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2, hidden: int = 160) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", _rotary(dim // heads, 2 * _SEQ), persistent=False)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(dim, heads, kv_heads, hidden)
                                     for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)).float()


def test_a_torchtitan_llama_is_planned_over_its_layers_and_estimated_from_meta() -> None:
    """Its layers are found in their ModuleDict and planned; the plans are exact and meet
    their predictions. Built on meta, as torchtitan builds it, with a loss_fn over the
    loop's own labels (NOTE [ Real tensors from outside the step ]), it is estimated to
    the CPU step's byte."""
    torch.manual_seed(0)
    model, tokens, labels = _Titan().train(), _tokens(), _tokens(seed=2)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    tape = autoremat.profile(model, tokens, loss_fn=loss_fn, repeats=1, timing=False)
    assert [b.name for b in tape.blocks] == [f"layers.{i}" for i in range(4)]
    for budget in _budgets(tape):
        plan = autoremat.plan(tape, budget)
        exact(model, tokens, plan, loss_fn=loss_fn, repeats=1)
        assert plan.predicted_peak_bytes <= budget
    with torch.device("meta"):
        on_meta = _Titan().train()
    _assert_estimated(tape, autoremat.estimate(on_meta, tokens, loss_fn=loss_fn,
                                               device="cpu", selective=False))


# --- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    head: bool  # has a loss head docs/loss-head.md says autoremat can chunk
    layerdrop: bool = False  # skips layers at random in training
    # where estimate must refuse: a pattern its message matches (the true cause and the
    # fix); None: estimated as the CPU profile measures, to the byte
    refusal: str | None = None


# NOTE [ Why I-BERT's step cannot be estimated ]
#     I-BERT's activation quantizers keep the running range of what they saw in buffers
#     the forward updates, and compare it with a Python ``if``: values of activations,
#     which no meta tensor has. HuBERT's CTC step, refused until 2026-11-29 for reading its
#     labels' values, is estimated since the batch's values are followed on meta (NOTE
#     [ Following the batch's values ] in _estimate/fake.py).
_READS_ACTIVATIONS = (r"IBertForMaskedLM cannot run on fake \(meta\) tensors: .*reads tensor "
                      r"values.* at quant_modules\.py:\d+: if self\.x_min\.min\(\) > -1\.1e-5.*"
                      r"measure it with autoremat\.profile on a real device")


ARCHS = [
    Arch("roberta-mlm", _roberta, head=True),
    Arch("rembert-eager-mask", _rembert, head=True),
    Arch("funnel-pooling", _funnel, head=True),
    Arch("electra-classifier", _electra, head=False),
    Arch("deberta-v2-mlm", _deberta_v2, head=True),
    Arch("deepseek-v3-moe-mla", _deepseek_v3, head=True),
    Arch("bloom-alibi", _bloom, head=True),
    Arch("deepseek-v2-moe-mla", _deepseek_v2, head=True),
    Arch("falcon-alibi", _falcon, head=True),
    Arch("gemma2-window-softcap", _gemma2, head=True),
    Arch("phi3", _phi3, head=True),
    Arch("gpt-neox", _gpt_neox, head=True),
    Arch("mamba", _mamba, head=True),
    Arch("pegasus", _pegasus, head=True),
    Arch("hubert-ctc-layerdrop", _hubert, head=False, layerdrop=True),
    Arch("ibert-quantizers", _ibert, head=True, refusal=_READS_ACTIVATIONS),
    Arch("whisper-layerdrop", _whisper, head=True, layerdrop=True),
    Arch("paligemma-vlm", _paligemma, head=True),
    Arch("patchtst-timeseries", _patchtst, head=False),
    Arch("decision-transformer", _decision_transformer, head=False),
    Arch("siglip", _siglip, head=False),
    Arch("vit", _vit, head=False),
    Arch("swin", _swin, head=False),
    Arch("convnext", _convnext, head=False),
    Arch("efficientnet-batchnorm", _efficientnet, head=False),
    Arch("dit", _dit, head=False),
]
_BY_NAME = {arch.name: arch for arch in ARCHS}
_HEADED = [arch.name for arch in ARCHS if arch.head]


def _build(name: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model, inputs = _BY_NAME[name].build()
    return model.train(), inputs


@pytest.fixture(scope="module")
def profiled() -> Callable[[str], tuple[nn.Module, Any, Tape]]:
    """``profiled(name)``: the model, its batch and its tape, profiled the first time it is
    asked for and shared after that (``profile`` leaves the model as it found it; each test
    removes what it applies)."""
    cache: dict[str, tuple[nn.Module, Any, Tape]] = {}

    def get(name: str) -> tuple[nn.Module, Any, Tape]:
        if name not in cache:
            model, inputs = _build(name)
            tape = autoremat.profile(model, inputs, repeats=1, timing=False)
            cache[name] = (model, inputs, tape)
        return cache[name]

    return get


def _budgets(tape: Tape, head: str | None = None) -> list[int]:
    """Three budgets from near the plain peak down to the smallest feasible one."""
    least = smallest_feasible_bytes(tape, head=head)
    peak = tape.step_peak_bytes
    assert least < peak, (least, peak)  # there is something to plan
    return [least + (peak - least) * 3 // 4, least + (peak - least) // 3, least]


def _measured_peak(model: nn.Module, inputs: Any) -> int:
    """The storage tracker's peak over one training step of ``model`` as it is."""
    with autoremat.track_memory() as mem:
        run_step(model, inputs, None)
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes


def _check_kept_head_plan(model: nn.Module, inputs: Any, plan: Plan, budget: int) -> None:
    assert plan.head.decision is Decision.KEEP
    assert plan.predicted_peak_bytes <= budget
    autoremat.apply(model, plan)
    try:
        assert_same_step(model, inputs, plan)  # loss, gradients and buffers torch.equal
        peak = _measured_peak(model, inputs)
        assert peak <= plan.predicted_peak_bytes, (budget, peak, plan.predicted_peak_bytes)
    finally:
        autoremat.remove(model)


# --- the tests -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", [arch.name for arch in ARCHS])
def test_plans_with_the_head_kept_are_exact_and_fit(name: str, profiled: Any) -> None:
    model, inputs, tape = profiled(name)
    assert len(tape.blocks) >= 2, [b.name for b in tape.blocks]
    recomputed = 0
    for budget in _budgets(tape):
        plan = autoremat.plan(tape, budget)
        recomputed += plan.recompute_blocks
        _check_kept_head_plan(model, inputs, plan, budget)
    assert recomputed > 0  # the budgets below the plain peak made it recompute something


@pytest.mark.slow
@pytest.mark.parametrize("name", _HEADED)
def test_plans_with_head_auto_keep_their_prediction(name: str, profiled: Any) -> None:
    model, inputs, tape = profiled(name)
    assert tape.head is not None, tape.notes  # a loss head autoremat knows how to chunk
    assert smallest_feasible_bytes(tape, head="auto") < smallest_feasible_bytes(tape)
    chunked = 0
    for budget in _budgets(tape, head="auto"):
        plan = autoremat.plan(tape, budget, head="auto")
        if plan.head.decision is Decision.KEEP:
            _check_kept_head_plan(model, inputs, plan, budget)
            continue
        chunked += 1
        autoremat.apply(model, plan)
        try:
            # a chunked head: gradients within the documented bound, not bitwise
            report = autoremat.verify(model, inputs, plan, repeats=1)
            assert report.ok and report.head_ok, report
            assert report.head_rel_diff is not None
            assert report.peak_bytes <= plan.predicted_peak_bytes <= budget, report
            model.zero_grad(set_to_none=True)
            out = model(**inputs)
            assert out.logits is None  # the full logits are never built
            out.loss.backward()
            model.zero_grad(set_to_none=True)
        finally:
            autoremat.remove(model)
    assert chunked > 0  # the smallest budget is only reached by chunking the head


def _assert_estimated(tape: Tape, est: autoremat.Estimate) -> None:
    """``est`` equal to the profiled CPU step peak, plain and every block checkpointed,
    with the same FLOPs and blocks."""
    for estimated, measured in ((est.step_peak_bytes, tape.step_peak_bytes),
                                (est.ckpt_step_peak_bytes, tape.ckpt_step_peak_bytes)):
        assert estimated == measured, (estimated, measured)
    assert est.step_fwd_flops == tape.step_fwd_flops
    assert est.tape is not None
    assert [b.name for b in est.tape.blocks] == [b.name for b in tape.blocks]
    # the loss head's options, which estimate measures on meta too
    assert (est.tape.head is None) == (tape.head is None)
    if tape.head is not None and est.tape.head is not None:
        assert set(est.tape.head.options) == set(tape.head.options)
        for option, measured_option in tape.head.options.items():
            estimated = est.tape.head.options[option].step_peak_bytes
            measured = measured_option.step_peak_bytes
            assert estimated == measured, (option, estimated, measured)


@pytest.mark.slow
@pytest.mark.parametrize("name", [arch.name for arch in ARCHS if arch.refusal is None])
def test_estimate_matches_the_cpu_profile(name: str, profiled: Any) -> None:
    model, inputs, tape = profiled(name)
    _assert_estimated(tape, autoremat.estimate(model, inputs, device="cpu", selective=False))


@pytest.mark.slow
@pytest.mark.parametrize("name", [arch.name for arch in ARCHS if arch.refusal is not None])
def test_estimate_refuses_for_its_true_reason(name: str, profiled: Any) -> None:
    model, inputs, _ = profiled(name)
    pattern = _BY_NAME[name].refusal
    assert pattern is not None
    with pytest.raises(RematError, match=pattern):
        autoremat.estimate(model, inputs, device="cpu", selective=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", [arch.name for arch in ARCHS if arch.layerdrop])
def test_a_plan_holds_on_steps_that_skip_layers(name: str, profiled: Any) -> None:
    """Profiled with every layer running (the largest step), the plan holds on the steps
    LayerDrop skips layers in: the same layers skipped planned and plain (same RNG), the
    same gradients, and a peak within the prediction."""
    model, inputs, tape = profiled(name)
    assert any("layerdrop" in note for note in tape.notes), tape.notes
    assert all(not b.chained for b in tape.blocks)  # no multi-block segments
    plan = autoremat.plan(tape, smallest_feasible_bytes(tape))
    assert plan.recompute_blocks > 0
    autoremat.apply(model, plan)
    ran: list[str] = []
    hooks = [model.get_submodule(b.name).register_forward_pre_hook(
        lambda module, args, name=b.name: ran.append(name)) for b in tape.blocks]
    try:
        plain = _build(name)[0]  # the same weights (seed 0), never planned
        skipped = 0
        for seed in range(4):
            ran.clear()
            planned_loss, planned = step(model, inputs, seed)
            skipped += len(set(b.name for b in tape.blocks) - set(ran))
            plain_loss, expected = step(plain, inputs, seed)
            assert torch.equal(planned_loss, plain_loss), seed
            differ = [n for n in expected if (expected[n] is None) != (planned[n] is None)
                      or (expected[n] is not None and not torch.equal(expected[n], planned[n]))]
            assert differ == [], (seed, differ[:5])
            torch.manual_seed(seed)
            assert _measured_peak(model, inputs) <= plan.predicted_peak_bytes, seed
        assert skipped > 0  # some step skipped a layer
    finally:
        for hook in hooks:
            hook.remove()
        autoremat.remove(model)


# --- SpecAugment: random masks drawn from numpy ----------------------------------------------


def _hubert_spec_augment() -> tuple[nn.Module, dict[str, Any]]:
    """HuBERT with its config's SpecAugment (mask_time_prob=0.05, the default): in training
    it masks time steps of the features, drawn from numpy's global RNG, before the encoder
    layers (outside every block)."""
    torch.manual_seed(0)
    model = transformers.HubertForCTC(transformers.HubertConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        vocab_size=20, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2))
    assert model.config.apply_spec_augment and model.config.mask_time_prob > 0
    audio = torch.randn(_BATCH, 4000, generator=torch.Generator().manual_seed(6))
    labels = torch.randint(1, 20, (_BATCH, 20), generator=torch.Generator().manual_seed(7))
    return model.train(), {"input_values": audio, "labels": labels}


def _numpy_seeded_grads(model: nn.Module, inputs: Any) -> list[torch.Tensor | None]:
    np = pytest.importorskip("numpy")
    np.random.seed(0)
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.slow
def test_profile_leaves_numpy_random_state_as_it_found_it() -> None:
    # preserved_state promises to leave no trace on the random states; SpecAugment draws
    # from numpy's
    np = pytest.importorskip("numpy")
    model, inputs = _hubert_spec_augment()
    before = np.random.get_state()
    autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    after = np.random.get_state()
    assert after[2] == before[2] and np.array_equal(after[1], before[1])


@pytest.mark.slow
def test_verify_replays_spec_augment_masks_drawn_from_numpy() -> None:
    """The plan is exact (same numpy and torch seeds: equal gradients), so verify, which
    starts both steps "from the same RNG state", must find them equal too."""
    model, inputs = _hubert_spec_augment()
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    plan = autoremat.plan(tape, smallest_feasible_bytes(tape))
    assert plan.recompute_blocks > 0
    plain = _numpy_seeded_grads(model, inputs)
    autoremat.apply(model, plan)
    try:
        planned = _numpy_seeded_grads(model, inputs)
        assert all((a is None and b is None) or (a is not None and b is not None
                                                 and torch.equal(a, b))
                   for a, b in zip(plain, planned, strict=True))
        report = autoremat.verify(model, inputs, plan, repeats=1)
        assert report.grads_equal, report
    finally:
        autoremat.remove(model)
