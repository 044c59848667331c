"""MkDocs hook: the API reference's table of error codes, generated from the one table at the HTTP
edge (``HTTP_ERRORS`` in marketplace/api/errors.py) so that it says what the API answers, not what
it answered when the page was written.

The module is read as source, not imported: building the docs must not need Django's settings,
and the table is a literal (``"code": HttpError(status, type, ...)`` under group comments)."""

from __future__ import annotations

import ast
from pathlib import Path

MARKER = "<!-- error-codes -->"
SOURCE = Path("marketplace") / "api" / "errors.py"


def _constant(node: ast.expr, names: dict[str, str]) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    raise ValueError(f"{SOURCE}: HTTP_ERRORS holds a value the docs cannot read: {ast.dump(node)}")


def error_table(source: str) -> str:
    """A Markdown table of every code in ``HTTP_ERRORS``: its status, its OpenAI type, and the group
    the comment above it names."""
    tree = ast.parse(source)
    lines = source.splitlines()
    names = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign | ast.Assign)
        and isinstance(node.value, ast.Dict)
        and any(isinstance(t, ast.Name) and t.id == "HTTP_ERRORS" for t in getattr(node, "targets", [node.target]))
    )
    rows = ["| code | HTTP status | type | group |", "| --- | --- | --- | --- |"]
    group = ""
    line_seen = table.lineno
    for key, value in zip(table.keys, table.values, strict=True):
        assert key is not None and isinstance(value, ast.Call)
        for line in lines[line_seen : key.lineno - 1]:  # the comments between this entry and the last
            if line.strip().startswith("#"):
                group = line.strip().lstrip("#").strip().rstrip(".")
        line_seen = key.end_lineno or key.lineno
        status, kind = (_constant(arg, names) for arg in value.args[:2])
        public = all(not (k.arg == "public_code" and _constant(k.value, names) is False) for k in value.keywords)
        code = f"`{_constant(key, names)}`" + ("" if public else " (the body's `code` is null)")
        rows.append(f"| {code} | {status} | `{kind}` | {group} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    root = Path(config["config_file_path"]).parent
    return markdown.replace(MARKER, error_table((root / SOURCE).read_text()))
