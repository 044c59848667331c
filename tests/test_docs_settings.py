"""The manual against the code: every setting the code reads is in the settings table of
docs/operations.md (and nothing there is a setting no code reads), every request key the
inference API acts on is in the API reference's parameter table, and README.md's relative links
lead to files that exist. MkDocs (``mkdocs build --strict`` in ``make test``) checks the links
inside docs/; README.md is outside its reach, hence the check here.

The code is read as source (``ast`` for Python, the parameter expansions of the shell files), never
imported: importing settings would read the environment, not list what it may be given."""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.control

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "operations.md"
API = ROOT / "docs" / "api.md"

# The typed readers of marketplace/conf.py; their first argument is the variable's name.
ENV_HELPERS = {"env_str", "env_int", "env_float", "env_bool", "env_list"}
# Shell files that read the environment: the one-machine topology, the containers' interpolation
# from the operator's .env, and the agent's install script.
SHELL_SOURCES = ("Procfile", "docker-compose.yml", "marketplace/install/templates/install/agent.sh")
# `${NAME:-default}`, `${NAME-x}`, `${NAME:?message}`, `${NAME+set}`, `${NAME:=x}`, `${NAME}`: how
# a shell file takes a variable it may be given. Locals of the script are lower case or set in it.
SHELL_READ = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::?[-+?=]|\})")
# The system's own variables a script may lean on: not settings of this project.
SYSTEM_VARIABLES = {"HOME", "PATH"}
BACKTICKED_NAME = re.compile(r"`([A-Z][A-Z0-9_]*)`")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (``TOKEN_ENV = "SWARM_JOIN_TOKEN"``)."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return constants


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a name ``environ`` (a function's mapping of the environment)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def env_reads_in_python(source: str) -> set[str]:
    """The environment variables a Python module reads: the typed helpers' first argument, and the
    key of ``os.environ.get`` / ``os.getenv`` / ``os.environ[...]`` / ``environ.get``, given as a
    string or as a module-level string constant. ``setdefault`` writes a default for a reader
    elsewhere, so it is not a read."""
    tree = ast.parse(source)
    constants = _string_constants(tree)

    def name_of(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return constants.get(arg.id)
        return None

    names: set[str] = set()
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            environ_get = isinstance(func, ast.Attribute) and called == "get" and _is_environ(func.value)
            if called in ENV_HELPERS or called == "getenv" or environ_get:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        if key is not None and (name := name_of(key)) is not None:
            names.add(name)
    return names


def env_reads_in_shell(text: str) -> set[str]:
    """The variables a shell file (Procfile, compose file, script) takes from its environment;
    comment lines are documentation, not reads."""
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(SHELL_READ.findall(code)) - SYSTEM_VARIABLES


def settings_read_by_code(root: Path = ROOT) -> set[str]:
    names: set[str] = set()
    for package in ("marketplace", "worker_agent"):
        for path in sorted((root / package).rglob("*.py")):
            names |= env_reads_in_python(path.read_text())
    for relative in SHELL_SOURCES:
        names |= env_reads_in_shell((root / relative).read_text())
    return names


def section(markdown: str, heading: str) -> str:
    """The text under the level-2 ``heading`` up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    if match is None:
        raise AssertionError(f"no '## {heading}' section")
    return match.group(1)


def first_column_names(markdown: str) -> set[str]:
    """The backticked names in the first cell of every table row (a row may name several settings
    that work together, ``A`` / ``B``); header and separator rows name none."""
    names: set[str] = set()
    for line in markdown.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[\s:|-]*", line.strip()):
            names |= set(BACKTICKED_NAME.findall(line.split("|")[1]))
    return names


def first_column_keys(markdown: str) -> set[str]:
    """The backticked keys (lower case, as a request's JSON has them) in each row's first cell."""
    keys: set[str] = set()
    for line in markdown.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[\s:|-]*", line.strip()):
            keys |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return keys


def table_differences(code: set[str], table: set[str]) -> list[str]:
    """What a reader of the table would miss (read by the code, absent from the table) and what
    misleads them (in the table, read by no code): empty when the two agree."""
    problems = [f"read by the code, missing from the table: {name}" for name in sorted(code - table)]
    problems += [f"in the table, read by no code: {name}" for name in sorted(table - code)]
    return problems


def request_keys_in_code(source: str) -> set[str]:
    """Every key of ``REQUEST_KEYS`` in marketplace/api/request_body.py: the keys some inference
    endpoint acts on. The module builds them from set literals joined with ``|`` (some wrapped in
    ``frozenset``) and earlier names; this evaluates exactly that much."""
    tree = ast.parse(source)
    known: dict[str, set[str]] = {}

    def keys(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Set):
            return {element.value for element in node.elts if isinstance(element, ast.Constant)}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return keys(node.left) | keys(node.right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "frozenset":
            return keys(node.args[0])
        if isinstance(node, ast.Name):
            return known[node.id]
        raise AssertionError(f"REQUEST_KEYS is built in a way this reader does not follow: {ast.dump(node)}")

    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "REQUEST_KEYS":
                assert isinstance(node.value, ast.Dict)
                return set().union(*(keys(value) for value in node.value.values))
            if isinstance(node.value, (ast.Set, ast.BinOp, ast.Call)):
                with contextlib.suppress(AssertionError, KeyError):  # not a set of keys
                    known[name] = keys(node.value)
    raise AssertionError("no REQUEST_KEYS in the module")


def test_every_setting_the_code_reads_is_in_the_operations_settings_table():
    table = first_column_names(section(OPERATIONS.read_text(), "Settings"))
    assert table_differences(settings_read_by_code(), table) == []


def test_the_collector_finds_reads_of_every_form_and_only_reads():
    source = """
import os
from marketplace.conf import env_int
TOKEN_ENV = "FROM_A_CONSTANT"
A = env_int("TYPED_HELPER", 3, minimum=1)
B = os.environ.get("ENVIRON_GET", "")
C = os.getenv("GETENV")
D = os.environ["SUBSCRIPT"]
def read(environ):
    return environ.get(TOKEN_ENV)
os.environ.setdefault("ONLY_A_DEFAULT", "1")
os.environ["WRITTEN"] = "1"
"""
    assert env_reads_in_python(source) == {"TYPED_HELPER", "ENVIRON_GET", "GETENV", "SUBSCRIPT", "FROM_A_CONSTANT"}
    shell = '# ${IN_A_COMMENT:-x}\nweb: run --port ${PORT_SETTING:-8000} --dir "${HOME:?}" ${local_var:-x} $PLAIN\n'
    assert env_reads_in_shell(shell) == {"PORT_SETTING"}
    # The real tree: a typed helper in settings.py, a constant in joining.py, os.environ.get in
    # checkpoints.py and metrics.py, the install script and the Procfile.
    read = settings_read_by_code()
    assert {"DATABASE_URL", "SWARM_JOIN_TOKEN", "SWARM_MODEL_CACHE", "PROMETHEUS_MULTIPROC_DIR"} <= read
    assert {"SWARM_TORCH_INDEX", "SWARM_RELAY_PORT", "TOKEN_1"} <= read
    assert "DJANGO_SETTINGS_MODULE" not in read  # only ever set as a default


def test_a_table_missing_a_setting_fails_the_comparison():
    markdown = (
        "## Settings\n\n| variable | default | meaning |\n| --- | --- | --- |\n"
        "| `DATABASE_URL` | unset | the database |\n| `SWARM_A` / `SWARM_B` | `1` / `2` | a pair, `NOT_A_NAME` here |\n"
        "\n## Metrics\n\n| series | meaning |\n| --- | --- |\n| `OUTSIDE_THE_SECTION` | ignored |\n"
    )
    table = first_column_names(section(markdown, "Settings"))
    assert table == {"DATABASE_URL", "SWARM_A", "SWARM_B"}
    assert table_differences({"DATABASE_URL", "SWARM_A", "SWARM_B"}, table) == []
    assert table_differences({"DATABASE_URL", "SWARM_A", "SWARM_B", "REDIS_URL"}, table) == [
        "read by the code, missing from the table: REDIS_URL"
    ]
    assert table_differences({"DATABASE_URL", "SWARM_A"}, table) == ["in the table, read by no code: SWARM_B"]


def test_every_request_key_the_api_acts_on_is_in_the_parameter_table():
    code = request_keys_in_code((ROOT / "marketplace" / "api" / "request_body.py").read_text())
    assert {"model", "messages", "prompt", "speculation", "provider", "tools"} <= code  # the reader reads
    table = first_column_keys(section(API.read_text(), "Request parameters"))
    assert table_differences(code, table) == []


def test_readme_links_lead_to_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in MARKDOWN_LINK.findall(readme) if not re.match(r"[a-z]+:|#", t)]
    assert any(t.startswith("docs/") for t in targets)  # the front door leads into the manual
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []
