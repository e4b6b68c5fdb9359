"""The README and the pages under docs/: the quickstart runs, every relative link and
anchor resolves, the README names only public API, and user pages carry no tracker
history (that lives in CHANGELOG.md)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

import autoremat
from autoremat._cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USER_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED_PAGES = [*USER_PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return _FENCE.sub("", text)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", _prose(page.read_text()), re.M)}


def test_quickstart_runs() -> None:
    """The first python block of the README, as a user would paste it (it asserts
    report.ok itself: gradients equal, measured peak within the budget)."""
    code = _python_blocks(README.read_text())[0]
    scope: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md quickstart", "exec"), scope)
    plan, report = scope["plan"], scope["report"]
    assert isinstance(plan, autoremat.Plan) and isinstance(report, autoremat.Report)
    assert plan.budget_bytes is not None and report.peak_bytes <= plan.budget_bytes
    assert "verify: OK" in out.getvalue()
    autoremat.remove(scope["model"])  # type: ignore[arg-type]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_shows_the_ci_test_command() -> None:
    command = "python -m pytest -q"
    assert command in (ROOT / ".ci" / "run").read_text()
    assert any(line.startswith(command) for line in README.read_text().splitlines())


def _public(dotted: str) -> bool:
    """Whether ``autoremat.a.b`` names a public attribute (``autoremat.hf`` is read from
    its source, so that this test does not import transformers)."""
    parts = dotted.split(".")[1:]
    if any(p.startswith("_") for p in parts):
        return False
    if parts[0] == "hf":
        tree = ast.parse((ROOT / "src" / "autoremat" / "hf.py").read_text())
        names = next(ast.literal_eval(node.value) for node in tree.body
                     if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", "") == "__all__" for t in node.targets))
        return len(parts) == 1 or parts[1] in names
    obj: object = autoremat
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            try:
                obj = importlib.import_module("autoremat." + ".".join(parts[:i + 1]))
                continue
            except ImportError:
                return False
        obj = getattr(obj, part)
    return True


def test_readme_names_only_public_api() -> None:
    text = README.read_text()
    names = set(re.findall(r"\bautoremat(?:\.\w+)+", text))
    assert names, "the README names no autoremat API"
    assert not [n for n in sorted(names) if not _public(n)]
    private = re.findall(r"(?:src/autoremat|_core/|_mechanism/|_measure/|_plan/|_estimate/"
                         r"|_profile/|_bench/|_cli/|\btests/\w+\.py)", text)
    assert not private, f"the README points into private code or tests: {private}"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_carry_no_tracker_history(page: Path) -> None:
    text = page.read_text()
    assert not re.findall(r"(?i)\bissues? #?\d+|\(#\d+\)", text)
    if page.name != "status.md":  # status, with dates, lives on docs/status.md
        assert not re.findall(r"(?i)not (?:measured|done|run|tried) yet", text)


def test_cli_factory_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """As the README's command-line section says: ``module:factory`` where
    ``factory(**options)`` returns ``(model, inputs)``, ``--set`` passes the options, and
    the model returns its loss."""
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self, width):\n"
        "        super().__init__()\n"
        "        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)\n"
        "    def forward(self, x):\n"
        "        return x + self.down(torch.tanh(self.up(x)))\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, width, depth):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))\n"
        "    def forward(self, x, y):\n"
        "        for block in self.blocks:\n"
        "            x = block(x)\n"
        "        return nn.functional.mse_loss(x, y)\n"
        "def make(width=16, depth=3, batch_size=512):\n"
        "    x, y = torch.randn(batch_size, width), torch.randn(batch_size, width)\n"
        "    return Net(width, depth), (x, y)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "mymodel:make", "--set", "width=32,depth=4", "--budget", "75%",
                 "--out", "plan.json"]) == 0
    plan = autoremat.Plan.from_json(tmp_path / "plan.json")
    assert len(plan.blocks) == 4
    assert "plan written to" in capsys.readouterr().out
