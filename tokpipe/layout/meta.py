"""meta.json and meta.pkl as a record: `Meta`, each split's entry (`SplitEntry`) and the files a split is read from
(`SplitFile`); when OUT is finished, and its meta's one loader for the readers.

On disk meta stays a plain dict (a nanoGPT trainer reads meta['vocab_size'] from meta.pkl): `Meta.as_dict()` is
the dict a run writes, key for key in the order it always had, or, for a meta that was read, the dict as read (an
earlier tokpipe's keeps its own keys). Reading one, the fields an earlier tokpipe did not write take the
meaning their absence had. The three layouts of a split (its tokens in one file, `file`; --no-concat's files,
`files`; --group-by's groups, `groups`) are told apart here and nowhere else: a reader asks `SplitEntry.token_files`.

Finished: meta.json is the last file a run writes (after meta.pkl) and the first a run removes when it changes a
split again (Layout.unfinish): OUT is finished while it is there (`Layout.is_finished`), and a reader takes meta
from meta.pkl, the trainers' file (`finished_meta`), or from meta.json (`load_meta`).
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokpipe.errors import UserError
from tokpipe.layout.files import Layout, damaged, load_meta_pkl, meta_fix


class OutputError(UserError, ValueError):
    """An OUT that cannot be read as a finished one: not finished, or a file missing, of another size than its
    meta says, or changed since it was first read. One line: a UserError for the commands (exit 2), a ValueError
    for tokpipe.data's callers, whose every refusal is one."""


@dataclass(frozen=True)
class Delimiters:
    """What a run placed around each document: BOS before it, EOS after it."""

    bos: bool = False
    eos: bool = True  # an earlier tokpipe's meta, without `delimiters`: EOS only

    @classmethod
    def of(cls, raw: dict | None) -> Delimiters:
        return cls() if raw is None else cls(bool(raw["bos"]), bool(raw["eos"]))

    def as_dict(self) -> dict:
        return {"bos": self.bos, "eos": self.eos}


@dataclass(frozen=True, slots=True)  # one a file: 60,000 for a --no-concat split of SlimPajama
class SplitFile:
    """A file a split is read from, and its document ends: paths relative to OUT, with their counts. A finished
    split's are whole files, as meta lists them. An unfinished OUT's (records.unfinished_files) are what its
    records cover of files still written (`growing`: they may be longer): a shard's own, or a part placed in the
    split file being assembled (`placed`), its tokens from `token_offset` in the file, its ends from `doc_offset`
    (counted from the file's first token)."""

    bin: str
    idx: str
    tokens: int
    documents: int
    token_offset: int = 0
    doc_offset: int = 0
    growing: bool = False
    placed: bool = False

    @property
    def name(self) -> str:
        """How a reader names it: its path in OUT; a placed part, its file's name @ its first token."""
        return f"{Path(self.bin).name}@{self.token_offset}" if self.placed else self.bin


