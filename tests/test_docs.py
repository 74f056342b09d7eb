"""The docs run as written. Every fenced `bash` and `python` block of README.md and docs/*.md is run as a reader
would paste it, from a folder holding the repository's `examples/` and a `.venv/` of this environment; the next
`text` block after one (before the next heading) holds lines its output must hold. A block that cannot run here
(the install itself, your own data, a cluster) says why in a `<!-- not run: WHY -->` line right above it; a
`python` block that imports a module not installed here (torch) is skipped, naming it. The README's first
commands build the example once per session; the other blocks read it. And the facts the docs list once,
checked against the code."""

from __future__ import annotations

import ast
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

from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.runner.identity import run_identity

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
