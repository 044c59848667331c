"""House rules of the code itself: an import of project code inside a function says why it is there,
and a module over 500 lines says why on its first line (the import contracts in .importlinter, run
by `make test`, keep the layers, forbid cycles and keep HTTP at the edges; the contract type they
add is checked here too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from grimp import ImportGraph

from tests.import_contracts import forbidden_imports, imported_modules

pytestmark = pytest.mark.control

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("marketplace", "worker_agent")
MAX_LINES = 500  # a module read in one sitting
LONG_MODULE_REASON = "# Over 500 lines: "  # how a longer module's first line says why it is one module


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


def long_modules_without_reason(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Modules over MAX_LINES lines whose first line does not give the reason (generated migrations
    aside: they are written by ``makemigrations``, not read)."""
    found = []
    for path in paths:
        if "migrations" in path.relative_to(root).parts:
            continue
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not (lines and lines[0].startswith(LONG_MODULE_REASON)):
            found.append(f"{path.relative_to(root)}: {len(lines)} lines")
    return found


def test_every_module_over_500_lines_says_why_on_its_first_line():
    found = long_modules_without_reason(
        [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    )

    assert found == []


def test_the_check_finds_a_long_module_without_its_reason(tmp_path):
    body = "x = 1\n" * MAX_LINES
    (tmp_path / "short.py").write_text(body)
    (tmp_path / "long.py").write_text(body + "x = 2\n")
    (tmp_path / "explained.py").write_text(f"{LONG_MODULE_REASON}one table, read whole.\n" + body)
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "0001_initial.py").write_text(body * 2)

    found = long_modules_without_reason(sorted(tmp_path.rglob("*.py")), root=tmp_path)

    assert found == ["long.py: 501 lines"]


def test_an_import_line_names_the_modules_it_may_bring_in():
    assert imported_modules("from django.http import Http404, JsonResponse") == {
        "django.http",
        "django.http.Http404",
        "django.http.JsonResponse",
    }
    assert imported_modules("from django import http as web  # the edge") == {"django", "django.http"}
    assert imported_modules("from django.views.decorators.http import (") == {"django.views.decorators.http"}
    assert imported_modules("import django.shortcuts, channels.generic.websocket") == {
        "django.shortcuts",
        "channels.generic.websocket",
    }


def test_the_edge_contract_finds_an_http_module_imported_by_a_domain_app():
    graph = ImportGraph()
    for module in ("marketplace", "marketplace.jobs", "marketplace.jobs.views", "marketplace.jobs.models"):
        graph.add_module(module)
    graph.add_module("django", is_squashed=True)
    graph.add_import(
        importer="marketplace.jobs.models",
        imported="django",
        line_number=3,
        line_contents="from django.db import models",
    )
    graph.add_import(
        importer="marketplace.jobs.views",
        imported="django",
        line_number=7,
        line_contents="from django import http",
    )

    found = forbidden_imports(graph, ["marketplace.jobs"], ["django.http"])

    assert [(item["importer"], item["forbidden"], item["line_number"]) for item in found] == [
        ("marketplace.jobs.views", "django.http", 7)
    ]


def class_lines(path: Path, name: str) -> int:
    """Lines of class ``name`` in ``path``, decorators and docstring included."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1 + len(node.decorator_list)
    raise LookupError(f"no class {name} in {path}")


def test_the_coordinator_keeps_to_connecting_healing_and_verifying():
    # Deciding what to send is the scheduler's and doing it the engine's: the class stays small.
    assert class_lines(ROOT / "worker_agent/coordinator/job.py", "Coordinator") < 250


def test_class_lines_counts_a_class_from_its_line_to_its_end(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n\n\nclass A:\n    a = 1\n\n    def f(self):\n        return 2\n")

    assert class_lines(tmp_path / "m.py", "A") == 5
    with pytest.raises(LookupError):
        class_lines(tmp_path / "m.py", "B")
