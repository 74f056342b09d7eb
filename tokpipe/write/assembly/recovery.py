"""Taking up OUT's split files where an earlier attempt left them, before anything is tokenized or placed.

A split finalized before is renamed back to .tmp (and meta.json goes), the listed parts that are still the
start of their split are kept, and after them the parts placed but not yet listed whose bytes match their
checksums; the rest of the files is made anew. Where shards were added before listed parts (an append, a shard
excluded and back), the split's files become the source those parts are moved from (moving.py) and the split
is assembled anew. The checkpoints of shards whose placed files are gone and whose parts are in no file kept
go (`lost`: tokenized again).
"""

from __future__ import annotations

import itertools

from tokpipe.durability import HASH_CHUNK, own_inode
from tokpipe.inputs.manifest import Manifest
from tokpipe.layout.checkpoints import Checkpoints
from tokpipe.layout.files import Layout, LayoutWriter, split_file_stem
from tokpipe.layout.records import IDX_DTYPE, part_record, parts_line, read_parts, record_key
from tokpipe.layout.run import WriteSpec, output_splits, sources
from tokpipe.write.assembly.moving import Moving
from tokpipe.write.assembly.split import Groups, SplitAssembly
from tokpipe.write.place import is_in_place


class Recovery:
    """What a rerun keeps of each split, and which shards it tokenizes again (`lost`)."""

    def __init__(self, out: LayoutWriter, itemsize: int, spec: WriteSpec, groups: Groups, checkpoints: Checkpoints):
        self.out, self.itemsize, self.groups, self.checkpoints = out, itemsize, groups, checkpoints
        self.val_fraction, self.concat, self.group_by = spec.val_fraction, spec.concat, spec.group_by
        self.lost: list[str] = []  # shards tokenized again: their placed files were gone, their place not kept
        self.moved: dict[str, int] = {}  # split stem -> finished shards whose parts move to new offsets

    def resume(self, manifest: Manifest) -> list[SplitAssembly]:
        """Every split's assembly, as far as an earlier attempt got, in manifest order of splits."""
        return [self._resume(manifest, split_file_stem(split)) for split in output_splits(manifest, self.val_fraction)]

    def _resume(self, manifest: Manifest, stem: str) -> SplitAssembly:
        """Keep what an earlier attempt assembled, if it is still the start of the split; move the listed parts
        that shards were added before; else start empty."""
        self.out.reopen(stem)
        kept, state, renew = self._keep_or_move(manifest, stem)
        if renew:  # before anything reads or writes the split's names: its files are a source now
            _prepare_files(self.out, state, False)
        elif self.concat:
            kept += self._placed_unlisted(state)
            _prepare_files(self.out, state, bool(kept))
        self.out.start_parts_list(stem, b"".join(map(parts_line, kept)))
        state.scheduled = state.listed = len(kept)
        if self.concat:
            self._tokenize_again(manifest, state)
        return state

    def _start(self, manifest: Manifest, stem: str) -> SplitAssembly:
        """The split's assembly from its first source: without --group-by, into a file of its own."""
        return SplitAssembly.start(stem, sources(manifest, stem, self.val_fraction), self.group_by is None)

    def _keep_or_move(self, manifest: Manifest, stem: str) -> tuple[list[dict], SplitAssembly, bool]:
        """The listed records kept, the split's state past them, and whether its files are to be made anew: a
        move of its listed parts begins (shards were added before some), or one began and its new files were
        not made yet."""
        moving = Moving(self.out, stem) if self.concat else None
        renew = moving is not None and moving.unstarted()
        parts_tmp = self.out.assembly(stem)[2]
        listed = [] if renew or not parts_tmp.exists() else list(read_parts(parts_tmp, torn="stop"))
        state = self._start(manifest, stem)
        kept = self._kept(listed, state)
        if self.concat and len(kept) < len(listed):
            holding = SplitAssembly.start(stem, iter(()), self.group_by is None)  # what the listed parts put where
            for record in listed:
                holding.add(record.get("group"), record)
            if not _short(self.out, holding, self.itemsize):
                moving.start(holding.files(self.out))
                renew = True
        if renew or (kept and self.concat and _short(self.out, state, self.itemsize)):
            kept = []  # made anew, or cut since they were listed: trust none of it
            state = self._start(manifest, stem)
        return kept, state, renew

    def _kept(self, listed: list[dict], state: SplitAssembly) -> list[dict]:
        """The records of a parts list that are still the start of the split, in order; `state` is advanced
        past them."""
        kept = []
        for record in listed:
            if not self._head_known(state):
                break
            group = state.head_parts[0] if state.head_parts else None
            if (record.get("shard"), record_key(record)) != (state.head[0].relpath, (state.head[1], group)):
                break  # the split changed before this shard (an append, a shard excluded or back)
            kept.append(record)
            _take(state, group, record)
        return kept

    def _head_known(self, state: SplitAssembly) -> bool:
        """Whether there is a head whose parts are known (with --group-by, once its checkpoint is done)."""
        while state.head is not None and state.head_parts is None and self.group_by is not None:
            ckpt = self.checkpoints.of(state.head[0])
            if ckpt is None or not ckpt.done:
                break
            state.head_ckpt, state.head_parts = ckpt, self.groups.head_parts(state, ckpt)
            if not state.head_parts:  # a held-out source with no documents: no part at all
                state.advance()
        return state.head is not None and (self.group_by is None or state.head_parts is not None)

    def _placed_unlisted(self, state: SplitAssembly) -> list[dict]:
        """The parts written into place after the listed ones but not yet listed when the run stopped (a shard
        that buffered its tokens has no other copy of them): kept, in order, as far as each one's checkpoint is
        done and its bytes in its file match the checksums the worker took (with --group-by, a shard's accounting
        line, which has no bytes, with them); `state` is advanced past them."""
        recovered, buffer = [], bytearray(HASH_CHUNK)
        while self._head_known(state):
            (shard, held), ckpt = state.head, self.checkpoints.of(state.head[0])
            group = state.head_parts[0] if state.head_parts else None
            if ckpt is None or not ckpt.done:
                break
            files, record = self.out.shard(shard), part_record(shard, ckpt, (held, group))
            if self.group_by is not None and group is None:  # the accounting line: kept if no part is in its files
                if any(files.part(part.key)[0].exists() for part in ckpt.source_parts(held)):
                    break
            elif files.part((held, group))[0].exists() or not self._in_place(state, group, record, buffer):
                break  # in its own files still (placed from them as usual), or not in place
            recovered.append(record)
            _take(state, group, record)
        return recovered

    def _in_place(self, state: SplitAssembly, group: str | None, record: dict, buffer: bytearray) -> bool:
        bin_tmp, idx_tmp, _ = self.out.assembly(state.stem, group)
        if not (bin_tmp.exists() and idx_tmp.exists()):
            return False
        with open(bin_tmp, "rb") as bin_f, open(idx_tmp, "rb") as idx_f:
            return is_in_place(bin_f, idx_f, record, *state.offsets.get(group, (0, 0)), self.itemsize, buffer)

    def _tokenize_again(self, manifest: Manifest, state: SplitAssembly) -> None:
        """Shards done whose placed files are gone and whose parts are neither kept nor in a source of moved
        parts (the split file was cut, or they were placed but not listed and do not match their checksums):
        their checkpoints go, so this run tokenizes them again. The head's parts already kept (--group-by)
        stay kept: tokenized again, its other parts are the same. The shards found in a source are counted
        (`moved`); the sources go if none is."""
        rest = sources(manifest, state.stem, self.val_fraction)
        rest = itertools.dropwhile(lambda source: source != state.head, rest)
        moving, moved, lost = Moving(self.out, state.stem), 0, []
        for shard, held in rest:
            ckpt = self.checkpoints.of(shard)
            if ckpt is None or not ckpt.done:
                continue
            files = self.out.shard(shard)
            needed = [part.key for part in ckpt.source_parts(held)]
            if (shard, held) == state.head and state.head_parts is not None:  # of the head, its parts not kept yet
                needed = [key for key in needed if key[1] in state.head_parts]
            gone = [key for key in needed if not files.part(key)[0].exists()]
            found = [key for key in gone if moving.take(shard.relpath, key) is not None]
            if len(found) == len(gone):
                moved += bool(found)
                continue
            lost.append(shard)
            self.lost.append(shard.relpath)
            if (shard, held) == state.head:
                state.head_ckpt = None  # its parts wait for it to be done again
        self.checkpoints.forget(lost)
        if moved:
            self.moved[state.stem] = moved
            state.moving = Moving(self.out, state.stem)
        elif moving:  # every part moved from them is kept
            moving.end()


