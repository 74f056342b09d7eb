"""OUT by name and by change: Layout, every name of its files (package docstring: the tree) and what a reader asks
of it; LayoutWriter, every change of its state (the lock, the finished marker, the split files' .tmp names and parts
lists, the shards' token files); ShardFiles, a shard's files by part. And the loaders of its JSON records and
meta.pkl, each the one place its file is read, each refusing a damaged file in one line that names it and what to
do (`damaged`)."""

from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import io
import json
import os
import pickle
import re
import shlex
import tempfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokpipe.durability import fsync_path, write_atomic, write_json_atomic
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import Shard
from tokpipe.inputs.names import shard_key

# OUT/logs/ holds these, and a stack dump per stalled shard (stall_dump).
RUN_LOG = "run.log"  # the effective configuration, shard failures, stalls, the outcome
RAY_LOG = "ray.log"  # Ray's own lines (tasks it failed and retried, nodes it lost): `tokpipe run` keeps them here
PROGRESS = "progress.json"  # rewritten every 2 s while shards run: rate, ETA, shard counts
FAILED = "failed.json"  # the last run's failures, shard relpath -> error
REFUSED = "refused.json"  # the refusal of a run that stopped before OUT held a token (runner/identity.py)
SKIPPED = "skipped.json"  # per shard with skips or repairs: their counts and the first lines skipped
SERIES = "series.jsonl"  # a compact time series of the run's progress, for `tokpipe report` (series.py)

# What a run writes before its first token: what it is (run.json, its manifest's copy), its lock, its logs;
# and `tokpipe report`'s page. Every other file is the work of a run (a checkpoint, tokens, a parts line)
# once it is not empty, and any file under shards/ is (a worker that holds a shard's lock may commit there).
RECORD = frozenset({"run.json", "manifest.json", ".lock", "logs", "report.html"})

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def group_stem(value: str) -> str:
    """A group's file name: the value itself when it is a safe name, else with every other character `_` (64 kept,
    no leading dot) and 8 hex digits of its sha256, so no two values share files; meta keeps the value."""
    stem = _UNSAFE.sub("_", value)[:64].lstrip(".")
    if stem == value and value:
        return value
    return f"{stem}-{hashlib.sha256(value.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def split_file_stem(split: str) -> str:
    return "val" if split == "validation" else split


def split_named(name: str) -> str:
    """A split as meta names it, from what a reader calls it: `val` is its file's name (val.bin), `validation` the
    split's, as in HF datasets."""
    return "validation" if name == "val" else name


def split_bin_name(stem: str) -> str:
    """A split file's name in OUT."""
    return f"{stem}.bin"


# A shard's part, its documents in one file of a split: (held out for val.bin, its --group-by group or None).
# The one key of a part through the write path: the checkpoint's counts, the shard's files, the buffered tokens.
PartKey = tuple[bool, str | None]


