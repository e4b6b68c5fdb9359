"""The misuse sweep (``benchmarks/misuse_sweep.py``, issue 26): no case ends silently
wrong or in a raw error.

The quick subset (argument and command-line mistakes refused before any profile, about
a second) runs in the quick tier; the whole sweep (about 190 cases, 10-30 s) is ``slow``.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_benchmark("misuse_sweep")


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
