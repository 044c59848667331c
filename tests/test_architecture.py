"""House rules of the code itself: an import of project code inside a function says why it is there
(the import contracts in .importlinter, run by `make test`, keep the layers and forbid cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.control

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("marketplace", "worker_agent")


def unexplained_function_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Function-level imports of project code with no comment on their line or above their block."""
    lines = path.read_text().splitlines()
    found = []
    for function in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if not any(name.split(".")[0] in PACKAGES for name in names):
                continue
            first = node.lineno - 1
            while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
                first -= 1  # the top of this block of imports
            if "#" in lines[node.lineno - 1] or (first > 0 and lines[first - 1].strip().startswith("#")):
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_function_level_project_import_says_why():
    found = [line for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) for line in
             unexplained_function_imports(path)]  # fmt: skip

    assert found == []


def test_the_check_finds_an_unexplained_import(tmp_path):
    module = tmp_path / "marketplace_sample.py"
    module.write_text(
        "def f():\n    from marketplace.jobs import services\n\n\n"
        "def g():\n    # Lazy: keeps torch out of start-up.\n    from worker_agent import model\n"
    )
    assert unexplained_function_imports(module, root=tmp_path) == [
        "marketplace_sample.py:2: from marketplace.jobs import services"
    ]