@dataclass(frozen=True)
class SplitEntry:
    """meta's entry for a split, or for one group of a split (--group-by): its counts, its files, and (a split's)
    its accounting and parts list."""

    tokens: int
    documents: int
    files: tuple[SplitFile, ...] = ()  # its own: its one file, or --no-concat's in order; a grouped split has none
    concat: bool = True  # its tokens in one file (`file`); False: its parts' own files (`files`, --no-concat)
    groups: dict[str, SplitEntry] | None = None  # --group-by: value -> the group's entry, in value order
    parts: str | None = None  # its parts list's name in OUT; None: tokpipe 0.1's, a whole-file sha256 instead
    parts_sha256: str | None = None
    lines: int | None = None  # input lines read (None: not recorded); a group's entry has no accounting
    held_out: int = 0
    held_in: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    repaired: dict[str, int] = field(default_factory=dict)
    shards: int = 0
    text_bytes: int | None = None  # a group's: its documents' texts, UTF-8
    sha256: str | None = None  # tokpipe 0.1: of the whole file, and of its .idx
    idx_sha256: str | None = None

    @classmethod
    def of(cls, raw: dict) -> SplitEntry:
        """An entry as meta holds it: one of the three layouts."""
        tokens, documents = int(raw["tokens"]), int(raw["documents"])
        if "groups" in raw:
            files, concat, groups = (), True, {value: cls.of(g) for value, g in raw["groups"].items()}
        elif "files" in raw:
            files = tuple(SplitFile(f["bin"], f["idx"], int(f["tokens"]), int(f["documents"])) for f in raw["files"])
            concat, groups = False, None
        else:  # tokpipe 0.1 did not name the .idx
            idx = raw.get("idx", Path(raw["file"]).with_suffix(".idx").name)
            files, concat, groups = (SplitFile(raw["file"], idx, tokens, documents),), True, None
        accounting = {k: raw[k] for k in ("lines", "held_out", "held_in", "skipped", "repaired", "shards") if k in raw}
        checksums = {k: raw.get(k) for k in ("parts", "parts_sha256", "text_bytes", "sha256", "idx_sha256")}
        return cls(tokens, documents, files, concat, groups, **checksums, **accounting)

    def as_dict(self) -> dict:
        """The entry as finalize writes it (a group's: its file or files and its counts)."""
        if self.groups is not None:
            entry = {}
        elif self.concat:
            entry = {"file": self.files[0].bin, "idx": self.files[0].idx}
        else:
            entry = {"files": [{k: getattr(f, k) for k in ("bin", "idx", "tokens", "documents")} for f in self.files]}
        if self.text_bytes is not None:
            return entry | {"tokens": self.tokens, "documents": self.documents, "text_bytes": self.text_bytes}
        entry |= {"parts": self.parts, "tokens": self.tokens, "documents": self.documents, "lines": self.lines}
        entry |= {"held_out": self.held_out, "held_in": self.held_in, "skipped": self.skipped}
        entry |= {"repaired": self.repaired, "shards": self.shards}
        if self.groups is not None:
            entry["groups"] = {value: group.as_dict() for value, group in self.groups.items()}
        return entry | {"parts_sha256": self.parts_sha256}

    @property
    def file(self) -> str | None:
        """Its one file's name in OUT, where its tokens are in one (a concatenated split, not grouped)."""
        return self.files[0].bin if self.concat and self.groups is None else None

    def token_files(self) -> list[SplitFile]:
        """The files the split is read from, in order: its one file; a --no-concat split's parts' own; with
        --group-by, those of each group in turn, in meta's order (their values')."""
        if self.groups is not None:
            return [f for group in self.groups.values() for f in group.token_files()]
        return list(self.files)

    def holding(self, parts: list) -> list[tuple[SplitFile, list]]:
        """Each file of the split with the parts of its parts list (records.Part, at their offsets in their file
        or their group's) that it holds: a concatenated split's (or group's) file holds its parts one after the
        other; --no-concat's, one part each, from the file's start."""
        if self.groups is not None:  # a shard's accounting line is no group's: it holds no tokens
            by_group: dict[str | None, list] = {}
            for part in parts:
                by_group.setdefault(part.group, []).append(part)
            return [held for value, g in self.groups.items() for held in g.holding(by_group.get(value, []))]
        if self.concat:
            return [(self.files[0], parts)]
        return [(f, [replace(part, token_offset=0, doc_offset=0)]) for f, part in zip(self.files, parts)]


# The keys of meta after the first three (which every tokpipe wrote) and its splits: an earlier tokpipe's meta may
# lack them, and the field's default is what their absence meant.
_TOKENIZER = ("tokenizer", "tokenizer_sha256", "tokenizer_repo_id", "tokenizer_revision", "tokenizer_path")
_OPTIONAL = ("eos_token", "bos_token_id", "bos_token", "val_fraction", "concat", *_TOKENIZER, "text_field")
_OPTIONAL += ("group_by", "excluded", "manifest_sha256", "tokpipe_version")


