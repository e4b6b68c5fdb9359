"""Held-out model builders from lucidrains' libraries and torchtune, for
``benchmarks/heldout.py`` (the thirty-fourth session's check, CHANGELOG):

    mkdir -p /tmp/wheels2 /tmp/heldout2 && cd /tmp/wheels2
    pip download -q --no-deps torchtune performer-pytorch reformer-pytorch perceiver-pytorch \
        mlp-mixer-pytorch conformer PaLM-pytorch MEGABYTE-pytorch st-moe-pytorch \
        soft-moe-pytorch local-attention rotary-embedding-torch axial-positional-embedding \
        product-key-memory mixture-of-experts block-recurrent-transformer-pytorch \
        linear-attention-transformer routing-transformer sinkhorn-transformer \
        h-transformer-1d RETRO-pytorch CoLT5-attention hyper-connections BS-RoFormer \
        native-sparse-attention-pytorch einops einx frozendict loguru torch-einops-utils \
        beartype jaxtyping x-transformers==2.31.10 vector-quantize-pytorch torchao omegaconf \
        antlr4-python3-runtime sentencepiece tiktoken blobfile wadler-lindig assoc-scan
    pip install -q --no-deps --target /tmp/heldout2 /tmp/wheels2/*.whl
    PYTHONHASHSEED=0 OMP_NUM_THREADS=1 PYTHONPATH=src:/tmp/heldout2 \
        python benchmarks/heldout.py builders benchmarks/heldout_lucidrains.py LOG [NAME ...]

``BUILDERS`` maps a name to a zero-argument function returning ``(model, inputs, loss_fn)``:
``model`` in training mode (dropout on where the library has it), ``inputs`` as autoremat's
``call_model`` passes them (a tensor: ``model(x)``; a tuple: ``model(*x)``; a dict:
``model(**x)``), ``loss_fn(output) -> scalar`` (autoremat's ``run_step`` calls it with the
model's output only, so targets are closed over), or ``None`` where the model returns its
own scalar loss. Sizes are tiny (2-4 layers, dims 32-64, sequences 32-64, batch 2); each
builder seeds torch (and Python's ``random``) itself.

Libraries and what had to be done about them (torch 2.13, CPU):

* skipped, bs_roformer's MelBandRoformer: its ``__init__`` builds a mel filter bank with
  librosa (not installed).
* skipped, titans_pytorch: ``from tensordict import TensorDict`` (not installed; TensorDict
  is the core of its neural memory, so no shim would be honest).
* skipped, memorizing_transformers_pytorch: needs ``einops_exts``, ``faiss`` and ``joblib``
  (not installed); its KNN memories search a faiss index inside forward.
* shimmed, import-only: dependencies that a library imports at module level but the
  models built here never call. Each shim is a bare module put in ``sys.modules`` only
  when the real one is not installed, and only while that library is imported
  (:func:`_import_with_shims`); any call into it raises.
  - ``linformer`` (linear_attention_transformer imports ``LinformerSelfAttention``; used
    only with ``linformer_settings``, which no builder passes);
  - ``faiss`` / ``autofaiss`` (retro_pytorch's retrieval module; the RETRO model itself
    takes pre-retrieved neighbour chunks, given here as random tokens);
  - ``PoPE_pytorch`` (bs_roformer; used only with ``use_pope=True``) and ``librosa``
    (bs_roformer's package imports MelBandRoformer, whose mel filter bank needs librosa:
    MelBandRoformer is skipped, BSRoformer built).
* aliased (:func:`_import_torchtune`): ``torchao.dtypes.nf4tensor`` -> ``torchao.quantization.quantize_.workflows.nf4.
  nf4_tensor`` (torchao 0.18 moved it; torchtune 0.6.1 imports the old path). The real
  module, not a stub; no builder quantizes.
"""
from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore")

V = 256  # vocabulary of every language model here
B = 2  # batch


# ---------------------------------------------------------------------------------------
# shims for missing import-only dependencies (see the module docstring)

def _missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


class _UnavailableModule(nn.Module):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("a shim of lr_models.py: the real package is not installed")


def _unavailable(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is a shim of lr_models.py: the real package is not "
                           f"installed")
    return fail


_SHIMS = {
    "linformer": dict(LinformerSelfAttention=_UnavailableModule),
    "faiss": {},
    "autofaiss": dict(build_index=_unavailable("autofaiss.build_index")),
    "PoPE_pytorch": dict(PoPE=_UnavailableModule,
                         flash_attn_with_pope=_unavailable("flash_attn_with_pope")),
    "librosa": {},
    "librosa.filters": dict(mel=_unavailable("librosa.filters.mel")),
}