def _take(state: SplitAssembly, group: str | None, record: dict) -> None:
    """`state` past a part kept: the next of its shard's, or the next shard."""
    state.add(group, record)
    if state.head_parts:
        state.head_parts.pop(0)
    if not state.head_parts:
        state.advance()


def _short(out: Layout, state: SplitAssembly, itemsize: int) -> bool:
    """Whether a file being assembled is shorter than the parts `state` has put in it (cut since they were)."""
    for group, (tokens, documents) in state.offsets.items():
        bin_tmp, idx_tmp, _ = out.assembly(state.stem, group)
        if not (bin_tmp.exists() and idx_tmp.exists()):
            return True
        if bin_tmp.stat().st_size < tokens * itemsize or idx_tmp.stat().st_size < documents * IDX_DTYPE.itemsize:
            return True
    return False


def _prepare_files(out: LayoutWriter, state: SplitAssembly, kept: bool) -> None:
    """The files the split is assembled into from here: those of the kept parts, else (without --group-by) a new
    empty one of its own. A group's file of no kept part goes: it is made anew when the group is met."""
    files = state.files(out)
    keep = {path for pair in files.values() for path in pair}
    for path in out.group_assembly_files(state.stem):
        if path not in keep:
            path.unlink()
    for group, pair in files.items():
        if not kept:
            out.new_assembly_files(state.stem, group)
            continue
        for path in pair:
            own_inode(path)  # the split is written in place from here on