@dataclass(frozen=True)
class ShardFiles:
    """A shard's files in OUT: its checkpoint, its lock, and the .bin/.idx of each of its parts (`part`)."""

    folder: Path  # OUT/shards/<split>
    key: str  # the shard's

    @classmethod
    def of(cls, out: str | os.PathLike, shard: Shard) -> ShardFiles:
        return cls(_shards_folder(os.fspath(out), shard.split), shard.key)

    @property
    def checkpoint(self) -> Path:
        return self.folder / self.checkpoint_name(self.key)

    @staticmethod
    def checkpoint_name(key: str) -> str:
        return f"{key}.json"

    @property
    def lock(self) -> tuple[Path, int]:
        """The shard's lock (shard_lock): a byte of its split's shards.lock, at the place its key names."""
        at = int.from_bytes(hashlib.blake2b(self.key.encode(), digest_size=7).digest(), "big")
        return self.folder / "shards.lock", at

    def part(self, key: PartKey) -> tuple[Path, Path]:
        """The .bin/.idx of a part: what the shard holds out goes in a folder of its own (held-out/), so no shard's
        key can collide, and a group's in its group's (groups/<group_stem>/)."""
        held, group = key
        folder = self.folder / "held-out" if held else self.folder
        if group is not None:
            folder = folder / "groups" / group_stem(group)
        return folder / f"{self.key}.bin", folder / f"{self.key}.idx"

    @property
    def bin(self) -> Path:
        """The .bin of the shard's own part (no --group-by, not held out)."""
        return self.part((False, None))[0]

    @property
    def idx(self) -> Path:
        return self.part((False, None))[1]

    def token_files(self) -> list[Path]:
        """Every token file of the shard that exists: its own part's and its held-out part's, and its groups'
        (found by name: a group's folder is named by its group_stem). Asked at each shard's start, in strings:
        with pathlib, 20% of a worker's time on a two-document shard (cProfile)."""
        found, names = [], (f"{self.key}.bin", f"{self.key}.idx")
        for folder in (os.fspath(self.folder), os.path.join(self.folder, "held-out")):
            found += [Path(folder, name) for name in names if os.path.exists(os.path.join(folder, name))]
            if os.path.isdir(groups := os.path.join(folder, "groups")):
                matches = glob.glob(os.path.join(glob.escape(groups), "*", f"{glob.escape(self.key)}.*"))
                found += [Path(path) for path in matches if os.path.basename(path) in names]
        return found


@functools.lru_cache(maxsize=64)
def _shards_folder(out: str, split: str) -> Path:
    """OUT/shards/<split>, made once a process: its three Paths were a tenth of a two-document shard's start."""
    return Layout(out).shards / split