def _import_with_shims(module: str, *shims: str):
    """``import module`` with the named import-only dependencies shimmed where they are
    not installed. The shims are in ``sys.modules`` only while the import runs (so that
    nothing else, e.g. an optional-dependency probe, ever sees them)."""
    if module in sys.modules:
        return sys.modules[module]
    added = []
    for name in shims:
        if _missing(name):
            mod = types.ModuleType(name)
            mod.__dict__.update(_SHIMS[name])
            sys.modules[name] = mod
            added.append(name)
    if "librosa" in added and "librosa.filters" in added:
        sys.modules["librosa"].filters = sys.modules["librosa.filters"]
    try:
        return importlib.import_module(module)
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _import_torchtune(module: str):
    """``import module`` (under torchtune) with ``torchao.dtypes.nf4tensor`` aliased to
    where torchao 0.18 keeps it, if the old path is missing."""
    old = "torchao.dtypes.nf4tensor"
    if old not in sys.modules and _missing(old):
        sys.modules[old] = importlib.import_module(
            "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return importlib.import_module(module)


# ---------------------------------------------------------------------------------------
# helpers

def _seed(seed: int = 0) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def _tokens(n: int = 64, batch: int = B, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n))


def _lm_loss(targets: torch.Tensor, vocab: int = V, logits_of=lambda out: out):
    """Cross-entropy of ``logits_of(output)`` (b, n, vocab) against ``targets`` (b, n)."""
    def loss_fn(out):
        logits = logits_of(out)
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    return loss_fn


def _lm_loss_plus_aux(targets: torch.Tensor, vocab: int = V):
    """For models returning ``(logits, aux_loss)``."""
    def loss_fn(out):
        logits, aux = out[0], out[1]
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)) + aux.sum()
    return loss_fn


def _ce_loss(labels: torch.Tensor, logits_of=lambda out: out):
    return lambda out: F.cross_entropy(logits_of(out), labels)


def _mse_loss(target: torch.Tensor, of=lambda out: out):
    return lambda out: F.mse_loss(of(out), target)


def _next_token(n: int = 64):
    """Inputs and shifted targets for a causal LM: ids (b, n), targets (b, n)."""
    seq = _tokens(n + 1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class _Attn(nn.Module):
    """A plain pre-norm causal self-attention block, for layers that need a trunk."""

    def __init__(self, dim: int, heads: int = 4, causal: bool = True, dropout: float = 0.1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.out = nn.Linear(dim, dim)
        self.heads, self.causal, self.dropout = heads, causal, dropout

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.)
        return x + self.out(o.transpose(1, 2).reshape(b, n, d))


class _FF(nn.Module):
    def __init__(self, dim: int, mult: int = 2):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * mult), nn.GELU(),
                                 nn.Linear(dim * mult, dim))

    def forward(self, x):
        return x + self.net(x)


# ---------------------------------------------------------------------------------------
# performer_pytorch

def performer_lm_causal():
    from performer_pytorch import PerformerLM
    _seed()
    model = PerformerLM(num_tokens=V, max_seq_len=64, dim=64, depth=2, heads=4, dim_head=16,
                        causal=True, nb_features=32, ff_dropout=0.1, attn_dropout=0.1)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def performer_ar_reversible_local():
    from performer_pytorch import AutoregressiveWrapper, PerformerLM
    _seed()
    net = PerformerLM(num_tokens=V, max_seq_len=64, dim=64, depth=3, heads=4, dim_head=16,
                      causal=True, nb_features=32, reversible=True, local_attn_heads=2,
                      local_window_size=16, ff_chunks=2, ff_glu=True, shift_tokens=True)
    model = AutoregressiveWrapper(net)
    return model.train(), _tokens(65), None


def performer_encoder_generalized():
    from performer_pytorch import Performer
    _seed()
    model = Performer(dim=64, depth=2, heads=4, dim_head=16, nb_features=32,
                      generalized_attention=True, use_rezero=True, ff_dropout=0.1)
    x = torch.randn(B, 64, 64)
    return model.train(), x, _mse_loss(torch.randn(B, 64, 64))


# ---------------------------------------------------------------------------------------
# reformer_pytorch (always reversible: ReversibleSequence of LSH attention + chunked FF)

def reformer_lm_lsh_reversible():
    """LSH attention (random rotations drawn each forward), reversible residuals: the
    blocks run under no_grad in forward and are recomputed by the library's own
    autograd Function in backward."""
    from reformer_pytorch import ReformerLM
    _seed()
    model = ReformerLM(num_tokens=V, dim=64, depth=2, max_seq_len=64, heads=4, dim_head=16,
                       bucket_size=8, n_hashes=2, ff_chunks=2, causal=True,
                       lsh_dropout=0.1, post_attn_dropout=0.1)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def reformer_lm_irreversible_pkm():
    """Reformer's irreversible path (``reverse_thres`` >= the sequence length: its
    ReversibleSequence runs the same blocks as plain residual blocks), full attention,
    local heads, a product-key-memory layer and memory key/values."""
    from reformer_pytorch import ReformerLM
    _seed()
    model = ReformerLM(num_tokens=V, dim=64, depth=3, max_seq_len=64, heads=4, dim_head=16,
                       use_full_attn=True, n_local_attn_heads=2, bucket_size=8,
                       pkm_layers=(1,), pkm_num_keys=32, num_mem_kv=2, ff_glu=True,
                       absolute_position_emb=True, reverse_thres=64)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# perceiver_pytorch (cross-attention into latents)

