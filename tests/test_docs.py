"""The docs run as written. Every fenced `bash` and `python` block of README.md and docs/*.md is run as a reader
would paste it, from a folder holding the repository's `examples/` and a `.venv/` of this environment; the next
`text` block after one (before the next heading) holds lines its output must hold. A block that cannot run here
(the install itself, your own data, a cluster) says why in a `<!-- not run: WHY -->` line right above it; a
`python` block that imports a module not installed here (torch) is skipped, naming it. The README's first
commands build the example once per session; the other blocks read it. And the facts the docs list once,
checked against the code."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import EXAMPLE_CACHE, QWEN3, REPO

from tokpipe.inputs.manifest import Shard, build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout import files as out_files
from tokpipe.layout.files import Layout
from tokpipe.layout.stored import StoredOut
from tokpipe.options import RunOptions
from tokpipe.runner.identity import run_identity
from tokpipe.store import Url

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A fence, indented or not (a block inside a list item), its language, its lines up to the closing fence.
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\n *\Z")


@dataclass(frozen=True)
class Block:
    where: str  # README.md:42
    language: str  # bash | python
    code: str
    not_run: str | None  # why, from the marker above it
    expected: tuple[str, ...]  # the lines of the `text` block after it, if the next block is one


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        fences = list(FENCE.finditer(text))
        for fence, after in zip(fences, [*fences[1:], None]):
            indent, language, body = fence.groups()
            if language not in ("bash", "python"):
                continue
            marker = NOT_RUN.search(text[: fence.start()])
            expected = ()
            if after is not None and after.group(2) == "text" and "\n#" not in text[fence.end() : after.start()]:
                expected = tuple(line.strip() for line in after.group(3).splitlines() if line.strip())
            code = "\n".join(line.removeprefix(indent) for line in body.splitlines())
            where = f"{doc.relative_to(REPO)}:{text.count(chr(10), 0, fence.start()) + 1}"
            found.append(Block(where, language, code, marker and marker.group(1), expected))
    return found


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.not_run is None]
FIRST = next(b for b in RUN if b.where.startswith("README.md") and b.language == "bash")  # builds the example


def _reader_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PATH": f"{folder / '.venv' / 'bin'}:{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def _run(block: Block, folder: Path) -> subprocess.CompletedProcess:
    command = ["bash", "-euo", "pipefail", "-c", block.code] if block.language == "bash" else [
        sys.executable, "-c", block.code
    ]  # fmt: skip
    return subprocess.run(command, cwd=folder, env=_reader_env(folder), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def reader(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A reader's folder: the repository's examples, `.venv/bin` with this environment's python and tokpipe;
    and in it, the example built by the README's first commands (their result, for their own test)."""
    folder = tmp_path_factory.mktemp("reader")
    (folder / "examples").symlink_to(REPO / "examples")
    bin_ = folder / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").symlink_to(sys.executable)
    (bin_ / "tokpipe").symlink_to(shutil.which("tokpipe", path=Path(sys.executable).parent))
    return folder, _run(FIRST, folder)


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_every_block_runs_as_written(reader, block):
    folder, first = reader
    if block.language == "python":
        missing = sorted(m for m in _imports(block.code) if importlib.util.find_spec(m) is None)
        if missing:
            pytest.skip(f"NOT RUN: needs {', '.join(missing)}, not installed here")
    _check(block, first if block is FIRST else _run(block, folder))


