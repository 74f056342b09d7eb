"""A file's name in a dataset: whether it is a shard (and if not, why it is passed over), the split Hugging Face
datasets would read it into, and its key in OUT. The same rules for a folder (manifest.py) and for a prefix on an
object store (objects.py)."""

import hashlib
import re
from collections import Counter
from collections.abc import Callable

import orjson

from tokpipe.errors import UserError

HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # ORG/NAME, as the hub names a repository
REPO_PREFIX = "datasets--"  # a dataset repo's folder in a Hugging Face cache: datasets--ORG--NAME
# JSON Lines, plain or compressed as Hugging Face datasets decompresses it (the magic bytes say how: source/jsonl.py)
SHARD_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.zstd", ".jsonl.gz", ".jsonl.bz2", ".jsonl.xz", ".json.gz")
SHARD_SUFFIXES += (".json.zst", ".json.bz2", ".json.xz", ".ndjson", ".parquet")
SHARD_SUFFIXES += (".arrow",)  # Hugging Face datasets' own files: save_to_disk's, its cache's
# A `.json` file is a shard when it is JSON Lines or one JSON array, as Hugging Face datasets' json builder reads it
# (C4's uncompressed files, alpaca_data.json): its first line is a JSON object, or begins with `[`. Else (a
# dataset_info.json, one JSON object) it is passed over, named, as is a file of a data format tokpipe does not read:
# never left out without a word.
JSON_SUFFIX = ".json"
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which some writers put first
# A file of data, read or not: x.json, x.jsonl.lz4, x.csv.gz, x.arrow, x.txt, x.tar, x.zip (every shard suffix but
# .parquet too)
DATA_FILE = re.compile(r"\.(jsonl?|ndjson|csv|tsv|arrow|txt|tar|zip)(\.\w+)?$", re.IGNORECASE)
ARCHIVE = ".zip"  # HF datasets reads the files inside, in its split's format (one_format keeps it)
KEY_BYTES = 200  # of a shard's key (shard_key): with `.json`, `.bin`, `.lock` after it, under a file name's 255
JSON_HEAD_BYTES = 1 << 20  # read of a .json file at a time to find its first line (first_line)
# Files Hugging Face datasets never reads as data (datasets/data_files.py FILES_TO_IGNORE), and save_to_disk's state.
METADATA_FILES = {"config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
# Splits as Hugging Face datasets finds them in a repository's paths (src/datasets/data_files.py, read at
# b7cb10b: SPLIT_KEYWORDS, and the KEYWORDS_IN_DIR_NAME / KEYWORDS_IN_FILENAME patterns with NON_WORDS_CHARS; the
# hub's "File names and splits" page): a keyword anywhere in a folder or file name, delimited by the name's ends
# or by `-`, `_`, `.`, a space or a digit (`en/c4-validation.00000-of-00008.json.gz`, `wiki_test_0.jsonl`).
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_NAMES_SPLIT = {
    split: re.compile(rf"(?:^|(?<=[-._ 0-9]))(?:{'|'.join(words)})(?=[-._ 0-9]|$)")
    for split, words in SPLIT_KEYWORDS.items()
}
_NAMES_SPLIT_ANY_CASE = {split: re.compile(pattern.pattern, re.IGNORECASE) for split, pattern in _NAMES_SPLIT.items()}


# The hub's sharded files, data/{split}-00000-of-00003.*: where there are any, HF datasets reads them alone.
SHARDED = re.compile(r"data/(?P<split>[^/]+?)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")


def split_of(relpath: str, rank: str = "folders") -> str | None:
    """The split a path names (SPLIT_KEYWORDS) in its folders' names, or with rank "file" in its file's name; None:
    none. A path that names two at once (`train/dev/`, `train_test_0.jsonl`), which HF datasets would read into
    both, is refused; so is one that names a split in other letter case only (`Validation/`), which HF datasets
    does not take for one (it would train on it, or leave it out)."""
    *folders, name = relpath.split("/")
    names = folders if rank == "folders" else [name]
    named = sorted(split for split, pattern in _NAMES_SPLIT.items() if any(pattern.search(n) for n in names))
    cased = sorted(s for s, pattern in _NAMES_SPLIT_ANY_CASE.items() if any(pattern.search(n) for n in names))
    if cased and not named:
        raise UserError(
            f"{relpath} names the {cased[0]} split in other letter case, which Hugging Face datasets does not take for"
            " a split (it would train on it, or leave it out): rename it in lower case, or name it in a card's configs"
        )
    if len(named) > 1:
        raise UserError(
            f"{relpath} names more than one split ({' and '.join(named)}), and Hugging Face datasets would read it"
            " into each: give it a path that names one (a folder of symlinks to the shards, with --allow-outside)"
        )
    return named[0] if named else None


def splits_of(relpaths: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The split of each file of data, as HF datasets infers splits where no card says (data_files.py
    _get_data_files_patterns, read at 5.2): the first of these that any file fits decides for all, and a file that
    does not fit it is left out, (relpath -> why): the hub's data/{split}-NNNNN-of-NNNNN.* files (SHARDED); else
    paths that name a split in a folder (`train/`, `en/c4-validation/`); else in the file's name
    (`c4-validation.00000.json`); else all, train. A sharded file's own split name other than the three, which HF
    datasets reads as a split of that name, is refused."""
    sharded = {r: m["split"] for r in relpaths if (m := SHARDED.fullmatch(r))}
    for relpath, split in sharded.items():
        if split not in SPLIT_KEYWORDS:
            raise UserError(
                f"{relpath} is of a split named {split!r}, which Hugging Face datasets reads as a split of that name;"
                " tokpipe writes train, validation and test: name its files one of those in a card's configs"
            )
    if sharded:
        why = "not one of data/{split}-NNNNN-of-NNNNN.*, which Hugging Face datasets reads alone where there are any"
        return dict(sharded), {r: why for r in relpaths if r not in sharded}
    for rank in ("folders", "file"):
        named = {r: split for r in relpaths if (split := split_of(r, rank))}
        if named:
            where = "a folder's name" if rank == "folders" else "a file's name"
            why = f"names no split in {where}, where other files do: Hugging Face datasets reads none of it"
            return named, {r: why for r in relpaths if r not in named}
    return dict.fromkeys(relpaths, "train"), {}


def layout_hint(where: str, names: list[str]) -> str:
    """What was found in a dataset dir (a few of its names) and what is expected there."""
    found = ", ".join(names[:8]) if names else "nothing"
    return (
        f"found {found} in {where}; expected a Hugging Face cache root (holding datasets--ORG--NAME/), one"
        " datasets--ORG--NAME folder, a snapshots/REV folder, or a folder of *.jsonl[.zst|.gz|.bz2|.xz], *.parquet or"
        " *.arrow shards"
    )


def pick_repo(repo_ids: list[str], repo_id: str | None, where: str, hint: Callable[[], str]) -> str:
    """Which of the datasets of a cache at `where` to read: `repo_id`, else the only one; `hint()`: layout_hint."""
    found = [r for r in repo_ids if repo_id in (None, r)]
    if not found:
        what = "dataset repos" if repo_id is None else f"dataset {repo_id!r}"
        raise UserError(f"no {what} in the Hugging Face cache at {where}; {hint()}")
    if len(found) > 1:
        names = ", ".join(found)
        raise UserError(f"the cache at {where} holds several datasets ({names}): pick one with --repo-id ORG/NAME")
    return found[0]


def pick_revision(repo_id: str, snapshots: dict[str, str], refs: dict[str, str], revision: str | None) -> str:
    """The commit whose snapshot to read, of a repo's `snapshots` (commit -> where) and `refs` (name -> commit):
    `revision` (a ref or a commit), else refs/main, else the only snapshot."""
    by_ref = {ref: commit for ref, commit in refs.items() if commit in snapshots}
    if revision is not None:
        chosen = by_ref.get(revision) or (revision if revision in snapshots else None)
        if chosen is None:
            raise UserError(
                f"revision {revision!r} not in the cache for {repo_id}: it has refs {sorted(by_ref)} "
                f"and snapshots {sorted(snapshots)}"
            )
        return chosen
    if "main" in by_ref:
        return by_ref["main"]
    if len(snapshots) == 1:
        return next(iter(snapshots))
    raise UserError(
        f"{repo_id} has {len(snapshots)} snapshots and no refs/main: pick one with --revision "
        f"({', '.join(sorted(snapshots))})"
    )


def is_hub_name(text: str) -> bool:
    """Whether `text` is a hub repository's name, ORG/NAME (not a path such as ./qwen3 or a--b/c)."""
    if not HUB_NAME.fullmatch(text):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def repo_id_of(folder: str) -> str:
    """ORG/NAME of a cache's datasets--ORG--NAME folder."""
    return folder.removeprefix(REPO_PREFIX).replace("--", "/")


def refuse_a_cache_inside(where: str, relpaths: list[str]) -> None:
    """A folder of shards is never read into a Hugging Face cache below it (HF_HOME's hub/, or a folder above one):
    every dataset repo's snapshot would be read as one dataset, and where the cache's links were copied as text
    files, their text as shards."""
    for relpath in relpaths:
        folders = relpath.split("/")[:-1]
        repo = next((i for i, name in enumerate(folders) if name.startswith(REPO_PREFIX)), None)
        if repo is not None:
            cache = "/".join([where.rstrip("/"), *folders[:repo]])
            raise UserError(
                f"{where} holds a Hugging Face cache at {cache}: pass --dataset-dir {cache} (with --repo-id ORG/NAME"
                " where it holds several datasets)"
            )


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # a pointer file's first line; the spec keeps it < 1 KiB
CACHE_LINK = re.compile(rb"(\.\./)+blobs/[0-9a-f]{40,64}")  # a cache's symlink written as a file (manifest.py)


def refuse_a_pointer(relpath: str, size: int, head) -> None:
    """A Git LFS pointer (a clone without git-lfs), or a Hugging Face cache's link written as a file (a snapshot
    copied out of a cache whose links are files), where a shard's bytes should be: refused as a download not finished
    is, since every such shard fails its run. `head()`: the file's first line, read only of one small enough."""
    line = head().strip() if size < 1024 else b""
    if line.startswith(LFS_POINTER):
        raise UserError(
            f"{relpath} is a Git LFS pointer, not its data (a clone without git-lfs): fetch the data (`git lfs pull`,"
            " or `hf download ORG/NAME --repo-type dataset`), then run the manifest"
        )
    if CACHE_LINK.fullmatch(line):
        raise UserError(
            f"{relpath} is a Hugging Face cache's link written as a file ({line.decode()}), not its data: give"
            " --dataset-dir the cache it was copied from, whose blobs/ holds the data"
        )


def is_metadata(relpath: str) -> bool:
    """One of HF datasets' own files (METADATA_FILES): never data, whatever globs or names match it."""
    return relpath.rsplit("/", 1)[-1] in METADATA_FILES


def unrequested(relpath: str, pattern: str = "**") -> bool:
    """Whether HF datasets passes over a file that `pattern` (a data_files glob; `**`: a repo without a card's) matches:
    a hidden one (a name in its path that begins with `.`) or one in a special folder (`__x`), unless the pattern names
    as many of them (datasets/data_files.py _is_unrequested_hidden_file... and _is_inside_unrequested_special_dir)."""

    def counts(path: str) -> tuple[int, int]:
        return hidden_parts(path), sum(part.startswith("__") for part in path.split("/")[:-1])

    return counts(relpath) != counts(pattern)


def hidden_parts(path: str) -> int:
    """How many names in a path (or a glob) begin with `.`: hidden, as HF datasets and a shell's `ls` have it."""
    return sum(part.startswith(".") and set(part) != {"."} for part in path.split("/"))


# The builder HF datasets reads a file with, by a suffix of its name (datasets/packaged_modules _EXTENSION_TO_MODULE),
# and those it prefers on a draw of counts, first to last (load.py infer_module_for_data_files_list).
FORMATS = {".json": "JSON", ".jsonl": "JSON", ".ndjson": "JSON", ".parquet": "Parquet", ".geoparquet": "Parquet"}
FORMATS |= {".gpq": "Parquet", ".csv": "CSV", ".tsv": "CSV", ".arrow": "Arrow", ".txt": "text", ".tar": "WebDataset"}
PREFERRED = (".parquet", ".arrow", ".jsonl", ".json", ".csv")


def one_format(placed: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The files placed in splits, as HF datasets reads them: in the one format most of each split's files are (each
    suffix of a name counted, `x.jsonl.zst` .jsonl and .zst), the others left out, (relpath -> why). Splits of two
    formats are refused: HF datasets refuses them."""
    chosen = {split: _format([r for r, s in placed.items() if s == split]) for split in dict.fromkeys(placed.values())}
    if len(set(chosen.values())) > 1:
        what = ", ".join(f"{split} {fmt}" for split, fmt in chosen.items())
        raise UserError(
            f"the splits' files are of different formats ({what}), and Hugging Face datasets refuses to read such"
            " splits: give each split files of one format, or name them in a card's configs"
        )
    if not chosen:
        return placed, {}
    fmt = next(iter(chosen.values()))
    suffixes = "|".join(re.escape(s) for s, f in FORMATS.items() if f == fmt)
    of = re.compile(rf".*({suffixes})(\..+)?")
    why = f"not {fmt}, the format of most of its split's files: Hugging Face datasets reads those alone"
    kept = {r: split for r, split in placed.items() if of.fullmatch(r) or r.lower().endswith(ARCHIVE)}
    return kept, {relpath: why for relpath in placed if relpath not in kept}


def _format(relpaths: list[str]) -> str | None:
    counts = Counter("." + part.lower() for relpath in relpaths for part in relpath.rsplit("/", 1)[-1].split(".")[1:])
    ranked = sorted(counts, key=lambda s: (counts[s], *(s == p for p in PREFERRED), s), reverse=True)
    return next((FORMATS[s] for s in ranked if s in FORMATS), None)


def shard_key(relpath: str) -> str:
    """The shard's name in OUT, of its files there (<key>.json, <key>.bin, ...): its path, a folder's `/` a `__`. A
    longer one than KEY_BYTES (a deep path, or 85 CJK characters) is its end after 16 hex digits of the path's sha256:
    a file's name is at most 255 bytes, and such a shard failed every run (ENAMETOOLONG)."""
    suffix = next((s for s in (*SHARD_SUFFIXES, JSON_SUFFIX) if relpath.endswith(s)), "")
    key = relpath.removesuffix(suffix).replace("/", "__").encode()
    if len(key) <= KEY_BYTES:
        return key.decode()
    end = key[len(key) - KEY_BYTES + 17 :].decode(errors="ignore")  # a character cut in two goes
    return f"{hashlib.sha256(relpath.encode()).hexdigest()[:16]}-{end}"


def first_line(read) -> bytes:
    """A .json file's first line (past leading blank space), however long, or of an array (`[`) what was read of it:
    `read(start, stop)` gives its bytes, read JSON_HEAD_BYTES at a time until a newline or its end."""
    held, at, start = bytearray(), 0, None  # start: where the line begins, once a byte not blank is read
    while piece := read(at, at + JSON_HEAD_BYTES):
        searched, at = len(held), at + len(piece)
        held += piece
        if start is None:
            if not held.strip():
                continue
            start = searched = len(held) - len(held.lstrip())
        if held.find(b"\n", searched) >= 0 or held[start:].removeprefix(BOM)[:1] == b"[":
            break
    return b"" if start is None else bytes(held[start:]).split(b"\n", 1)[0]


def not_a_shard(relpath: str, head) -> str | None:
    """Why a file of data the walk met is no shard (None: it is one). A .json file is one when its first line
    (`head()`: first_line's) is a JSON object (JSON Lines) or begins a JSON array, as Hugging Face's json builder
    reads them."""
    if is_metadata(relpath):
        return "Hugging Face datasets' metadata, never data"
    if relpath.endswith(SHARD_SUFFIXES):
        return None
    if relpath.lower().endswith(ARCHIVE):
        return "an archive, whose files Hugging Face datasets reads: tokpipe reads none; extract it to tokenize them"
    if not relpath.endswith(JSON_SUFFIX):
        return (
            "a format tokpipe does not read (it reads JSON Lines, plain or compressed with zstd, gzip, bz2 or xz,"
            " Parquet and Arrow): convert it to one of those to tokenize it"
        )
    line = head().removeprefix(BOM)
    try:
        if line.startswith(b"[") or isinstance(orjson.loads(line), dict):
            return None
    except orjson.JSONDecodeError:
        pass
    return (
        "neither JSON Lines nor a JSON array (its first line is no JSON object: metadata, or one JSON document);"
        " convert it to JSONL to tokenize it"
    )