def perceiver_image_classifier():
    from perceiver_pytorch import Perceiver
    _seed()
    model = Perceiver(input_channels=3, input_axis=2, num_freq_bands=4, max_freq=10.,
                      depth=2, num_latents=16, latent_dim=64, cross_heads=1, latent_heads=4,
                      cross_dim_head=16, latent_dim_head=16, num_classes=10,
                      attn_dropout=0.1, ff_dropout=0.1, self_per_cross_attn=2)
    img = torch.randn(B, 16, 16, 3)
    return model.train(), img, _ce_loss(torch.tensor([1, 7]))


def perceiver_io_lm():
    from perceiver_pytorch import PerceiverLM
    _seed()
    model = PerceiverLM(num_tokens=V, dim=64, depth=2, max_seq_len=64, num_latents=16,
                        latent_dim=64, cross_heads=1, latent_heads=4, cross_dim_head=16,
                        latent_dim_head=16)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def perceiver_io_weight_tied_queries():
    from perceiver_pytorch import PerceiverIO
    _seed()
    model = PerceiverIO(dim=32, queries_dim=32, logits_dim=8, depth=3, num_latents=16,
                        latent_dim=64, cross_heads=1, latent_heads=4, cross_dim_head=16,
                        latent_dim_head=16, weight_tie_layers=True, decoder_ff=True)
    data, queries = torch.randn(B, 64, 32), torch.randn(B, 32, 32)
    inputs = {"data": data, "queries": queries}
    return model.train(), inputs, _mse_loss(torch.randn(B, 32, 8))


# ---------------------------------------------------------------------------------------
# mlp_mixer_pytorch

def mlp_mixer_image():
    from mlp_mixer_pytorch import MLPMixer
    _seed()
    model = MLPMixer(image_size=32, channels=3, patch_size=8, dim=64, depth=3,
                     num_classes=10, dropout=0.1)
    return model.train(), torch.randn(B, 3, 32, 32), _ce_loss(torch.tensor([3, 4]))


def mlp_mixer_permutator():
    from mlp_mixer_pytorch import Permutator
    _seed()
    model = Permutator(image_size=32, patch_size=8, dim=64, depth=2, num_classes=10,
                       segments=4, dropout=0.1)
    return model.train(), torch.randn(B, 3, 32, 32), _ce_loss(torch.tensor([0, 9]))


def mlp_mixer_3d_video():
    from mlp_mixer_pytorch import MLPMixer3D
    _seed()
    model = MLPMixer3D(image_size=16, time_size=4, channels=3, patch_size=8,
                       time_patch_size=2, dim=64, depth=2, num_classes=10, dropout=0.1)
    return model.train(), torch.randn(B, 3, 4, 16, 16), _ce_loss(torch.tensor([2, 5]))


# ---------------------------------------------------------------------------------------
# conformer

def conformer_encoder():
    from conformer import Conformer
    _seed()
    model = Conformer(dim=64, depth=2, dim_head=16, heads=4, ff_mult=2, conv_kernel_size=7,
                      attn_dropout=0.1, ff_dropout=0.1, conv_dropout=0.1)
    x = torch.randn(B, 64, 64)
    return model.train(), x, _mse_loss(torch.randn(B, 64, 64))


class _ConformerCTC(nn.Module):
    """Feature projection, causal conformer blocks, per-frame classifier."""

    def __init__(self):
        super().__init__()
        from conformer import ConformerBlock
        self.proj = nn.Linear(40, 64)
        self.blocks = nn.ModuleList([ConformerBlock(dim=64, dim_head=16, heads=4, ff_mult=2,
                                                    conv_kernel_size=5, conv_causal=True,
                                                    ff_dropout=0.1) for _ in range(3)])
        self.head = nn.Linear(64, 32)

    def forward(self, feats, mask):
        x = self.proj(feats)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(x)


def conformer_causal_masked():
    _seed()
    model = _ConformerCTC()
    feats = torch.randn(B, 48, 40)
    mask = torch.ones(B, 48, dtype=torch.bool)
    mask[1, 40:] = False
    labels = torch.randint(0, 32, (B, 48))
    return (model.train(), (feats, mask),
            lambda out: F.cross_entropy(out.reshape(-1, 32), labels.reshape(-1)))


# ---------------------------------------------------------------------------------------
# palm_pytorch

def palm_lm():
    from palm_pytorch import PaLM
    _seed()
    model = PaLM(dim=64, num_tokens=V, depth=3, dim_head=16, heads=4)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def palm_lite_ar_wrapper():
    from palm_pytorch.autoregressive_wrapper import AutoregressiveWrapper
    from palm_pytorch.palm_lite import PaLM
    _seed()
    model = AutoregressiveWrapper(PaLM(dim=64, num_tokens=V, depth=2, dim_head=16, heads=4))
    return model.train(), _tokens(65), None


# ---------------------------------------------------------------------------------------
# MEGABYTE_pytorch (multiscale: global patch model + local byte model)

def megabyte_two_stage():
    from MEGABYTE_pytorch import MEGABYTE
    _seed()
    model = MEGABYTE(num_tokens=V, dim=(64, 32), depth=(2, 2), max_seq_len=(8, 8),
                     dim_head=16, heads=4, attn_dropout=0.1, ff_dropout=0.1)
    return model.train(), {"ids": _tokens(64), "return_loss": True}, None


