"""Where a run's OUT lives: a folder (`Folder`) or a prefix of an object store's bucket (`Prefix`), chosen once where
the run starts (`storage_of`), as read/maps.py chooses a file. The driver tells one story over either; each does its
own way what that story asks of OUT:

- `held`: OUT held for this run alone (a folder's lock, a prefix's lease), refusals noted, the run recorded (run.json,
  the manifest's copy); yields the manifest of that copy, whose shards the run streams from;
- `records`: the local folder of the run's records while it lasts (OUT itself; for a prefix, a folder of its own,
  uploaded: layout/stored.py), where its logs, progress and failures go;
- `finished`: meta, once OUT is finished; `clean` removes what a killed finish left beside a finished OUT;
- `assembly`: the split files' assembler, resumed (write/assembly: in place; write/stored.py: segments composed on the
  server), and `is_done` / `checkpoint`: which shards are done;
- `post_token` / `unseen`: what each node of a cluster must see of OUT (runner/nodes.py);
- `keep`: the done shards a failed one holds back, kept for the rerun;
- `finalize`: the last copies, the split files, meta (last).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from itertools import islice
from pathlib import Path

from tokpipe.durability import write_atomic
from tokpipe.errors import UserError
from tokpipe.fmt import plural
from tokpipe.inputs.manifest import Manifest, Shard, load_manifest, write_manifest
from tokpipe.inputs.tokenizer import TokenizerInfo
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
from tokpipe.layout.files import FAILED, REFUSED, RUN_LOG, SERIES, Layout, LayoutWriter, is_out, out_folder
from tokpipe.layout.meta import Meta, load_meta
from tokpipe.layout.run import WriteSpec, load_run
from tokpipe.layout.stored import StoredOut, on_store
from tokpipe.options import RunOptions
from tokpipe.runner.events import Listener, Said, silent
from tokpipe.runner.identity import (
    check_append,
    describe_changes,
    finished_read_only,
    identity_changes,
    record_run,
    refusals_noted,
    refuse_foreign,
    refuse_inside,
    run_identity,
)
from tokpipe.write.assembly import Assembler
from tokpipe.write.finalize import finalize, finalize_stored
from tokpipe.write.shard import keep
from tokpipe.write.stored import StoreAssembly, StoredCheckpoints
from tokpipe.write.stored import keep as keep_on_store

# How often a run on a store uploads its logs while it runs: a kill -9 loses this much of them, not the whole attempt's
# (two days of a run's run.log, its stall dumps and report's chart).
LOGS_EVERY = 60.0


def storage_of(out: str | os.PathLike) -> Folder | Prefix:
    """OUT as the user names it (`--out`): a URL is a prefix of a bucket, anything else a folder."""
    return Prefix(StoredOut.of(os.fspath(out))) if on_store(out) else Folder(out_folder(out, new_ok=True))


class Storage:
    """What the driver asks of OUT wherever it lives; Folder and Prefix each do the rest their own way."""

    def keep(self, assembler, placing=None) -> int:
        """The done shards whose place a failed one keeps unknown, kept where OUT lives and checkpointed
        (`keep_shard`), by the node that holds their tokens (`placing`, on Ray) or here: the rerun places them
        without tokenizing them again. Returns how many were kept."""
        if placing is not None:
            return placing.keep(assembler.unplaced())
        unplaced = assembler.unplaced()
        for shard, ckpt, buffered in unplaced:
            self.keep_shard(shard, ckpt, buffered)
        return len(unplaced)

    def save_logs(self) -> None:
        """The run's logs where OUT's readers look, before a process that ends at once (Ray's head lost): a folder's
        are there already."""

    def still_held(self) -> None:
        """Raise (UserError) where OUT is no longer this run's: a folder's lock is held until the process ends."""


class Folder(Storage):
    """OUT in a folder of a file system (every node's, on a cluster): written in place, its lock a file's."""

    on_disk = True  # progress compares OUT's growth with its file system's free space

    def __init__(self, path: Path):
        self.path = self.records = self.where = path
        self.name = str(path)
        self.checkpoints = Checkpoints(path)  # listed once for the run: its plan, its assembly, its tasks
        self.is_done = self.checkpoints.done
        self.spill = ""  # a large part past --shard-buffer goes to its shard's own files in OUT (write/shard.py)
        self.tell: Listener = silent

    def checkpoint(self, shard: Shard) -> Checkpoint | None:
        """The shard's checkpoint, as the plan reads it; but a partial one of a file that is no longer the manifest's
        size (a cut download fetched again, maybe compressed anew) is forgotten, said, and the shard begins again:
        its place in the file read was no place in the new one ("corrupt zstd data" of a sound file)."""
        ckpt = self.checkpoints.of(shard)
        if ckpt is None or ckpt.done or shard.on_store:  # a shard on a store is read by its ETag (store/reader.py)
            return ckpt
        with contextlib.suppress(OSError):  # a shard gone: its task says so
            if (size := os.stat(shard.path).st_size) != shard.size:
                self.checkpoints.forget([shard])
                self.tell(Said(f"{shard.relpath} is {size:,} bytes, not the manifest's {shard.size:,}, since its"
                               " checkpoint: tokenizing it from its start"))  # fmt: skip
                return None
        return ckpt

    def show(self, name: str) -> str:
        """A file of OUT as a user names it."""
        return str(self.path / name)

    def check(self) -> None:
        """A new OUT inside another refused before its folder is made; the rest when it is held."""
        if load_run(Layout(self.path)) is None:
            refuse_inside(self.path, next((str(p) for p in self.path.resolve().parents if is_out(p)), None))

    def read_only(self, manifest: Manifest, info: TokenizerInfo, opts: RunOptions) -> Meta | None:
        """The meta of OUT finished with this run where this process may not write it (a read-only mount); anything
        else there is refused (identity.finished_read_only). None where it may."""
        self.path.mkdir(parents=True, exist_ok=True)
        return None if os.access(self.path, os.W_OK) else finished_read_only(self.path, manifest, info, opts)

    @contextmanager
    def held(self, manifest: Manifest, info: TokenizerInfo, opts: RunOptions, tell: Listener) -> Iterator[Manifest]:
        if load_run(Layout(self.path)) is None:  # before OUT holds a file of this run's (its lock, its logs)
            refuse_foreign(self.path, os.listdir(self.path))
        self.tell = tell
        writer = LayoutWriter(self.path)
        with writer.lock(), refusals_noted(self.path, lambda: not writer.holds_tokens()):
            record_run(self.path, manifest, info, opts, tell)
            write_manifest(manifest, Layout(self.path).manifest)  # what `verify --sample` and `status` read
            yield replace(manifest, source=Layout(self.path).manifest)

    def finished(self) -> Meta | None:
        return load_meta(Layout(self.path))

    def clean(self, meta: Meta, tell: Listener) -> None:
        """Nothing: a folder's finish leaves nothing beside OUT's files (finalize renames, then writes meta)."""

    def assembly(self, manifest: Manifest, itemsize: int, spec: WriteSpec, say) -> Assembler:
        """The split files taken up where an earlier attempt left them (Assembler.resume); `say`s which finished
        shards move to new offsets in them, and which are tokenized again."""
        assembler = Assembler(self.path, itemsize, spec, self.checkpoints)
        assembler.resume(manifest)
        if assembler.moved:
            what = ", ".join(f"{n} in {stem}" for stem, n in assembler.moved.items())
            say(
                f"moving finished shards to their new offsets, after the shards added before them ({what}): copied"
                " from the split files as they were, none tokenized again"
            )
        if assembler.lost:
            n = len(assembler.lost)
            say(
                f"tokenizing again {plural(n, 'shard')} (e.g. {assembler.lost[0]}): their tokens are in no"
                " file a rerun can keep (placed but not yet listed when the last run stopped, or in a split file that"
                " changed since)",
                f"tokenizing again: {', '.join(assembler.lost)}",
            )
        return assembler

    # What every node must do (runner/nodes.py), said where one does not.
    every_node = (
        "every node must see the shards, the tokenizer and OUT at the driver's paths (storage they all mount alike);"
        " mount it there or take the node out of the cluster"
    )

    def post_token(self, token: str) -> None:
        """This run's token in OUT, which each node reads back (runner/nodes.py): a node that sees another folder
        at the driver's path (its own disk's) lacks it."""
        write_atomic(Layout(self.path).node_check(), token.encode())

    def unseen(self, token: str, who: str) -> str | None:
        """What this node cannot see of OUT: the driver's token read back, then a file of its own (`who`'s)
        written, fsynced and removed beside it. None when it sees it."""
        token_file = Layout(self.path).node_check()
        try:
            found = token_file.read_text()
        except OSError as e:
            if not self.path.is_dir():
                return f"cannot see OUT {self.path} ({e.strerror})"
            found = None
        if found != token:
            return f"sees another folder at OUT {self.path} than the driver's (without this run's {token_file.name})"
        mine = Layout(self.path).node_check(who)
        try:
            with open(mine, "wb") as f:
                f.write(token.encode())
                os.fsync(f.fileno())
            mine.unlink()
        except OSError as e:
            return f"cannot write under OUT {self.path} ({e.strerror})"
        return None

    def keep_shard(self, shard: Shard, ckpt: Checkpoint, buffered) -> None:
        """A done shard's buffered parts written to its own files and fsynced, then its checkpoint (shard.keep)."""
        keep(self.path, shard, ckpt, buffered)

    def finalize(self, assembler: Assembler, manifest: Manifest, info: TokenizerInfo, spec, excluded) -> dict:
        return finalize(self.path, manifest, info, spec, excluded, assembler)


