"""The package's shape: data flows one way (no import cycle), every module reads in one sitting, and
neither `import tokpipe` nor the CLI's start pays for Ray, pyarrow or gigatoken. And the tests' own shape:
they share code through helpers.py and conftest.py's fixtures, never by importing one another."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tokpipe"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """tokpipe module -> the tokpipe modules it imports, anywhere in it (lazy imports count too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokpipe"):
                # `from tokpipe.source import batch` names a module; `from tokpipe.source import read_batches` does not
                found.update(
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                )
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("tokpipe"))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycle():
    graph = _imports()
    visiting, done = [], set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(module) :] + [module])}"
        visiting.append(module)
        for dependency in sorted(graph[module]):
            visit(dependency)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert len(done) == len(graph) > 20


def test_no_module_over_450_lines():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_import_and_help_load_no_heavy_dependency():
    code = (
        "import sys, contextlib, io, tokpipe, tokpipe.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    tokpipe.cli.main(['--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    tokpipe.cli.main(['run', '--help'])\n"
        "print(sorted(m for m in ('ray', 'pyarrow', 'gigatoken', 'fastokens') if m in sys.modules))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_tests_share_code_through_helpers_and_conftest_only():
    tests = Path(__file__).resolve().parent
    imported = {
        (path.name, node.module if isinstance(node, ast.ImportFrom) else alias.name)
        for path in tests.glob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert {(name, module) for name, module in imported if module and module.startswith(("test_", "conftest"))} == set()


def test_the_reference_in_helpers_imports_nothing_of_tokpipe():
    # helpers.py: the independent reference first, then the ways the tests drive tokpipe, below this line.
    source = (Path(__file__).resolve().parent / "helpers.py").read_text()
    [line] = [i for i, text in enumerate(source.splitlines(), 1) if text.startswith("# -- tokpipe as a user runs it")]
    above = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno < line
        for alias in node.names
    }
    assert above and not [m for m in above if m and m.split(".")[0] == "tokpipe"]