def megabyte_three_stage_relpos():
    from MEGABYTE_pytorch import MEGABYTE
    _seed()
    model = MEGABYTE(num_tokens=V, dim=(64, 48, 32), depth=(1, 1, 2), max_seq_len=(4, 4, 4),
                     dim_head=16, heads=4, rel_pos=True, pos_emb=True)
    return model.train(), {"ids": _tokens(64), "return_loss": True}, None


# ---------------------------------------------------------------------------------------
# st_moe_pytorch (ST-MoE: top-2 gating with capacity, balance and router-z losses)

class _STMoELM(nn.Module):
    def __init__(self, **moe_kwargs):
        super().__init__()
        from st_moe_pytorch import MoE, SparseMoEBlock
        self.emb = nn.Embedding(V, 64)
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(_Attn(64))
            self.layers.append(SparseMoEBlock(MoE(dim=64, num_experts=4, expert_hidden_mult=2,
                                                  **moe_kwargs),
                                              add_ff_before=True, add_ff_after=True))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, V)

    def forward(self, ids):
        x, aux = self.emb(ids), 0.
        for layer in self.layers:
            if isinstance(layer, _Attn):
                x = layer(x)
            else:
                x, total_aux, _, _ = layer(x)
                aux = aux + total_aux
        return self.head(self.norm(x)), aux


def st_moe_lm():
    _seed()
    model = _STMoELM(gating_top_n=2)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss_plus_aux(targets)


def st_moe_lm_top3_differentiable():
    _seed()
    model = _STMoELM(gating_top_n=3, differentiable_topk=True)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss_plus_aux(targets)


# ---------------------------------------------------------------------------------------
# soft_moe_pytorch

class _SoftMoEViT(nn.Module):
    def __init__(self, dynamic: bool = False):
        super().__init__()
        from soft_moe_pytorch import DynamicSlotsSoftMoE, SoftMoE
        self.patch = nn.Sequential(nn.Unfold(4, stride=4), )
        self.proj = nn.Linear(3 * 16, 64)
        self.pos = nn.Parameter(torch.randn(64, 64) * 0.02)
        layers = []
        for _ in range(2):
            layers.append(_Attn(64, causal=False))
            moe = (DynamicSlotsSoftMoE(dim=64, num_experts=4, expert_mult=2, dropout=0.1)
                   if dynamic else
                   SoftMoE(dim=64, seq_len=64, num_experts=4, expert_mult=2, dropout=0.1))
            layers.append(moe)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 10))

    def forward(self, img):
        x = self.proj(self.patch(img).transpose(1, 2)) + self.pos
        for i, layer in enumerate(self.layers):
            x = layer(x) if i % 2 == 0 else x + layer(x)
        return self.head(x.mean(1))


def soft_moe_vit():
    _seed()
    model = _SoftMoEViT()
    return model.train(), torch.randn(B, 3, 32, 32), _ce_loss(torch.tensor([1, 2]))


def soft_moe_dynamic_slots_vit():
    _seed()
    model = _SoftMoEViT(dynamic=True)
    return model.train(), torch.randn(B, 3, 32, 32), _ce_loss(torch.tensor([6, 8]))


# ---------------------------------------------------------------------------------------
# product_key_memory

class _PKMLM(nn.Module):
    def __init__(self):
        super().__init__()
        from product_key_memory import PKM
        self.emb = nn.Embedding(V, 64)
        self.layers = nn.ModuleList([_Attn(64), _FF(64), _Attn(64)])
        self.pkm = PKM(dim=64, heads=2, num_keys=16, topk=4, dim_head=32,
                       input_dropout=0.1, query_dropout=0.1, value_dropout=0.1)
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, V))

    def forward(self, ids):
        x = self.emb(ids)
        x = self.layers[0](x)
        x = self.layers[1](x)
        x = x + self.pkm(x)
        x = self.layers[2](x)
        return self.head(x)


def pkm_lm():
    _seed()
    model = _PKMLM()
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# mixture_of_experts (GShard-style top-2 with random second-expert policy)

class _GShardLM(nn.Module):
    def __init__(self, hierarchical: bool = False):
        super().__init__()
        from mixture_of_experts import HeirarchicalMoE, MoE
        self.emb = nn.Embedding(V, 64)
        self.attn = nn.ModuleList([_Attn(64), _Attn(64)])
        self.norms = nn.ModuleList([nn.LayerNorm(64), nn.LayerNorm(64)])
        make = ((lambda: HeirarchicalMoE(dim=64, num_experts=(2, 2), hidden_dim=64))
                if hierarchical else (lambda: MoE(dim=64, num_experts=4, hidden_dim=128)))
        self.moes = nn.ModuleList([make(), make()])
        self.head = nn.Linear(64, V)

    def forward(self, ids):
        x, aux = self.emb(ids), 0.
        for attn, norm, moe in zip(self.attn, self.norms, self.moes):
            x = attn(x)
            out, loss = moe(norm(x))
            x, aux = x + out, aux + loss
        return self.head(x), aux