@contextmanager
def _records_kept(prefix: Prefix, tell: Listener) -> Iterator[None]:
    """A run's records folder on a store (`prefix.records`) while it holds the lease: made anew with the store's logs
    that every attempt appends to and its last verdicts (as on disk, where they stay), uploaded every LOGS_EVERY and
    at the end, then removed. Not once the lease is lost: OUT, and on this machine the folder too, are the other's."""
    out, lease = prefix.out, prefix.lease
    shutil.rmtree(out.work, ignore_errors=True)  # what an earlier attempt on this machine left
    out.work.mkdir(parents=True)
    for path in (out.layout.log(name) for name in (RUN_LOG, SERIES, FAILED, REFUSED)):
        if (found := out.bucket.get(out.of_local(path))) is not None:
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(found[0])
    stop = threading.Event()

    def upload_often() -> None:
        while not stop.wait(LOGS_EVERY) and lease.lost is None:
            out.upload_logs()  # a store away for a moment: the next one, or the end's, says so

    keeper = threading.Thread(target=upload_often, name="tokpipe logs", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()
        if lease.lost is None:
            if out.upload_logs():
                shutil.rmtree(out.work, ignore_errors=True)
            else:  # the one copy of them
                tell(Said(f"the store did not take this run's logs: they are in {out.work / 'logs'}"))


class Prefix(Storage):
    """OUT under a prefix of a bucket (layout/stored.py): held by a lease (store/lease.py: a second run on a live OUT
    is refused in one line; after a kill -9 the same command resumes within one lease); its records written in a
    local folder of the run's (`records`) and uploaded, run.json and the manifest's copy at the start, the logs every
    LOGS_EVERY and at the end, whatever the end (a kill -9 loses their last moments, never a token); its parts uploaded
    in segments while shards tokenize, the split files composed from them on the server at the end (write/stored.py)."""

    on_disk = False  # a store's space is no file system's

    def __init__(self, out: StoredOut):
        self.out, self.name, self.records, self.where = out, str(out), out.work, str(out)
        self.spill = out.spill_name()  # where a worker's large parts wait past --shard-buffer (EncodeSpec.spill)
        self.assembler: StoreAssembly | None = None
        self.lease = None
        self.tell: Listener = silent

    def show(self, name: str) -> str:
        return str(self.out.url / name)

    def check(self) -> None:
        """Refuse, before any work, a store that cannot be used (store.Bucket.check: one line, exit 2)."""
        self.out.check()

    def read_only(self, manifest: Manifest, info: TokenizerInfo, opts: RunOptions) -> None:
        """A store refuses a write when it is made (StoreRefused), with the store's own words."""

    @contextmanager
    def held(self, manifest: Manifest, info: TokenizerInfo, opts: RunOptions, tell: Listener) -> Iterator[Manifest]:
        self.tell = tell
        with self.out.lease() as self.lease, _records_kept(self, tell):
            with refusals_noted(self.records, lambda: self.lease.lost is None and not self.out.holds_tokens()):
                yield self._record(manifest, info, opts, tell)

    def save_logs(self) -> None:
        self.out.upload_logs()  # the stop note with them, for `tokpipe status` on any machine

    def still_held(self) -> None:
        # Taken over while this run was stopped (Ctrl-Z, a paused VM), by a run on this machine maybe, which removed
        # this one's records as an earlier attempt's: whatever failed first, that is why.
        with contextlib.suppress(OSError):
            self.lease.check()

    def _record(self, manifest: Manifest, info: TokenizerInfo, opts: RunOptions, tell: Listener) -> Manifest:
        """Refuse an OUT that holds a run with other inputs, but a manifest that only gained shards (`_append`); start
        over one that holds no token; then write run.json and the manifest's copy, here and on the store."""
        bucket, out, layout = self.out.bucket, self.out, self.out.layout
        found = bucket.get(out.of_local(layout.run_json))
        if found is not None:
            layout.run_json.write_bytes(found[0])
        else:  # a page of its objects tells: a prefix of another's data holds thousands
            refuse_inside(out, out.enclosing())
            refuse_foreign(out, {out.name(o.key).split("/")[0] for o in islice(bucket.list(out.prefix), 1000)})
        changed = identity_changes(self.records, run_identity(manifest, info, opts))
        if changed and self.out.holds_tokens():
            if list(changed) != ["manifest_sha256"]:
                raise UserError(
                    f"{out} holds a run with other inputs ({describe_changes(changed)}); use a new --out, or the"
                    " original inputs to resume"
                )
            self._append(manifest, tell)
        elif changed:
            for found in list(bucket.list(out.prefix)):
                if found.key != out.lock:
                    bucket.delete(found.key)
            tell(Said(f"{out} holds no token yet: starting it over with these inputs ({describe_changes(changed)})"))
        if changed:  # said above, for OUT: not again for the local records, which hold no token ("starting over")
            layout.run_json.unlink()
        record_run(self.records, manifest, info, opts, tell)
        write_manifest(manifest, layout.manifest)
        for path in (layout.run_json, layout.manifest):
            bucket.put(out.of_local(path), path.read_bytes())
        return replace(manifest, source=layout.manifest)  # its shards stream from the local copy

    def _append(self, manifest: Manifest, tell: Listener) -> None:
        """The manifest gained shards, or changed or left out some OUT holds nothing finished of (check_append). Of a
        finished OUT, its split files are copied on the server to `sources/`, whence the new split files take their
        finished parts (write/stored.py), none tokenized again; then this run's run.json is written, and the rerun's
        resume removes meta. A kill before run.json copies them again. A --no-concat OUT's parts are its segments,
        which stay. Shards gained by an OUT not finished are refused: its committed segments were gathered in the
        order of the shards it had."""
        out, layout = self.out, self.out.layout
        meta = self.finished()
        layout.manifest.write_bytes(out.bucket.get(out.of_local(layout.manifest))[0])
        no_gain = "" if meta is not None else (
            f"{out} holds an unfinished run of fewer shards: shards are appended to a finished OUT on a store;"
            " finish it first (the command that started it), then run this one"
        )
        check_append(self.name, load_manifest(layout.manifest), manifest, tell, StoredCheckpoints.listed(out).is_done,
                     no_gain)  # fmt: skip
        if meta is not None:
            self.clean(meta, tell)
            if meta.concat:
                out.copy_to_sources(meta)

    def finished(self) -> Meta | None:
        found = self.out.bucket.get(self.out.of_local(self.out.layout.meta_json))
        return None if found is None else Meta.of(json.loads(found[0]))

    def clean(self, meta: Meta, tell: Listener) -> None:
        """What a finish killed after meta.json left (StoredOut.leftovers, a second copy of tokens) removed; said."""
        left = self.out.leftovers(meta.concat)
        if left:
            self.out.bucket.delete_many(left)
            left_by = f"that a finish killed after meta.json left under {self.name}"
            tell(Said(f"removed {plural(len(left), 'object')} {left_by}"))

    def is_done(self, shard: Shard) -> bool:
        return self.assembler.is_done(shard)

    def checkpoint(self, shard: Shard) -> Checkpoint | None:
        """Done or not, as the store's listing says (its checkpoints are read by finalize alone)."""
        return Checkpoint(done=True) if self.is_done(shard) else None

    def assembly(self, manifest: Manifest, itemsize: int, spec: WriteSpec, say) -> StoreAssembly:
        """The split files' segments taken up where an earlier attempt left them (StoreAssembly.resume); `say`s
        which finished shards an append takes from the split files as they were."""
        self.assembler = StoreAssembly(self.out, spec, manifest, itemsize, lease=self.lease)
        self.assembler.resume(say)
        if self.assembler.held_parts.moved:
            what = ", ".join(f"{n} in {stem}" for stem, n in self.assembler.held_parts.moved.items())
            say(
                f"taking finished shards from the split files as they were ({what}), copied on the server to"
                f" {self.show('sources/')}: none tokenized again"
            )
        return self.assembler

    every_node = (
        "every node reads OUT on the store with its own credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,"
        " AWS_ENDPOINT_URL in the environment of its `ray start`, or an instance role); give them to it or take the"
        " node out of the cluster"
    )

    def post_token(self, token: str) -> None:
        self.out.bucket.put(self.out.of_local(self.out.layout.node_check()), token.encode())

    def unseen(self, token: str, who: str) -> str | None:
        return self.out.unseen(token, who)

    def keep_shard(self, shard: Shard, ckpt: Checkpoint, buffered) -> None:
        """A done shard's buffered parts uploaded to its own files' keys, then its checkpoint (write/stored.py keep)."""
        keep_on_store(self.out, shard, ckpt, buffered)

    def finalize(self, assembler: StoreAssembly, manifest: Manifest, info: TokenizerInfo, spec, excluded) -> dict:
        return finalize_stored(assembler, manifest, info, spec, excluded, lambda text: self.tell(Said(text)))