def _check(block: Block, result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{block.where} failed:\n{block.code}\n{result.stdout}\n{result.stderr}"
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert [line for line in block.expected if line not in lines] == [], f"{block.where}: lines not printed"


def _imports(code: str) -> set[str]:
    """The top-level modules a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_readme_starts_with_what_a_newcomer_runs():
    """The first blocks of the README: the install (not run here), the example's commands with the lines they
    print, the loader on that OUT with its output."""
    readme = [b for b in BLOCKS if b.where.startswith("README.md")]
    assert [(b.language, b.not_run is None) for b in readme[:3]] == [("bash", False), ("bash", True), ("python", True)]
    assert "pip install -e ." in readme[0].code and readme[1] is FIRST
    assert FIRST.expected == (
        "train: 859,703 tokens, 293 documents, 2 lines skipped (empty_text 2) -> out/example/train.bin",
        "validation: 303,964 tokens, 136 documents, 3 lines skipped (empty_text 3) -> out/example/val.bin",
        "all 33 checks hold",
    )
    assert "from tokpipe.data import Sequences" in readme[2].code
    assert readme[2].expected == ("(8, 1024) int64 151669",)


def test_the_readme_is_at_most_200_lines():
    """The README is what a newcomer reads through: what is true now, in at most 200 lines; the rest in docs/, the
    history of a figure with its commits in benchmarks/README.md."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_a_broken_block_fails(reader):
    """The check can fail: a block that exits other than 0, a line its output does not hold."""
    folder, _ = reader
    for block in [
        Block("x.md:1", "bash", "tokpipe verify out/nothing", None, ()),
        Block("x.md:1", "python", "import tokpipe\ntokpipe.open_output('out/nothing')", None, ()),
        Block("x.md:1", "bash", "echo 'all 32 checks hold'", None, ("all 33 checks hold",)),
    ]:
        with pytest.raises(AssertionError):
            _check(block, _run(block, folder))


def test_every_not_run_block_says_why():
    assert all(b.not_run.strip() for b in BLOCKS if b.not_run is not None)
    assert len(RUN) >= 5  # the README's example and loader, Parquet, the two readers of trainers.md


def test_the_glossary_lists_the_run_identity_the_code_checks():
    """glossary.md is the one list of what a run is: the keys it names are run_identity's, --group-by's too."""
    entry = (REPO / "docs" / "glossary.md").read_text().split("**run identity**")[1].split("\n\n")[0]
    listed = re.findall(r"`(\w+)`", entry.split("run.json's keys:")[1].split(")")[0])
    identity = run_identity(build_manifest(EXAMPLE_CACHE), load_tokenizer_info(QWEN3), RunOptions(group_by="meta"))
    assert listed == list(identity)


def test_design_names_every_module():
    """design.md's shape of the code names each module and package of tokpipe/."""
    design = (REPO / "docs" / "design.md").read_text().split("## Shape of the code")[1].split("```")[1]
    package = REPO / "tokpipe"
    names = {p.name for p in package.glob("*.py")} - {"__init__.py", "_version.py"}
    names |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert sorted(n for n in names if n not in design) == []


def _anchors(doc: Path) -> set[str]:
    """A page's anchors as GitHub makes them: each heading, lowercased, punctuation dropped, spaces as dashes;
    and every <a id>."""
    text = doc.read_text()
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings} | set(
        re.findall(r'<a id="([^"]+)">', text)
    )


def test_every_link_between_the_docs_leads_somewhere():
    broken = []
    for doc in [*DOCS, REPO / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"\w+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            page = (doc.parent / path).resolve() if path else doc
            if not page.exists() or (anchor and page.suffix == ".md" and anchor not in _anchors(page)):
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert broken == []


def _option_table(commands: str) -> list[tuple[list[tuple[str, str]], str]]:
    """The rows of commands.md's table under "### Options": each row's flags, as (flag, the argument it shows),
    and its default, without backticks."""
    table = commands.split("### Options\n\n")[1].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        flags, default, _ = (cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1])
        named = [flag.partition(" ")[::2] for flag in re.findall(r"`(--[^`]+)`", flags)]
        rows.append((named, default.replace("`", "")))
    return rows


