"""Optional dependencies, checked before a command does any work.

A command that needs an extra (matplotlib for ``--plot``, transformers for ``--hf`` and
the Hugging Face targets) says so, with the command that installs it, before it builds
or measures anything: not after a minute of estimating.
"""

from __future__ import annotations

import importlib.util

from autoremat._core.errors import RematError

__all__ = ["installed", "require", "require_for_target"]

# the module each extra of pyproject.toml's [project.optional-dependencies] provides
_EXTRA_OF = {"matplotlib": "plot", "transformers": "hf"}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; nothing is imported)."""
    return importlib.util.find_spec(module) is not None


def require(module: str, why: str) -> None:
    """Refuse, naming the install command, when ``module`` is missing.

    Example:
        >>> require("math", "--anything")
    """
    if not installed(module):
        extra = _EXTRA_OF.get(module)
        how = f"pip install 'autoremat[{extra}]'" if extra else f"pip install {module}"
        raise RematError(f"{why} needs {module}, which is not installed here: {how}")


def require_for_target(target: str) -> None:
    """The zoo's Hugging Face targets (``autoremat.zoo:hf_gpt2``) need transformers."""
    if target.startswith("autoremat.zoo:hf_"):
        require("transformers", f"target {target}")