class Layout:
    """OUT: the folder of one run, its files by name, and what every reader asks of it (is it finished, its
    JSON files loaded). The changes of its state are LayoutWriter's."""

    def __init__(self, root: str | os.PathLike):
        # A reader's copy of an OUT on a store's records (layout/stored.py RecordsCopy) is kept: it knows the store.
        self.root = root if isinstance(root, Path) else Path(root)

    @property
    def where(self) -> str:
        """How a message names OUT: its path, or for a reader's copy of an OUT on a store, its URL."""
        return str(getattr(self.root, "stored", None) or self.root)

    def __fspath__(self) -> str:
        return os.fspath(self.root)

    # -- names ---------------------------------------------------------------------------------------

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def manifest(self) -> Path:
        """The manifest's copy that the run streams its shards from (and status, verify --sample read)."""
        return self.root / "manifest.json"

    @property
    def lock_file(self) -> Path:
        return self.root / ".lock"

    @property
    def meta_pkl(self) -> Path:
        return self.root / "meta.pkl"

    @property
    def meta_json(self) -> Path:
        return self.root / "meta.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    def log(self, name: str) -> Path:
        return self.root / "logs" / name

    def node_check(self, who: str | None = None) -> Path:
        """The token a cluster run's driver writes for its nodes to read back (runner/nodes.py); with
        `who` (a node, a worker), the file it writes, fsyncs and removes to prove it can write under OUT."""
        return self.log("node-check.txt" if who is None else f"node-check-{who}.tmp")

    def folders(self, stems: list[str]) -> Iterator[tuple[Path, set[str]]]:
        """OUT and the folders a run makes in it (logs/, shards/ and below, the group files' folder of each split
        stem in `stems`), each with the names of the files in it; not a folder of the user's that OUT holds."""
        own = {"logs", "shards", *stems}
        for folder, subfolders, files in os.walk(self.root):
            if Path(folder) == self.root:
                subfolders[:] = [name for name in subfolders if name in own]
            yield Path(folder), set(files)

    @property
    def shards(self) -> Path:
        """Every shard's checkpoint (and own files, and lock), under shards/<split>/."""
        return self.root / "shards"

    def shard(self, shard: Shard) -> ShardFiles:
        return ShardFiles.of(self.root, shard)

    def placed(self, split: str, digest: str = "") -> Path:
        """The checkpoints of a split's shards that a placing wrote from memory into their split file, by key, in a
        file named by the blake2b of its keys (write/place.py); without `digest`, their folder."""
        folder = self.shards / split / "placed"
        return folder / f"{digest}.json" if digest else folder

    def split(self, stem: str, group: str | None = None) -> Path:
        """A split's file, without its suffix: OUT/<stem>, or a group's OUT/<stem>/<group>."""
        return self.root / stem if group is None else self.root / stem / group_stem(group)

    def parts(self, stem: str) -> Path:
        """A finished split's parts list."""
        return self.root / f"{stem}.parts"

    def assembly(self, stem: str, group: str | None = None) -> tuple[Path, Path, Path]:
        """A split's .bin, .idx (or its group's) and .parts while it is assembled; renamed without .tmp when done."""
        base = self.split(stem, group)
        return Path(f"{base}.bin.tmp"), Path(f"{base}.idx.tmp"), self.root / f"{stem}.parts.tmp"

    def moving(self, stem: str) -> Path:
        """Where a split's files go when shards are added before finished ones (write/assembly/moving.py): each
        source of the parts moved to new offsets in a numbered folder, OUT/moving/<stem>/<n>/."""
        return self.root / "moving" / stem

    def moving_source(self, stem: str, n: int, group: str | None = None) -> tuple[Path, Path, Path]:
        """Source n of a split's moved parts: its .bin, .idx (or its group's), as the split's were, and its
        parts list; they are links to those files, made before new ones took their names."""
        folder = self.moving(stem) / str(n)
        base = folder / (stem if group is None else group_stem(group))
        return base.with_name(base.name + ".bin"), base.with_name(base.name + ".idx"), folder / f"{stem}.parts"

    def group_assembly_files(self, stem: str) -> list[Path]:
        """The .tmp files of a split's groups being assembled (--group-by)."""
        return list((self.root / stem).glob("*.tmp"))

    # -- reads ---------------------------------------------------------------------------------------

    def is_finished(self) -> bool:
        """Whether OUT holds a finished run: meta.json is the last file a run writes (write_meta) and the first it
        removes when it changes a split again (unfinish). The one rule of every reader (tokpipe/layout/meta.py)."""
        return self.meta_json.is_file()

    def load_meta_json(self) -> dict | None:
        """meta.json, None before the run finished."""
        return load_json(self.meta_json, meta_fix(self.meta_json))

    def load_log(self, name: str) -> dict | None:
        """A JSON file of OUT/logs/ (progress.json, failed.json, refused.json), None where there is none. Damaged,
        it is refused as the others are; the readers that can go on without it (status, report) say so and go on."""
        return load_json(self.log(name), "a log, not the run's state: the next run writes it anew")