def gshard_moe_lm():
    _seed()
    model = _GShardLM()
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss_plus_aux(targets)


def gshard_hierarchical_moe_lm():
    _seed()
    model = _GShardLM(hierarchical=True)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss_plus_aux(targets)


# ---------------------------------------------------------------------------------------
# block_recurrent_transformer_pytorch (recurrent state across blocks, XL memories)

def block_recurrent_trainer():
    from block_recurrent_transformer_pytorch import (
        BlockRecurrentTransformer,
        RecurrentTrainerWrapper,
    )
    _seed()
    net = BlockRecurrentTransformer(num_tokens=V, dim=64, depth=2, dim_head=16, heads=4,
                                    max_seq_len=32, block_width=16, num_state_vectors=16,
                                    recurrent_layers=(2,))
    model = RecurrentTrainerWrapper(net)
    return model.train(), _tokens(65), None


def block_recurrent_compressed_mem():
    from block_recurrent_transformer_pytorch import BlockRecurrentTransformer
    _seed()
    model = BlockRecurrentTransformer(num_tokens=V, dim=64, depth=2, dim_head=16, heads=4,
                                      max_seq_len=64, block_width=16, num_state_vectors=8,
                                      recurrent_layers=(1,), use_compressed_mem=True,
                                      compressed_mem_factor=2, all_layers_qk_rmsnorm=True)
    return (model.train(), {"x": _tokens(65), "return_loss": True},
            lambda out: out[0] if isinstance(out, tuple) else out)


# ---------------------------------------------------------------------------------------
# routing_transformer (k-means routed attention)

def routing_lm_causal_local():
    from routing_transformer import RoutingTransformerLM
    _seed()
    model = RoutingTransformerLM(num_tokens=V, dim=64, depth=2, max_seq_len=64, heads=4,
                                 dim_head=16, window_size=16, causal=True,
                                 n_local_attn_heads=2, local_attn_window_size=16,
                                 attn_dropout=0.1, ff_dropout=0.1,
                                 _register_kmeans_update=False)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss_plus_aux(targets)


def routing_lm_reversible_moe():
    from routing_transformer import RoutingTransformerLM
    _seed()
    model = RoutingTransformerLM(num_tokens=V, dim=64, depth=2, max_seq_len=64, heads=4,
                                 dim_head=16, window_size=16, causal=False, reversible=True,
                                 ff_chunks=2, moe_layers=(2,), moe_num_experts=4,
                                 n_local_attn_heads=1, local_attn_window_size=16,
                                 _register_kmeans_update=False)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss_plus_aux(targets)


# ---------------------------------------------------------------------------------------
# sinkhorn_transformer (sorted bucket attention)

def sinkhorn_lm_causal():
    from sinkhorn_transformer import SinkhornTransformerLM
    _seed()
    model = SinkhornTransformerLM(num_tokens=V, dim=64, heads=4, depth=2, max_seq_len=64,
                                  bucket_size=16, causal=True, attn_dropout=0.1,
                                  ff_dropout=0.1)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def sinkhorn_lm_reversible_sortcut():
    from sinkhorn_transformer import SinkhornTransformerLM
    _seed()
    model = SinkhornTransformerLM(num_tokens=V, dim=64, heads=4, depth=2, max_seq_len=64,
                                  bucket_size=16, reversible=True, n_sortcut=2,
                                  n_local_attn_heads=2, ff_chunks=2, ff_glu=True)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# h_transformer_1d (hierarchical attention)

def h_transformer_causal():
    from h_transformer_1d import HTransformer1D
    _seed()
    model = HTransformer1D(num_tokens=V, dim=64, depth=2, max_seq_len=64, heads=4,
                           dim_head=16, block_size=8, causal=True)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def h_transformer_reversible_shift():
    from h_transformer_1d import HTransformer1D
    _seed()
    model = HTransformer1D(num_tokens=V, dim=64, depth=3, max_seq_len=64, heads=4,
                           dim_head=16, block_size=8, reversible=True, shift_tokens=True)
    ids = _tokens(64)
    mask = torch.ones(B, 64, dtype=torch.bool)
    targets = _tokens(64)
    return model.train(), (ids, mask), _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# colt5_attention (conditional computation: routed heavy/light branches)

class _CoLT5LM(nn.Module):
    def __init__(self):
        super().__init__()
        from colt5_attention import ConditionalRoutedTransformerBlock
        self.emb = nn.Embedding(V, 64)
        self.blocks = nn.ModuleList([ConditionalRoutedTransformerBlock(
            dim=64, num_heavy_attn_tokens_q=16, num_heavy_attn_tokens_kv=16,
            num_heavy_ff_tokens=16, light_dim_head=16, light_heads=2, light_window_size=8,
            heavy_dim_head=16, heavy_heads=4, light_ff_mult=0.5, heavy_ff_mult=2)
            for _ in range(2)])
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, V))

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def colt5_routed_blocks():
    _seed()
    model = _CoLT5LM()
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


