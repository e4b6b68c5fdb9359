"""The package's import graph against its declared layers (see NOTE [ Layers ] below).

NOTE [ Layers ]
~~~~~~~~~~~~~~~
autoremat is built in layers, each a folder or file found by name. A module imports only
its own package and the layers below it, so a reader can learn the project bottom up:

    0  _core        errors, units, the training step, RNG, tables, ranks, the version, the
                    chunked head's numerics, JSON and file helpers (``files.py``), the
                    decision vocabulary and the names of saves (``saves.py``)
    1  _measure     the instruments: memory, allocations, timing, FLOPs, op records, block
                    discovery, optimizer state; and the Tape they produce
    2  _mechanism   checkpoint wrappers, segment hooks, selective modes (knows no Plan)
       zoo          the example models (public: ``autoremat.zoo``)
    3  _plan        pure functions of a Tape: cost model, keep-set MILP, peak model,
                    solvers, the Plan (``plan.py``) and the strategies that choose one
    4  _profile     one instrumented step -> Tape: the runs, the options measured, profile()
       _targets     "zoo name or module:function" -> (model, inputs), key=value parsing
       _guards      what an applied plan checks while the model trains (apply's hooks)
    5  _apply       Plan -> wrapped model (apply, remove)
       _estimate    fake-tensor measurement, optimizer state, doctor
       distributed  broadcast_plan (public: ``autoremat.distributed``)
    6  _verify      gradients and peak of an applied plan against the plain model
    7  _auto        the one place that composes profile, plan and apply
    8  _bench       sweeps against PyTorch's own options, reports, plots
    9  _cli         argparse only
       hf           the Hugging Face Trainer callback (public: ``autoremat.hf``; imports
                    transformers, so ``autoremat`` itself does not import it)
   10  autoremat    the public names (``__init__``)

Folder rules on top of the order (``FOLDER_RULES``): the instruments live in ``_measure``
(a ``TorchDispatchMode`` that watches ops is an instrument), ``_measure`` knows nothing of
checkpointing or planning, and nothing in ``_plan`` measures or touches the mechanism (it
never imports ``_profile`` or ``_mechanism``: the names of save-sets and keep-sets it reads
and writes are plain strings, in ``_core/saves.py``).

Every import of another autoremat module sits at the top of its file: no import inside a
function, so none can be hiding a cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import autoremat

SRC = pathlib.Path(autoremat.__file__).parent

LAYERS: dict[str, int] = {
    "autoremat._core": 0,
    "autoremat._measure": 1,
    "autoremat._mechanism": 2,
    "autoremat.zoo": 2,
    "autoremat._plan": 3,
    "autoremat._targets": 4,
    "autoremat._profile": 4,
    "autoremat._guards": 4,
    "autoremat._apply": 5,
    "autoremat._estimate": 5,
    "autoremat.distributed": 5,
    "autoremat._verify": 6,
    "autoremat._auto": 7,
    "autoremat._bench": 8,
    "autoremat._callbacks": 8,
    "autoremat._cli": 9,
    "autoremat.hf": 9,
    "autoremat.lightning": 9,
    "autoremat.__main__": 10,
    "autoremat": 10,
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layer entry a module belongs to: its package, or itself for a single file."""
    best = ""
    for name in LAYERS:
        if (module == name or module.startswith(name + ".")) and len(name) > len(best):
            best = name
    if not best:
        raise AssertionError(f"{module} is in no declared layer; add it to LAYERS")
    return best


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(imported autoremat module, line, at top level) for every import in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target]
            if target == "autoremat" or target.startswith("autoremat."):
                # `from autoremat._core import rng` imports a module, not a name
                names = [f"{target}.{a.name}" if (SRC.parent / f"{target}.{a.name}".replace(
                    ".", "/")).with_suffix(".py").exists() or (SRC.parent / f"{target}.{a.name}"
                    .replace(".", "/")).is_dir() else target for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "autoremat" or name.startswith("autoremat."):
                found.append((name, node.lineno, id(node) in top))
    return found


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    return {_module_name(p): _imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_module_is_in_a_layer() -> None:
    for module in _graph():
        _unit(module)


def test_imports_point_down() -> None:
    wrong = []
    for module, imports in _graph().items():
        unit = _unit(module)
        for target, line, _ in imports:
            other = _unit(target)
            if other != unit and LAYERS[other] >= LAYERS[unit]:
                wrong.append(f"{module}:{line} imports {target} (layer {LAYERS[other]}, "
                             f"not below {unit}'s {LAYERS[unit]})")
    assert not wrong, "\n".join(wrong)


def test_no_imports_inside_functions() -> None:
    lazy = [f"{module}:{line} imports {target} inside a function or block"
            for module, imports in _graph().items()
            for target, line, top in imports if not top]
    assert not lazy, "\n".join(lazy)


def test_no_import_cycles() -> None:
    graph = {m: {t for t, _, _ in imps if t != m} for m, imps in _graph().items()}
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                cycle = [*path[path.index(target):], target] if target in path else [module, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state.get(target) is None:
                visit(target, [*path, target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_internal_modules_are_private() -> None:
    """Only ``autoremat``, ``autoremat.zoo``, ``autoremat.hf``, ``autoremat.lightning`` and
    ``autoremat.distributed`` are public; everything else is ``_private``."""
    public = {"autoremat", "autoremat.zoo", "autoremat.hf", "autoremat.lightning",
              "autoremat.distributed"}
    exposed = [m for m in _graph() if m not in public
               and not any(part.startswith("_") for part in m.split(".")[1:])]
    assert not exposed, f"modules with a public path: {exposed}"


def test_modules_export_only_what_they_define() -> None:
    """No re-export shims: a module's ``__all__`` names what it defines; only a package's
    ``__init__`` gathers names from its modules (``autoremat`` and ``autoremat.zoo``)."""
    shims = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined: set[str] = set()
        exported: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        defined.add(target.id)
                        if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                            exported = [ast.literal_eval(e) for e in node.value.elts]
        shims += [f"{_module_name(path)}: {name}" for name in exported if name not in defined]
    assert not shims, "re-exported names: " + ", ".join(shims)


def test_autoremat_does_not_import_the_optional_hf_module() -> None:
    """``autoremat.hf`` and ``autoremat.lightning`` import optional extras (transformers,
    lightning): ``import autoremat`` must work without them, so the package's
    ``__init__`` imports neither."""
    imported = {target for target, _, _ in _imports(SRC / "__init__.py")}
    assert not {"autoremat.hf", "autoremat.lightning"} & imported


# --- one decision vocabulary -----------------------------------------------------------------
# What a block (or the loss head) does is a Decision everywhere (``_core/decisions.py``);
# its names ("keep", "recompute", ...) and the letters of version-1 files ("K", "C", "O",
# "P"; window keys "KC") appear only where JSON or a user's argument is read or written.

_DECISION_NAMES = {d.value for d in autoremat.Decision}
_LETTERS = set("KCOP") | {a + b for a in "KCOP" for b in "KCOP"}  # and window keys
_LETTER_RUNS = {"KC", "KCO", "KCOP"}  # the sets of letters a tape had (tape.modes)

# (module, function) -> why names are allowed there
_CODEC = {
    ("autoremat._core.decisions", "*"): "the vocabulary itself: names to and from Decision",
    ("autoremat._measure.tape", "_window_decision"): "reads window keys of versions 1 and 2",
    ("autoremat._measure.tape", "_window_key"): "reads window keys of versions 1 and 2",
    ("autoremat._plan.plan", "_decision_field"): "reads a plan block's decision, v1 and v2",
    ("autoremat._plan.strategies", "check_head"): "the head= argument, a name, before any work",
    ("autoremat._plan.strategies", "keeps_head"): "the head= argument, a name",
    ("autoremat._plan.strategies", "head_choices"): "the head= argument, a name, to Choices",
    ("autoremat._plan.strategies", "plan"): "compares strategy names ('offload'), not decisions",
}


def _string_decisions(source: str, module: str) -> list[str]:
    """Decisions written as strings in ``source``: a decision's name compared, used as a
    keyword value or as an option tuple ``("keep", ())``; a window letter or key
    compared, subscripted, used as a dict key or in arithmetic; "KCOP" anywhere."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if (module, function) in _CODEC or (module, "*") in _CODEC:
            return
        constants: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                constants += side.elts if isinstance(side, (ast.Tuple, ast.Set, ast.List)) \
                    else [side]
            names = _DECISION_NAMES | _LETTERS
        elif isinstance(node, ast.Subscript):
            constants, names = [node.slice], _LETTERS
        elif isinstance(node, ast.keyword):
            constants, names = [node.value], _DECISION_NAMES
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 \
                and isinstance(node.elts[1], ast.Tuple):
            constants, names = [node.elts[0]], _DECISION_NAMES
        elif isinstance(node, ast.Dict):
            constants, names = [k for k in node.keys if k is not None], _LETTERS
        elif isinstance(node, ast.BinOp):
            constants, names = [node.left, node.right], _LETTERS
        elif isinstance(node, ast.Constant):
            constants, names = [node], _LETTER_RUNS
        else:
            names = set()
        for c in constants:
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in names \
                    and (c.lineno, c.col_offset) not in seen:
                seen.add((c.lineno, c.col_offset))
                found.append(f"{module}:{c.lineno} ({function}): {c.value!r}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def test_the_decision_detector_finds_the_old_spellings() -> None:
    old = '''
def f(b, windows, mode, option, plan):
    if b.decision == "offload" or option[0] != "selective":
        return windows["KC"], windows["K" + mode], plan.head == "keep"
    wrap(b, tag="recompute")
    return [("keep", ()), {"C": 1}, mode in ("K", "C")]
'''
    found = _string_decisions(old, "m")
    assert [f.rpartition(": ")[2] for f in found] == [
        "'offload'", "'selective'", "'KC'", "'K'", "'keep'", "'recompute'", "'keep'", "'C'",
        "'K'", "'C'"], found
    assert _string_decisions("print('OK', data['selective'])\n", "m") == []
    assert _string_decisions("def g(x):\n    return x == 'keep'\n", "autoremat._core.decisions") \
        == []


def test_no_decision_is_a_string_outside_the_codec() -> None:
    found = [hit for path in sorted(SRC.rglob("*.py"))
             for hit in _string_decisions(path.read_text(), _module_name(path))]
    assert not found, "decisions written as strings (use autoremat.Decision):\n" + "\n".join(found)


# (package, packages it must not import, why): rules the layer order implies, stated so a
# change of the table cannot lift them silently.
FOLDER_RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("autoremat._core", ("autoremat._measure", "autoremat._mechanism", "autoremat._plan",
                         "autoremat._profile"), "the base knows no stage"),
    ("autoremat._measure", ("autoremat._mechanism", "autoremat._plan", "autoremat._profile"),
     "instruments know nothing of checkpointing or planning"),
    ("autoremat._plan", ("autoremat._mechanism", "autoremat._profile", "autoremat._apply",
                         "autoremat._estimate"),
     "planning is pure functions of a Tape: it never measures, wraps or applies (the names "
     "of saves are in _core/saves.py)"),
]

# Modules whose dispatch modes are not instruments, and what they are instead.
NOT_INSTRUMENTS = {
    "autoremat._estimate.fake": "kernels that let a step run on meta tensors",
    "autoremat._mechanism.selective": "modes that keep or replay op outputs in a recompute",
}


@pytest.mark.parametrize(("package", "forbidden", "why"), FOLDER_RULES,
                         ids=[rule[0] for rule in FOLDER_RULES])
def test_folder_rules(package: str, forbidden: tuple[str, ...], why: str) -> None:
    wrong = [f"{module}:{line} imports {target} ({why})"
             for module, imports in _graph().items()
             if module == package or module.startswith(package + ".")
             for target, line, _ in imports
             if any(target == f or target.startswith(f + ".") for f in forbidden)]
    assert not wrong, "\n".join(wrong)


def test_instruments_live_in_measure() -> None:
    """A ``TorchDispatchMode`` subclass watches every op of a step: an instrument, so it
    lives in ``_measure`` (``NOT_INSTRUMENTS`` lists the exceptions, with why)."""
    outside = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        if module.startswith("autoremat._measure") or module in NOT_INSTRUMENTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Name) and b.id == "TorchDispatchMode")
                    or (isinstance(b, ast.Attribute) and b.attr == "TorchDispatchMode")
                    for b in node.bases):
                outside.append(f"{module}.{node.name}")
    assert not outside, f"instruments outside _measure: {outside}"


def test_the_pipeline_folders_hold_what_they_say() -> None:
    """The instruments are in ``_measure``, the planner's cost model and MILP in ``_plan``,
    ``profile`` in ``_profile`` and the file helpers in ``_core`` (NOTE [ Layers ])."""
    expected = {
        "autoremat._measure": {"memory", "allocations", "timing", "flops", "ops", "blocks",
                               "optimizers", "tape", "regions"},
        "autoremat._plan": {"costs", "keepsets", "peak", "chain", "budget", "plan",
                            "strategies"},
        "autoremat._profile": {"runs", "options", "profile", "derive"},
        "autoremat._core": {"files", "decisions", "saves"},
    }
    for package, modules in expected.items():
        folder = SRC.parent / package.replace(".", "/")
        have = {p.stem for p in folder.glob("*.py")}
        assert modules <= have, f"{package} lacks {sorted(modules - have)}"