@dataclass(frozen=True)
class Meta:
    """What a finished OUT is: its dtype and tokenizer, what surrounds a document, its splits, and what was left out."""

    dtype: str
    vocab_size: int
    eos_token_id: int
    splits: dict[str, SplitEntry]
    eos_token: str | None = None
    bos_token_id: int | None = None
    bos_token: str | None = None
    delimiters: Delimiters = Delimiters()
    val_fraction: float = 0.0
    concat: bool = True
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None
    tokenizer_repo_id: str | None = None  # ORG/NAME and its commit, for a tokenizer from the HF cache
    tokenizer_revision: str | None = None
    tokenizer_path: str | None = None
    text_field: str = "text"
    group_by: str | None = None
    excluded: dict[str, str] = field(default_factory=dict)  # shards a --skip-failed run left out: relpath -> error
    manifest_sha256: str | None = None
    tokpipe_version: str | None = None
    raw: dict | None = field(default=None, compare=False, repr=False)  # the dict as read, for as_dict

    @classmethod
    def of(cls, raw: dict) -> Meta:
        """The meta a dict holds (KeyError, TypeError or ValueError where it is none)."""
        optional = {k: raw[k] for k in _OPTIONAL if k in raw}
        head = str(raw["dtype"]), int(raw["vocab_size"]), int(raw["eos_token_id"])
        splits = {name: SplitEntry.of(entry) for name, entry in dict(raw["splits"]).items()}
        return cls(*head, splits, delimiters=Delimiters.of(raw.get("delimiters")), raw=raw, **optional)

    def as_dict(self) -> dict:
        """The dict on disk: as read, or as this tokpipe writes it."""
        if self.raw is not None:
            return self.raw
        meta = {"dtype": self.dtype, "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}
        meta |= {"eos_token": self.eos_token, "bos_token_id": self.bos_token_id, "bos_token": self.bos_token}
        meta |= {"delimiters": self.delimiters.as_dict(), "val_fraction": self.val_fraction, "concat": self.concat}
        meta |= {k: getattr(self, k) for k in _TOKENIZER + ("text_field",)}
        meta |= {"group_by": self.group_by} if self.group_by is not None else {}
        meta |= {"splits": {name: entry.as_dict() for name, entry in self.splits.items()}}
        return meta | {k: getattr(self, k) for k in ("excluded", "manifest_sha256", "tokpipe_version")}

    @property
    def tokens(self) -> int:
        """Of every split."""
        return sum(entry.tokens for entry in self.splits.values())

    @property
    def bos_placed(self) -> int | None:
        """The BOS id, where the run placed BOS before every document."""
        return self.bos_token_id if self.delimiters.bos else None


def load_meta(out: Layout) -> Meta | None:
    """meta.json, None while OUT is not finished (Layout.is_finished: it is not there). Damaged (not JSON, or not a
    meta), it is refused in one line."""
    raw = out.load_meta_json()
    return None if raw is None else _parsed(raw, out.meta_json)


def finished_meta(out: Layout) -> Meta:
    """A finished OUT's meta, as a trainer reads it (meta.pkl); refused in one line when OUT is not finished. Parsed
    once per process for the same bytes (_FINISHED)."""
    missing = None if out.is_finished() else out.meta_json
    try:
        raw = None if missing else out.meta_pkl.read_bytes()
    except FileNotFoundError:
        missing = out.meta_pkl
    if missing is not None:
        raise OutputError(
            f"{out.where} is not a finished tokpipe output (no {missing.name}): see where it stands with tokpipe "
            f"status {shlex.quote(out.where)}"
        )
    digest = hashlib.sha256(raw).digest()
    if digest not in _FINISHED:
        if len(_FINISHED) >= FINISHED_KEPT:
            _FINISHED.clear()
        _FINISHED[digest] = _parsed(load_meta_pkl(out.meta_pkl, raw), out.meta_pkl)  # damaged: its UserError
    return _FINISHED[digest]


# meta.pkl's sha256 -> its Meta. A Mixture of a split's groups opens a loader a group, each of which parsed meta whole:
# for 2,000 groups, 2,000 parses of 2,000 groups' entries (44 ms each), 73 s and 4.7 GB in all.
_FINISHED: dict[bytes, Meta] = {}
FINISHED_KEPT = 16


def _parsed(raw: dict, path: Path) -> Meta:
    try:
        return Meta.of(raw)
    except (KeyError, TypeError, ValueError) as e:  # JSON, or a pickle of plain values, but no meta
        raise damaged(path, e, meta_fix(path)) from None