class _CoLT5Autoregressive(nn.Module):
    def __init__(self):
        super().__init__()
        from colt5_attention import (
            ConditionalRoutedAutoregressiveAttention,
            ConditionalRoutedFeedForward,
        )
        self.emb = nn.Embedding(V, 64)
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(ConditionalRoutedAutoregressiveAttention(
                dim=64, num_heavy_tokens_q=8, num_heavy_tokens_kv=8, light_dim_head=16,
                light_heads=2, light_window_size=8, heavy_window_size=16,
                heavy_dim_head=16, heavy_heads=2))
            self.layers.append(ConditionalRoutedFeedForward(dim=64, num_heavy_tokens=16,
                                                            light_ff_mult=0.5,
                                                            heavy_ff_mult=2))
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, V))

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def colt5_autoregressive():
    _seed()
    model = _CoLT5Autoregressive()
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


class _CoLT5Classifier(nn.Module):
    """A padded-sequence classifier of routed attention (light local + heavy routed
    branches, keys/values routed in two sets) and routed feedforwards, under a mask.
    (ConditionalRoutedCrossAttention and ConditionalRoutedViT fail in plain PyTorch in
    colt5_attention 0.11.2: a NameError and an index shape mismatch.)"""

    def __init__(self):
        super().__init__()
        from colt5_attention import ConditionalRoutedAttention, ConditionalRoutedFeedForward
        self.emb = nn.Embedding(V, 64)
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(ConditionalRoutedAttention(
                dim=64, num_heavy_tokens_q=16, num_heavy_tokens_kv=16, num_routed_kv=2,
                light_dim_head=16, light_heads=2, light_window_size=8, heavy_dim_head=16,
                heavy_heads=4, multiply_queries_by_score=True))
            self.layers.append(ConditionalRoutedFeedForward(dim=64, num_heavy_tokens=24,
                                                            light_ff_mult=0.5,
                                                            heavy_ff_mult=2))
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 5))

    def forward(self, ids, mask):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def colt5_masked_classifier():
    _seed()
    model = _CoLT5Classifier()
    ids = _tokens(64)
    mask = torch.ones(B, 64, dtype=torch.bool)
    mask[1, 48:] = False
    return model.train(), (ids, mask), _ce_loss(torch.tensor([0, 3]))


# ---------------------------------------------------------------------------------------
# hyper_connections (several residual streams mixed by learned / manifold-constrained maps)

def hyper_connections_vit():
    from hyper_connections.vit import ViT
    _seed()
    model = ViT(image_size=32, patch_size=8, num_classes=10, dim=64, depth=3, heads=4,
                mlp_dim=128, dim_head=16, dropout=0.1, num_residual_streams=4)
    return model.train(), torch.randn(B, 3, 32, 32), _ce_loss(torch.tensor([5, 0]))


class _HyperLM(nn.Module):
    """A causal LM whose attention and feedforward branches are wrapped by hyper
    connections (``streams`` residual streams, ``fracs`` fractions of the features)."""

    def __init__(self, streams: int = 4, fracs: int = 1, manifold: bool = False):
        super().__init__()
        import hyper_connections as hc
        get = (hc.mc_get_init_and_expand_reduce_stream_functions if manifold
               else hc.get_init_and_expand_reduce_stream_functions)
        init_hc, self.expand, self.reduce = get(streams, num_fracs=fracs)
        self.emb = nn.Embedding(V, 64)
        self.branches = nn.ModuleList()
        for i in range(3):
            attn = _Attn(64)
            ff = _FF(64)
            # the branch returns only its update (x + f(x) - x) so that the hyper
            # connection adds the residual
            self.branches.append(init_hc(dim=64, branch=_Delta(attn), layer_index=2 * i))
            self.branches.append(init_hc(dim=64, branch=_Delta(ff), layer_index=2 * i + 1))
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, V))

    def forward(self, ids):
        x = self.expand(self.emb(ids))
        for branch in self.branches:
            x = branch(x)
        return self.head(self.reduce(x))


class _Delta(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x) - x


def hyper_connections_lm():
    _seed()
    model = _HyperLM(streams=4)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def hyper_connections_fracs_lm():
    _seed()
    model = _HyperLM(streams=2, fracs=2)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def mhc_manifold_lm():
    _seed()
    model = _HyperLM(streams=4, manifold=True)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# native_sparse_attention_pytorch (compressed + selected + sliding-window branches)

class _NSALM(nn.Module):
    def __init__(self):
        super().__init__()
        from native_sparse_attention_pytorch import SparseAttention
        self.emb = nn.Embedding(V, 64)
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(SparseAttention(
                dim=64, dim_head=16, heads=4, kv_heads=2, sliding_window_size=8,
                compress_block_size=8, compress_block_sliding_stride=4,
                selection_block_size=8, num_selected_blocks=2, causal=True))
            self.layers.append(_FF(64))
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, V))

    def forward(self, ids):
        x = self.emb(ids)
        for i, layer in enumerate(self.layers):
            x = x + layer(x) if i % 2 == 0 else layer(x)
        return self.head(x)


def nsa_lm():
    _seed()
    model = _NSALM()
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# local_attention