class LayoutWriter(Layout):
    """OUT as a run changes it: every change of its state, each in one place (the lock, the finished marker, the
    split files' .tmp names and parts lists, the shards' token files); its names are Layout's."""

    def lock(self):
        """Hold OUT for this run. The kernel drops the lock when the process dies, so a killed run never blocks."""
        f = open(self.lock_file, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise UserError(
                f"{self.root} is in use by another tokpipe run ({holder}); wait for it to finish or stop it"
            ) from None
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {os.uname().nodename}")
        f.flush()
        return f

    def unfinish(self) -> None:
        """OUT is unfinished while its split files change (or until a new finalize): meta.json goes."""
        self.meta_json.unlink(missing_ok=True)

    def write_meta(self, meta: dict) -> None:
        """meta.pkl, then meta.json: the last file a run writes, so its presence marks a finished run."""
        write_atomic(self.meta_pkl, pickle.dumps(meta, protocol=4))
        write_json_atomic(self.meta_json, meta)

    def write_log(self, name: str, data: dict) -> None:
        self.log(name).parent.mkdir(exist_ok=True)
        write_json_atomic(self.log(name), data)

    def reopen(self, stem: str) -> None:
        """A split finished by an earlier finalize (fully, or killed between its renames), that this run
        extends (an append, an excluded shard back): its files (its one file, or its groups', OUT/<stem>/; none
        with --no-concat) are renamed back to .tmp, and OUT is unfinished."""
        base = self.split(stem)
        finished = [self.parts(stem), *(base.with_name(f"{stem}.{ext}") for ext in ("bin", "idx"))]
        for done in finished + sorted(base.glob("*.bin")) + sorted(base.glob("*.idx")):
            tmp = done.with_name(done.name + ".tmp")
            if not tmp.exists() and done.exists():
                self.unfinish()
                os.replace(done, tmp)

    def new_assembly_files(self, stem: str, group: str | None = None) -> None:
        """A split's (or its group's) files to assemble into, new and empty."""
        for path in self.assembly(stem, group)[:2]:
            path.parent.mkdir(exist_ok=True)
            path.unlink(missing_ok=True)  # a new empty file, not a truncate: see own_inode
            open(path, "xb").close()

    def start_parts_list(self, stem: str, lines: bytes) -> None:
        write_atomic(self.assembly(stem)[2], lines)

    def list_parts(self, stem: str, lines: bytes) -> None:
        """Append to a split's parts list, fsynced: only lines whose bytes are fsynced in place."""
        with open(self.assembly(stem)[2], "ab") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())

    def finish_split(self, stem: str, assembled: list[Path]) -> None:
        """A split's assembled files (the parts list first) renamed from their .tmp names; the folder of its groups'
        fsynced (OUT's own, by the caller once every split is)."""
        for path in [self.assembly(stem)[2], *assembled]:
            os.replace(path, path.with_suffix(""))
        for folder in sorted({path.parent for path in assembled} - {self.root}):
            fsync_path(folder)

    def remove_placed_leftovers(self, excluded: frozenset[str]) -> None:
        """Remove the shard token files left after their parts were copied into place and listed (a crash
        between the listing and the removal), keeping those of `excluded` shards, which a rerun resumes."""
        keep = {shard_key(relpath) for relpath in excluded}
        for folder in (self.root / "shards").glob("**/"):
            for path in folder.iterdir():
                if path.suffix in (".bin", ".idx") and path.stem not in keep:
                    path.unlink()

    def _made(self):
        """The paths of OUT outside RECORD, deepest first (a folder after what it holds)."""
        for top in sorted(set(os.listdir(self.root)) - RECORD):
            if (self.root / top).is_dir():
                for folder, subfolders, files in os.walk(self.root / top, topdown=False):
                    yield from (Path(folder) / name for name in files + subfolders)
            yield self.root / top

    def holds_tokens(self) -> bool:
        """Whether OUT holds anything made under its recorded identity: then a rerun with other inputs is
        refused for good. Before that, the split files a run opened are empty and no shard has a file."""
        made = (path for path in self._made() if not path.is_dir())
        return any("shards" == path.relative_to(self.root).parts[0] or path.stat().st_size for path in made)

    def start_over(self) -> None:
        """Remove the empty files and folders a refused run opened (OUT holds no token)."""
        for made in self._made():
            if made.is_dir():
                made.rmdir()
            else:
                made.unlink()


def is_out(folder: Path, names: Collection[str] | None = None) -> bool:
    """Whether a folder is a tokpipe OUT: it holds what every run writes before its first token, run.json and
    its manifest's copy (a manifest rebuilt over a dataset that holds one passes it over). `names`: the files in
    it as a listing gave them (a folder on an object store), instead of looking."""
    marks = (Layout(folder).run_json, Layout(folder).manifest)
    return all(m.name in names for m in marks) if names is not None else all(m.is_file() for m in marks)


