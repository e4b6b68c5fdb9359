"""Built-in models with sample batches, for demos, tests and benchmarks.

Four small models in plain PyTorch, each sized so that one forward+backward step at the
defaults takes well under a second on two CPU cores:

==========  =============================================================================
``gpt2``    GPT-2-style decoder (nanoGPT-like): learned positions, pre-LN, tied lm_head.
``llama``   Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.
``mlp``     A deep chain of Linear blocks with uneven widths, mixed GELU/ReLU and LayerNorm.
``resnet``  A small CIFAR-sized ResNet with BatchNorm and strided downsampling.
==========  =============================================================================

Every model returns an :class:`LMOutput` (``logits`` and ``loss``; ``loss`` is ``None``
without targets) and keeps its repeated blocks in one container a planner can find:
``model.blocks`` (gpt2, mlp), ``model.layers`` (llama), ``model.stages`` (resnet).

Each model and its config live in a file of their own (``_gpt2.py``, ``_llama.py``,
``_mlp.py``, ``_resnet.py``), the registry and :func:`build` in ``_registry.py``; import
them from here.

Example:
    >>> model, inputs = build("gpt2", n_layer=2, batch_size=2, seq_len=16)
    >>> out = model(**inputs)
    >>> tuple(out.logits.shape), out.loss.ndim
    ((2, 16, 1024), 0)
    >>> len(model.blocks)
    2
"""

from __future__ import annotations

from autoremat.zoo._common import LMOutput
from autoremat.zoo._gpt2 import GPT, GPTConfig
from autoremat.zoo._hf import hf_gpt2
from autoremat.zoo._llama import Llama, LlamaConfig
from autoremat.zoo._mlp import MLPChain, MLPConfig
from autoremat.zoo._registry import ZOO, ZooEntry, build, names
from autoremat.zoo._resnet import ResNet, ResNetConfig

__all__ = [
    "GPT",
    "ZOO",
    "GPTConfig",
    "LMOutput",
    "Llama",
    "LlamaConfig",
    "MLPChain",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "ZooEntry",
    "build",
    "hf_gpt2",
    "names",
]