def _table_disagreements(commands: str) -> list[str]:
    """Where commands.md's option table and RunOptions differ. Every field shown in `run --help` has one row that
    names its flag with its argument (_argument), and the default that RunOptions gives it (_default). No row
    names a flag that is not a field's, or one hidden from --help (`--ray-only`)."""
    fields_ = {f"--{f.name.replace('_', '-')}": f for f in dataclasses.fields(RunOptions)}
    shown = {flag for flag, f in fields_.items() if f.metadata["help"] != argparse.SUPPRESS}
    found, rows = [], _option_table(commands)
    for flags, default in rows:
        for flag, argument in flags:
            if flag not in shown:
                found.append(f"{flag}: a row, but no option of run --help")
                continue
            expected = _argument(fields_[flag])
            if argument != expected and not (expected == ANY and argument):
                found.append(f"{flag}: the row shows {argument or 'no argument'}, --help {expected or 'none'}")
            expected = _default(fields_[flag])
            if not (default == expected or fields_[flag].default is None and expected.startswith(default)):
                found.append(f"{flag}: the row's default is {default!r}, RunOptions' {expected!r}")
    named = [flag for flags, _ in rows for flag, _ in flags]
    found += [f"{flag}: no row" for flag in sorted(shown - set(named))]
    found += [f"{flag}: {named.count(flag)} rows" for flag in sorted(set(named)) if named.count(flag) > 1]
    return found


ANY = "ARG"  # a flag's argument without a metavar: the table names it (S, ADDR, TOKEN) where --help would shout


def _argument(f: dataclasses.Field) -> str:
    """The argument of a field's flag: none for a switch, its choices, its metavar, else any word (ANY)."""
    if f.default is False:
        return ""
    if "choices" in f.metadata:
        return "|".join(f.metadata["choices"])
    return f.metadata.get("metavar", ANY)


def _default(f: dataclasses.Field) -> str:
    """A field's default as the table says it: `off` for a switch; the value; where it is worked out at run time
    (None), what its help says it is (a row may say the start of it), or `none` where the help says nothing."""
    if f.default is False:
        return "off"
    if f.default is None:
        said = re.search(r"\(default: (.*)\)", f.metadata["help"])
        return said.group(1) if said else "none"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def test_the_option_table_is_run_options():
    """commands.md's option table, written by hand for its words and links, says what RunOptions defines."""
    assert _table_disagreements((REPO / "docs" / "commands.md").read_text()) == []


def test_the_option_table_check_finds_each_disagreement():
    commands = (REPO / "docs" / "commands.md").read_text()
    changed = (
        re.sub(r"^\| `--workers N` .*\n", "", commands, flags=re.M)
        .replace("| `--checkpoint-interval S` | 30 |", "| `--checkpoint-interval S` | 60 |")
        .replace("| `--text-field NAME` |", "| `--text-field FIELD` |")
        .replace("| `--skip-failed` | off |", "| `--skip-failed`, `--ray-only`, `--fast` | off |")
    )
    assert _table_disagreements(changed) == [
        "--text-field: the row shows FIELD, --help NAME",
        "--checkpoint-interval: the row's default is '60', RunOptions' '30'",
        "--ray-only: a row, but no option of run --help",
        "--fast: a row, but no option of run --help",
        "--workers: no row",
    ]


def _tree() -> list[str]:
    """The files of output-format.md's tree, one name per file: a line that starts with OUT/ names them in its first
    column (up to two spaces), each a path from OUT/ or, after a comma, a suffix (`.idx`) of the first one's name up
    to its first dot. `#` starts a line of comment; the others go on the description above them."""
    page = (REPO / "docs" / "output-format.md").read_text()
    tree = page.split("## OUT's files\n")[1].split("```\n")[1]
    names = []
    for line in tree.splitlines():
        if line.startswith("OUT/"):
            first, *more = re.split(r"\s{2,}", line)[0].split(", ")
            folder, _, name = first.rpartition("/")
            names += [first, *(f"{folder}/{name.partition('.')[0]}{suffix}" for suffix in more)]
    return names


# The sample values that stand for the tree's <placeholders> in the paths the code names.
SAMPLES = {
    **{"Split": "<split>", "Key": "<key>", "Digest": "<digest>", "Stem": "<stem>", "Group": "<group>"},
    **{"/7/": "/<n>/", "Who": "<who>"},
}