def stall_dump(records: Path, shard: Shard) -> Path:
    """Where a stalled shard's stack dump goes: the logs of the run's records (layout/stored.py records_of)."""
    return Layout(records).log(f"stall-{shard.split}-{shard.key}.txt")


def work_folder(url: str) -> Path:
    """The local folder of an OUT on a store (layout/stored.py): where this machine keeps the records of its runs
    while they run (run.json, manifest.json, logs/), to upload them; one per OUT and user."""
    name = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"tokpipe-{os.getuid()}" / name


def rerun(out: str | os.PathLike) -> str:
    """The way a message sends the user to the run's command: `tokpipe status` prints it."""
    return f"rerun the run's command (tokpipe status {shlex.quote(os.fspath(out))} prints it)"


def damaged(path: Path, error: Exception, fix: str) -> UserError:
    """The one refusal of a file of OUT that does not read back as tokpipe wrote it. Each is written whole (a
    temporary file, fsynced, renamed) or appended and fsynced, so no crash leaves one unreadable: the storage (or
    a hand) damaged it, and nothing is built on it; `fix` says what to do instead."""
    return UserError(f"{path} is damaged ({type(error).__name__}: {error}): {fix}")


def meta_fix(path: Path) -> str:
    """What to do about a damaged meta.json or meta.pkl: a rerun writes it again (for meta.pkl, both)."""
    if path.suffix == ".pkl":
        return f"remove it and meta.json, and {rerun(path.parent)}: it writes both again"
    return f"remove it and {rerun(path.parent)}: it writes it again"


def load_json(path: Path, fix: str | None = None) -> dict | None:
    """A JSON object of OUT, None where the file is absent; where it is none (cut short, garbled, not UTF-8),
    refused here as `damaged` with `fix`, or without one a ValueError, which its loader refuses so with what to do
    (made only then: 5 us a checkpoint)."""
    try:
        found = json.loads(path.read_bytes())
        if not isinstance(found, dict):
            raise ValueError(f"a JSON {type(found).__name__}, not an object")
    except FileNotFoundError:
        return None
    except ValueError as e:
        if fix is None:
            raise
        raise damaged(path, e, fix) from None
    return found


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; a tokpipe meta holds only plain values")


def load_meta_pkl(path: str | os.PathLike, raw: bytes | None = None) -> dict:
    """meta.pkl (`raw`: its bytes, read already) without executing anything it may contain: plain containers and
    scalars only. FileNotFoundError before the run finished; a file cut short, garbled or hostile is `damaged`."""
    path = Path(path)
    raw = path.read_bytes() if raw is None else raw
    try:
        stream = io.BytesIO(raw)
        meta = _PlainUnpickler(stream).load()
        if not isinstance(meta, dict):
            raise pickle.UnpicklingError(f"meta.pkl holds a {type(meta).__name__}, not a dict")
        if stream.tell() < len(raw):  # past pickle's STOP, where load stops reading: no whole file's write leaves any
            raise pickle.UnpicklingError(f"{len(raw) - stream.tell():,} bytes follow its pickle")
    except Exception as e:  # whatever a garbled pickle raises (EOFError, UnpicklingError, ValueError, ...)
        raise damaged(path, e, meta_fix(path)) from None
    return meta


def out_folder(out: str | os.PathLike, *, new_ok: bool = False) -> Path:
    """OUT as a command names it: a folder (for `run`, `new_ok`, one it may create). A UserError (one line,
    exit 2) when the path, or a folder above it, is a file, or when a reader's OUT does not exist."""
    out = Path(out)
    found = next(p for p in (out, *out.parents) if p.exists())  # "/" or "." at the last
    if not found.is_dir():
        above = "" if found == out else f" (on the way to {out})"
        raise UserError(f"{found} is a file, not a folder{above}: OUT is a folder, a new one or a tokpipe run's")
    if found != out and not new_ok:
        raise UserError(f"{out} does not exist: give the --out folder of a tokpipe run")
    return out
