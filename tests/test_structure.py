"""The package's shape: data flows one way (no import cycle), every module reads in one sitting, and
neither `import tokpipe` nor the CLI's start pays for Ray, pyarrow, gigatoken or boto3. And the tests' own shape:
they share code through helpers.py and conftest.py's fixtures, never by importing one another."""

import ast
import re
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
                # `from tokpipe.inputs.source import batch` names a module; `... import read_batches` does not
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


# The layers, bottom up: what each package may import of tokpipe's packages (its own modules, and the
# top-level basics errors, durability, fmt, _version, always). Nothing imports upward; the readers (the read
# path, tokpipe.data and the commands) never import the write path or the runner. cli, options and
# tokpipe/__init__ sit on top and may import any layer.
LAYERS = {
    "tokpipe.inputs": set(),
    "tokpipe.layout": {"tokpipe.inputs"},
    "tokpipe.write": {"tokpipe.inputs", "tokpipe.layout"},
    "tokpipe.runner": {"tokpipe.inputs", "tokpipe.layout", "tokpipe.write", "tokpipe.options"},
    "tokpipe.read": {"tokpipe.inputs", "tokpipe.layout"},
    "tokpipe.data": {"tokpipe.layout", "tokpipe.read"},
    "tokpipe.commands": {"tokpipe.inputs", "tokpipe.layout", "tokpipe.read", "tokpipe.data"},
}
BASICS = {"tokpipe.errors", "tokpipe.durability", "tokpipe.fmt", "tokpipe.store", "tokpipe._version"}


def _layer(module: str) -> str:
    return next((layer for layer in (*LAYERS, *BASICS) if module == layer or module.startswith(layer + ".")), module)


def test_each_layer_imports_only_the_layers_below_it():
    graph = _imports()
    assert set(map(_layer, graph)) - set(LAYERS) == BASICS | {
        "tokpipe",
        "tokpipe.cli",
        "tokpipe.options",
        "tokpipe.__main__",
    }
    wrong = {
        (module, dependency)
        for module, dependencies in graph.items()
        for dependency in dependencies
        if _layer(module) in LAYERS and _layer(dependency) not in {_layer(module), *LAYERS[_layer(module)], *BASICS}
    }
    assert wrong == set()


def test_six_modules_reach_a_store_and_only_the_store_package_imports_boto3():
    """Where a path may be a URL, and where an object is read or written, each said in one module of its concern: a
    shard's path (inputs/manifest.py), a dataset listed (objects.py), a shard opened (source/), OUT on a store's objects
    (layout/stored.py), what writes them (write/stored.py), what reads its token files (read/maps.py)."""
    graph = _imports()
    outside = [m for m in graph if _layer(m) != "tokpipe.store"]
    reaching = {m for m in outside if any(_layer(d) == "tokpipe.store" for d in graph[m])}
    assert reaching == {
        "tokpipe.inputs.manifest",
        "tokpipe.inputs.objects",
        "tokpipe.inputs.source",
        "tokpipe.layout.stored",
        "tokpipe.write.stored",
        "tokpipe.read.maps",
    }
    importing = re.compile(r"^\s*(import|from) boto", re.MULTILINE)
    boto3 = {_module_name(p) for p in PACKAGE.rglob("*.py") if importing.search(p.read_text())}
    assert boto3 and {m for m in boto3 if _layer(m) != "tokpipe.store"} == set()


def test_the_readers_import_neither_the_write_path_nor_the_runner():
    graph = _imports()
    readers = [m for m in graph if _layer(m) in ("tokpipe.read", "tokpipe.data", "tokpipe.commands")]
    assert len(readers) > 10
    assert {(m, d) for m in readers for d in graph[m] if _layer(d) in ("tokpipe.write", "tokpipe.runner")} == set()


def test_no_module_over_450_lines():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_no_class_of_the_write_path_the_layout_or_the_runner_over_160_lines():
    # A class a reader holds in one sitting (issue 52): past this, its parts are classes or functions of their own.
    sizes = {
        f"{path.relative_to(PACKAGE.parent)}:{node.name}": node.end_lineno - node.lineno + 1
        for package in ("write", "layout", "runner")
        for path in (PACKAGE / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert len(sizes) > 20
    assert {name: n for name, n in sizes.items() if n > 160} == {}


def test_import_and_help_load_no_heavy_dependency():
    code = (
        "import sys, contextlib, io, tokpipe, tokpipe.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    tokpipe.cli.main(['--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    tokpipe.cli.main(['run', '--help'])\n"
        "print(sorted(m for m in ('ray', 'pyarrow', 'gigatoken', 'fastokens', 'boto3') if m in sys.modules))\n"
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


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


RECORDS = {"meta", "run", "entry", "info"}  # what the readers called meta, run.json and a split's entry


def _keys_taken(tree: ast.AST):
    """Where a module takes a string key of a record as a dict: x["key"] and x.get("key") of a name in RECORDS,
    and a layout's key ("file", "files", "groups") looked for `in` anything."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _name(node.value) in RECORDS and isinstance(node.slice, ast.Constant):
            yield node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if _name(node.func.value) in RECORDS:
                yield node
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            if getattr(node.left, "value", None) in ("file", "files", "groups"):
                yield node


def test_only_the_contract_takes_a_key_of_meta_or_run_json():
    """meta, run.json and a split's entry are records (tokpipe/layout/meta.py, run.py): no module outside
    tokpipe/layout/ takes one of their keys from a dict, nor tells a split's layout by the keys its entry has."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
        for path in PACKAGE.rglob("*.py")
        if not path.is_relative_to(PACKAGE / "layout")
        for node in _keys_taken(ast.parse(path.read_text()))
    ]
    assert found == []


def test_three_modules_touch_a_token_files_bytes():
    """The readers read a split's token files through one reader, whose file access is one module (read/maps.py:
    mapped, read, checked); the write path reads a shard's ends where it copies them (write/place.py), and an OUT
    on a store's large parts from its node's files where they are uploaded (write/segments.py)."""
    touching = {
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        for call in ast.walk(ast.parse(path.read_text()))
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
        if (_name(call.func.value), call.func.attr) in {("np", "memmap"), ("np", "fromfile"), ("_libc", "mmap")}
    }
    assert touching == {"tokpipe.read.maps", "tokpipe.write.place", "tokpipe.write.segments"}


# The tests that are of no one module: the public API (tokpipe/__init__.py's names), the docs' blocks and trees,
# this file, and a run from the manifest to verify.
NOT_OF_ONE_MODULE = {"api", "docs", "structure", "end_to_end"}


def test_each_test_file_is_named_for_the_module_or_package_it_tests():
    """tests/test_write_shard.py tests tokpipe/write/shard.py, test_layout.py the package tokpipe/layout/: a reader
    finds a module's tests by its path."""
    paths = {p.relative_to(PACKAGE).with_suffix("") for p in PACKAGE.rglob("*.py")}
    names = {"_".join(p.parts) for p in paths} | {"_".join(p.parts[:-1]) for p in paths if p.name == "__init__"}
    tests = {p.stem.removeprefix("test_") for p in Path(__file__).parent.glob("test_*.py")}
    assert sorted(tests - names - NOT_OF_ONE_MODULE) == []
