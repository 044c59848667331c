"""An import-linter contract type for what the built-in ``forbidden`` type cannot name: a submodule
of an outside package (``django.http``, ``channels.generic``).

import-linter keeps each outside package as one node of its graph (``django``), so its ``forbidden``
contracts take only whole outside packages. This contract reads the lines of the direct imports of
such a package by the source modules and their descendants, and is broken by any that imports a
forbidden submodule or one below it (``from django.http import ...``, ``from django import http``,
``import django.views.decorators.http``). ``.importlinter`` registers it as ``forbidden_submodules``;
``tests/test_architecture.py`` checks its check (``forbidden_imports``) on a graph of its own.
"""

from __future__ import annotations

import re

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output

FROM_IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+\(?\s*([\w\s,]*)")
PLAIN_IMPORT = re.compile(r"^\s*import\s+([\w.,\s]+?)(?:\s+as\s+\w+)?\s*(?:#.*)?$")


def imported_modules(line: str) -> set[str]:
    """The modules one import line may bring in: the module it names, and for ``from M import a, b``
    also ``M.a`` and ``M.b`` (each may be a submodule). The first line of a parenthesised import
    names its module and the names on that line."""
    found = FROM_IMPORT.match(line)
    if found:
        module, names = found.groups()
        return {module} | {f"{module}.{name.split()[0]}" for name in names.split(",") if name.split()}
    found = PLAIN_IMPORT.match(line)
    if found:
        return {name.split()[0] for name in found.group(1).split(",") if name.split()}
    return set()


def forbidden_in(line: str, forbidden: list[str]) -> str | None:
    """The forbidden module (or the one above it) that ``line`` imports, or None."""
    for module in sorted(imported_modules(line)):
        for name in forbidden:
            if module == name or module.startswith(name + "."):
                return name
    return None


def forbidden_imports(graph: ImportGraph, sources: list[str], forbidden: list[str]) -> list[dict]:
    """Each direct import of a ``forbidden`` module by a module of ``sources`` or below them: the
    importer, the forbidden module and the import's line."""
    packages = {name.split(".")[0] for name in forbidden}
    found = []
    for source in sources:
        for importer in sorted({source} | graph.find_descendants(source)):
            for package in sorted(packages & graph.find_modules_directly_imported_by(importer)):
                for detail in graph.get_import_details(importer=importer, imported=package):
                    name = forbidden_in(detail["line_contents"], forbidden)
                    if name is not None:
                        found.append({"importer": importer, "forbidden": name, **detail})
    return found


class ForbiddenSubmodulesContract(Contract):
    """The source modules and their descendants import none of the forbidden submodules of outside
    packages, directly (an outside package's own imports are not in the graph)."""

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources = [module.name for module in self.source_modules]
        found = forbidden_imports(graph, sources, list(self.forbidden_modules))
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for item in check.metadata["found"]:
            output.print_error(
                f"{item['importer']} imports {item['forbidden']} "
                f"(l.{item['line_number']}: {item['line_contents'].strip()})",
                bold=False,
            )
            output.new_line()