def _named_by_the_code() -> set[str]:
    """Every file name of OUT that tokpipe/layout/files.py makes, for a sample shard, split, group, ...: Layout's and
    ShardFiles' names, each log's (the module's constants: RUN_LOG, PROGRESS, ..., and any added)."""
    out, shard = Layout("OUT"), Shard(split="Split", relpath="relpath", path="path", size=0, key="Key")
    own = out.shard(shard)
    splits = [*out.assembly("Stem"), *out.assembly("Stem", "Group")[:2]]
    named = [
        *(out.run_json, out.manifest, out.lock_file, out.meta_pkl, out.meta_json, out.report),
        *(out.log(v) for k, v in vars(out_files).items() if k.isupper() and isinstance(v, str)),
        *(out.node_check(), out.node_check("Who"), out_files.stall_dump(out, shard)),
        *(own.bin, own.idx, own.checkpoint, own.lock[0], *own.part((True, None)), *own.part((False, "Group"))),
        out.placed("Split", "Digest"),
        *own.part((True, "Group")),
        *splits,
        *(path.with_suffix("") for path in splits),  # a split's files once done: the .tmp renamed away
        *out.moving_source("Stem", 7),
        *out.moving_source("Stem", 7, "Group")[:2],
        *(f"{segment}{suffix}" for segment in _segments() for suffix in (".bin", ".idx", ".json")),
        StoredOut(Url("bucket", "OUT")).index_object("Digest"),
    ]
    paths = set()
    for path in map(str, named):
        for sample, placeholder in SAMPLES.items():
            path = path.replace(sample, placeholder)
        paths.add(path)
    return paths


def _segments() -> list[str]:
    """The segments of an OUT on a store (tokpipe/layout/stored.py), as its names relative to OUT."""
    stored = StoredOut(Url("bucket", "OUT"))
    return [stored.segment("Stem", None, "Key"), stored.segment("Stem", "Group", "Key")]


def test_the_out_tree_is_every_file_the_code_names():
    """output-format.md's tree is OUT's one full list: each name tokpipe/layout/ makes is on a line of it, once, and
    each of its lines names a file the code makes."""
    tree = _tree()
    assert sorted(_named_by_the_code() - set(tree)) == []  # named by the code, on no line
    assert sorted(set(tree) - _named_by_the_code()) == []  # on a line, named by no code
    assert len(tree) == len(set(tree)) == 49


def _undescribed(out: Path) -> list[str]:
    """The files and folders of an OUT that no line of the tree describes: a file matches a name of the tree
    (a placeholder stands for one name; <n> for a number), a folder one of the folders above such a name."""
    files, folders = set(), set()
    for name in _tree():
        parts = [re.escape(p).replace("<n>", "[0-9]+") for p in name.split("/")]
        parts = [re.sub(r"<\w+>", "[^/]+", p) for p in parts]
        files.add("/".join(parts))
        folders.update("/".join(parts[:i]) for i in range(2, len(parts)))
    found = []
    for folder, subfolders, names in os.walk(out):
        here = "OUT/" + os.path.relpath(folder, out) if Path(folder) != out else "OUT"
        found += [f"{here}/{n}" for n in names if not any(re.fullmatch(f, f"{here}/{n}") for f in files)]
        found += [f"{here}/{n}/" for n in subfolders if not any(re.fullmatch(f, f"{here}/{n}") for f in folders)]
    return found


def test_every_file_of_a_run_s_out_is_on_a_line_of_the_tree(reader, finished_example, finished_grouped, killed_example):
    """A real run's OUT (the README's example, run by the CLI: its logs, its lock), and OUTs as a finished run, one
    with --group-by and a kill -9 leave them: every file and folder in them is on a line of the tree."""
    folder, _ = reader
    for out in (folder / "out" / "example", finished_example, finished_grouped, killed_example):
        assert _undescribed(out) == []