def local_transformer_hyper_streams():
    from local_attention import LocalTransformer
    _seed()
    model = LocalTransformer(num_tokens=V, max_seq_len=64, dim=64, depth=2, causal=True,
                             local_attn_window_size=16, dim_head=16, heads=4,
                             attn_dropout=0.1, ff_dropout=0.1, num_residual_streams=4)
    return model.train(), {"x": _tokens(65), "return_loss": True}, None


def local_transformer_dynamic_pos_bias():
    from local_attention import LocalTransformer
    _seed()
    model = LocalTransformer(num_tokens=V, max_seq_len=64, dim=64, depth=3, causal=True,
                             local_attn_window_size=16, dim_head=16, heads=4,
                             use_dynamic_pos_bias=True, num_residual_streams=1)
    return model.train(), {"x": _tokens(65), "return_loss": True}, None


# ---------------------------------------------------------------------------------------
# linear_attention_transformer

def linear_attention_lm_causal_local():
    LinearAttentionTransformerLM = _import_with_shims(
        "linear_attention_transformer", "linformer").LinearAttentionTransformerLM
    _seed()
    model = LinearAttentionTransformerLM(num_tokens=V, dim=64, heads=4, depth=2,
                                         max_seq_len=64, causal=True, n_local_attn_heads=2,
                                         local_attn_window_size=16, ff_dropout=0.1,
                                         attn_dropout=0.1)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def linear_attention_lm_reversible_pkm():
    LinearAttentionTransformerLM = _import_with_shims(
        "linear_attention_transformer", "linformer").LinearAttentionTransformerLM
    _seed()
    model = LinearAttentionTransformerLM(num_tokens=V, dim=64, heads=4, depth=3,
                                         max_seq_len=64, causal=False, reversible=True,
                                         ff_chunks=2, pkm_layers=(2,), pkm_num_keys=16,
                                         use_rotary_emb=True, use_axial_pos_emb=False,
                                         shift_tokens=True)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------
# retro_pytorch (decoder with chunked cross-attention into retrieved neighbours)

def retro_lm():
    RETRO = _import_with_shims("retro_pytorch", "faiss", "autofaiss").RETRO
    _seed()
    model = RETRO(num_tokens=V, max_seq_len=64, chunk_size=16, enc_dim=32, enc_depth=1,
                  dec_dim=64, dec_depth=2, dec_cross_attn_layers=(2,), heads=2, dim_head=32,
                  enc_attn_dropout=0.1, dec_attn_dropout=0.1)
    seq = torch.randint(1, V, (B, 65))
    retrieved = torch.randint(1, V, (B, 4, 2, 32))  # (b, chunks, neighbours, 2 * chunk)
    return (model.train(), {"seq": seq, "retrieved": retrieved, "return_loss": True}, None)


# ---------------------------------------------------------------------------------------
# bs_roformer (band-split roformer on an STFT, hyper connections inside)

def bs_roformer_tiny():
    BSRoformer = _import_with_shims("bs_roformer", "PoPE_pytorch", "librosa",
                                    "librosa.filters").BSRoformer
    _seed()
    model = BSRoformer(dim=32, depth=1, time_transformer_depth=1, freq_transformer_depth=1,
                       freqs_per_bands=(16, 16, 16, 17), dim_head=16, heads=2,
                       flash_attn=False, num_residual_streams=2, dim_freqs_in=65,
                       stft_n_fft=128, stft_hop_length=32, stft_win_length=128,
                       mask_estimator_depth=1, multi_stft_resolutions_window_sizes=(128, 64),
                       multi_stft_hop_size=32)
    audio, target = torch.randn(B, 1024), torch.randn(B, 1024)
    return model.train(), {"raw_audio": audio, "target": target}, None


# ---------------------------------------------------------------------------------------
# torchtune (Meta's decoder builders, tiny)

def _tt(builder_path: str, **kwargs):
    module, _, name = builder_path.rpartition(".")
    return getattr(_import_torchtune(module), name)(**kwargs)


