"""The misuse sweep (``benchmarks/misuse_sweep.py``, issue 26): no case ends silently
wrong or in a raw error.

The quick subset (argument and command-line mistakes refused before any profile, about
a second) runs in the quick tier; the whole sweep (about 190 cases, 10-30 s) is ``slow``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_benchmark("misuse_sweep")


@pytest.fixture(autouse=True)
def _open_log_streams() -> Iterator[None]:
    """The sweep runs the command line in this process. A logging handler made while an
    earlier test's captured stderr was current (Transformers' own) writes to that closed
    stream, and logging prints a traceback for it, which the sweep takes for a raw error
    of the command line; a command line in a process of its own never sees that. Such
    handlers write to the stderr of this test while it runs."""
    handlers = [h for name in [None, *logging.root.manager.loggerDict]
                for h in logging.getLogger(name).handlers
                if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False)]
    old = [(h.stream, vars(h).pop("flush", None)) for h in handlers]  # Transformers
    for handler in handlers:  # binds flush to the stream of the time: the class's again
        handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
    try:
        yield
    finally:
        for handler, (stream, flush) in zip(handlers, old, strict=True):
            handler.stream = stream
            if flush is not None:
                handler.flush = flush  # type: ignore[method-assign]


def _bad(results: list) -> list[str]:
    return [f"{r.outcome} {r.cls}: {r.name}: {r.detail}" for r in results
            if r.outcome in ("silent", "raw")]


def test_the_quick_subset_has_no_silent_or_raw_outcome(sweep: ModuleType) -> None:
    cases = sweep.all_cases(quick=True)
    assert len(cases) >= 40
    results = sweep.run_cases(cases, verbose=False)
    assert _bad(results) == []
    assert {r.outcome for r in results} <= {"ok", "refused", "warned"}


def test_the_classifier_tells_outcomes_apart(sweep: ModuleType) -> None:
    """Each outcome from a case made to give it: the sweep's verdicts can fail."""
    import warnings

    from autoremat import RematError

    def warn() -> None:
        warnings.warn("autoremat: something is off", UserWarning, stacklevel=2)

    def wrong() -> None:
        raise sweep.Wrong("the gradients differ")

    def refuse() -> None:
        raise RematError("budget is bad")

    def crash() -> None:
        raise KeyError("inside")

    made = {"ok": lambda: None, "warned": warn, "silent": wrong, "refused": refuse,
            "raw": crash}
    for outcome, run in made.items():
        case = sweep.Case("test", outcome, run, ("budget",))
        assert sweep.classify(case).outcome == outcome
    unnamed = sweep.Case("test", "unnamed", refuse, ("max_memory",))
    assert sweep.classify(unnamed).outcome == "raw"  # a refusal that does not name it


@pytest.mark.slow
def test_the_whole_sweep_has_no_silent_or_raw_outcome(sweep: ModuleType) -> None:
    cases = sweep.all_cases()
    assert len(cases) >= 100
    results = sweep.run_cases(cases, verbose=False)
    assert _bad(results) == []
