"""One name, one function: no two modules of autoremat export different functions under
the same name (three ``measure_step`` functions returning three types did)."""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict

import autoremat


def test_no_two_modules_export_different_functions_under_one_name() -> None:
    defined: dict[str, set[str]] = defaultdict(set)
    for info in pkgutil.walk_packages(autoremat.__path__, "autoremat."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if callable(obj) and hasattr(obj, "__qualname__"):
                defined[name].add(f"{obj.__module__}.{obj.__qualname__}")
    clashes = {name: sorted(where) for name, where in defined.items() if len(where) > 1}
    # one exception, by design: each framework's integration module names its callback
    # the way that framework's users look for it (autoremat.hf, autoremat.lightning)
    assert clashes.pop("AutorematCallback", None) == sorted(_CALLBACKS)
    assert clashes == {}


_CALLBACKS = {"autoremat.hf.AutorematCallback", "autoremat.lightning.AutorematCallback"}