def torchtune_llama3():
    _seed()
    model = _tt("torchtune.models.llama3._component_builders.llama3", vocab_size=V,
                num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_llama2_attn_dropout():
    _seed()
    model = _tt("torchtune.models.llama2._component_builders.llama2", vocab_size=V,
                num_layers=3, num_heads=4, num_kv_heads=4, embed_dim=64, max_seq_len=64,
                attn_dropout=0.1, intermediate_dim=128)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_qwen2_tied():
    _seed()
    model = _tt("torchtune.models.qwen2._component_builders.qwen2", vocab_size=V,
                num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                max_seq_len=64, tie_word_embeddings=True)
    nn.init.normal_(model.tok_embeddings.weight, std=0.02)  # tied: N(0, 1) gives logits ~60
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_gemma():
    _seed()
    model = _tt("torchtune.models.gemma._component_builders.gemma", vocab_size=V,
                num_layers=2, num_heads=4, head_dim=16, num_kv_heads=1, embed_dim=64,
                intermediate_dim=128, max_seq_len=64)
    nn.init.normal_(model.tok_embeddings.weight, std=0.02)  # tied: N(0, 1) gives logits ~60
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_mistral():
    _seed()
    model = _tt("torchtune.models.mistral._component_builders.mistral", vocab_size=V,
                num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                max_seq_len=64)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_phi3():
    _seed()
    model = _tt("torchtune.models.phi3._component_builders.phi3", vocab_size=V,
                num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=64, intermediate_dim=128,
                max_seq_len=64)
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_lora_llama3():
    """LoRA on q/v (and the MLP): base weights frozen, only adapters train."""
    peft = _import_torchtune("torchtune.modules.peft")
    _seed()
    model = _tt("torchtune.models.llama3._component_builders.lora_llama3",
                lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                vocab_size=V, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                max_seq_len=64, lora_rank=4, lora_alpha=8., lora_dropout=0.1)
    peft.set_trainable_params(model, peft.get_adapter_params(model))
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


def torchtune_dora_mistral():
    """DoRA (magnitude-scaled LoRA) on all attention projections, base frozen."""
    peft = _import_torchtune("torchtune.modules.peft")
    _seed()
    model = _tt("torchtune.models.mistral._component_builders.lora_mistral",
                lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
                vocab_size=V, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                intermediate_dim=128, max_seq_len=64, lora_rank=4, lora_alpha=8.,
                use_dora=True)
    for module in model.modules():  # as torchtune's recipes do after loading weights
        if hasattr(module, "initialize_dora_magnitude"):
            module.initialize_dora_magnitude()
    peft.set_trainable_params(model, peft.get_adapter_params(model))
    ids, targets = _next_token(64)
    return model.train(), ids, _lm_loss(targets)


# ---------------------------------------------------------------------------------------

BUILDERS = {
    "performer_lm_causal": performer_lm_causal,
    "performer_ar_reversible_local": performer_ar_reversible_local,
    "performer_encoder_generalized": performer_encoder_generalized,
    "reformer_lm_lsh_reversible": reformer_lm_lsh_reversible,
    "reformer_lm_irreversible_pkm": reformer_lm_irreversible_pkm,
    "perceiver_image_classifier": perceiver_image_classifier,
    "perceiver_io_lm": perceiver_io_lm,
    "perceiver_io_weight_tied_queries": perceiver_io_weight_tied_queries,
    "mlp_mixer_image": mlp_mixer_image,
    "mlp_mixer_permutator": mlp_mixer_permutator,
    "mlp_mixer_3d_video": mlp_mixer_3d_video,
    "conformer_encoder": conformer_encoder,
    "conformer_causal_masked": conformer_causal_masked,
    "palm_lm": palm_lm,
    "palm_lite_ar_wrapper": palm_lite_ar_wrapper,
    "megabyte_two_stage": megabyte_two_stage,
    "megabyte_three_stage_relpos": megabyte_three_stage_relpos,
    "st_moe_lm": st_moe_lm,
    "st_moe_lm_top3_differentiable": st_moe_lm_top3_differentiable,
    "soft_moe_vit": soft_moe_vit,
    "soft_moe_dynamic_slots_vit": soft_moe_dynamic_slots_vit,
    "pkm_lm": pkm_lm,
    "gshard_moe_lm": gshard_moe_lm,
    "gshard_hierarchical_moe_lm": gshard_hierarchical_moe_lm,
    "block_recurrent_trainer": block_recurrent_trainer,
    "block_recurrent_compressed_mem": block_recurrent_compressed_mem,
    "routing_lm_causal_local": routing_lm_causal_local,
    "routing_lm_reversible_moe": routing_lm_reversible_moe,
    "sinkhorn_lm_causal": sinkhorn_lm_causal,
    "sinkhorn_lm_reversible_sortcut": sinkhorn_lm_reversible_sortcut,
    "h_transformer_causal": h_transformer_causal,
    "h_transformer_reversible_shift": h_transformer_reversible_shift,
    "colt5_routed_blocks": colt5_routed_blocks,
    "colt5_autoregressive": colt5_autoregressive,
    "colt5_masked_classifier": colt5_masked_classifier,
    "hyper_connections_vit": hyper_connections_vit,
    "hyper_connections_lm": hyper_connections_lm,
    "hyper_connections_fracs_lm": hyper_connections_fracs_lm,
    "mhc_manifold_lm": mhc_manifold_lm,
    "nsa_lm": nsa_lm,
    "local_transformer_hyper_streams": local_transformer_hyper_streams,
    "local_transformer_dynamic_pos_bias": local_transformer_dynamic_pos_bias,
    "linear_attention_lm_causal_local": linear_attention_lm_causal_local,
    "linear_attention_lm_reversible_pkm": linear_attention_lm_reversible_pkm,
    "retro_lm": retro_lm,
    "bs_roformer_tiny": bs_roformer_tiny,
    "torchtune_llama3": torchtune_llama3,
    "torchtune_llama2_attn_dropout": torchtune_llama2_attn_dropout,
    "torchtune_qwen2_tied": torchtune_qwen2_tied,
    "torchtune_gemma": torchtune_gemma,
    "torchtune_mistral": torchtune_mistral,
    "torchtune_phi3": torchtune_phi3,
    "torchtune_lora_llama3": torchtune_lora_llama3,
    "torchtune_dora_mistral": torchtune_dora_mistral,
}
