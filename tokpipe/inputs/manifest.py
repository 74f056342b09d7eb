"""Dataset dir -> ordered shard list, written as a manifest JSON with a content fingerprint.

The dataset dir may be a Hugging Face cache root, one `datasets--ORG--NAME` repo folder, one
`snapshots/REV` folder of it, or a plain folder of shards. The cache is read with huggingface_hub
(which knows refs/, snapshots/ and blobs/); we never guess at its layout. The same layouts under a prefix of an
object store (s3://BUCKET/PREFIX) are walked by objects.py, by these rules, into the same Manifest: its shards'
paths are s3:// URLs, and each records the object's ETag.

A manifest may list 100,000s of shards, so a loaded one never holds them: each pass over its
shards streams them from the file (ijson), and what a driver keeps is its counts and size. Folders are walked each
once (_walk); files are never deduplicated: in a cache two snapshot files may rightly link to one blob.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ijson
import orjson

from tokpipe.errors import UserError
from tokpipe.inputs import names
from tokpipe.inputs.card import CARD, Chosen, choose, configs_of, splits
from tokpipe.inputs.names import DATA_FILE, REPO_PREFIX, SHARD_SUFFIXES, first_line, not_a_shard, repo_id_of, shard_key
from tokpipe.store import is_url

MANIFEST_VERSION = 1
HEADER = ("root", "base", "allow_outside", "repo_id", "revision", "fingerprint")  # the fields before the shards
POINTER_MAX_BYTES = 512  # a cache's symlink as git and copy tools leave it where links drop: a text naming its blob


@dataclass(frozen=True, slots=True)
class Shard:
    split: str  # train | validation | test
    relpath: str  # path relative to the snapshot (or plain folder) root; fixes the order
    path: str  # absolute path of the bytes to read (the blob, for a cache), or the s3:// URL of an object
    size: int
    key: str  # file-system-safe unique name of the shard inside OUT/shards/<split>/
    etag: str | None = None  # of an object on a store, as listed: every read asks for it (a replaced one fails)

    @property
    def on_store(self) -> bool:
        """An object on a store (read by ranged GETs through each process's own client), not a file."""
        return is_url(self.path)

    def may_block(self) -> bool:
        """Whether reading it could block (a pipe, a device): the driver, which watches for stalls, never reads it."""
        try:
            return not self.on_store and not stat.S_ISREG(os.stat(self.path).st_mode)
        except FileNotFoundError:  # its read fails the shard (store.open_read)
            return False


@dataclass(frozen=True)
class Manifest:
    root: str
    base: str  # every shard's bytes lie in here (the repo folder of a cache), unless allow_outside
    allow_outside: bool
    repo_id: str | None
    revision: str | None
    fingerprint: str  # sha256 of what the output depends on: splits, order, paths, sizes (and ETags)
    counts: dict[str, int]  # shards per split, the splits in the order they first appear
    size: int  # bytes of all shards
    source: tuple[Shard, ...] | Path  # the shards of a built manifest, or the file a loaded one streams them from
    # (relpath, why) of each folder the builder passed over (a link to one listed already, an OUT); () once loaded
    passed_over: tuple[tuple[str, str], ...] = ()
    # (relpath, why) of each file of data the builder did not list (not JSON Lines, a format tokpipe does not read)
    files_passed_over: tuple[tuple[str, str], ...] = ()
    config: str | None = None  # the card's configs read, by name (inputs/card.py); None: the files' names' rules

    def shards(self, split: str | None = None) -> Iterator[Shard]:
        """The shards in manifest order (of one split, or all): one pass over the file of a loaded manifest."""
        shards = iter(self.source) if isinstance(self.source, tuple) else _read_shards(self.source)
        return shards if split is None else (s for s in shards if s.split == split)

    def header(self) -> dict:
        return {"version": MANIFEST_VERSION} | {k: getattr(self, k) for k in HEADER} | {"config": self.config}


def fingerprint_of(shards: Iterable[Shard]) -> str:
    """sha256 of the JSON list [[split, relpath, size], ...], computed a shard at a time; a shard on a store adds its
    ETag ([split, relpath, size, etag]): an object replaced by one of the same size is other input. A local shard's
    entry is as it always was, so the OUTs of earlier manifests still resume."""
    hasher = hashlib.sha256(b"[")
    for i, s in enumerate(shards):
        entry = [s.split, s.relpath, s.size] + ([s.etag] if s.etag is not None else [])
        hasher.update((b"," if i else b"") + json.dumps(entry, separators=(",", ":")).encode())
    hasher.update(b"]")
    return hasher.hexdigest()


def _read_shards(path: Path) -> Iterator[Shard]:
    with open(path, "rb") as f:
        for item in ijson.items(f, "shards.item"):
            yield Shard(**item)


def _read_header(path: Path) -> dict:
    """The manifest's fields other than its shards, without reading the shards (written before them)."""
    header = {}
    with open(path, "rb") as f:
        for prefix, event, value in ijson.parse(f):
            if prefix == "shards":
                break
            if prefix and "." not in prefix and event not in ("start_map", "start_array", "map_key"):
                header[prefix] = value
    return header


def _resolve_pointer(path: Path, blobs_dir: Path | None) -> Path:
    """Follow a symlink-turned-text-file (`../../../../blobs/<sha>`) back to its blob."""
    if blobs_dir is None or path.is_symlink() or path.stat().st_size > POINTER_MAX_BYTES:
        return path
    target_text = path.read_bytes().strip()
    if not target_text.startswith(b"../") or b"\n" in target_text:
        return path
    target = (path.parent / target_text.decode("utf-8", "replace")).resolve()
    if target.parent != blobs_dir.resolve():
        raise UserError(f"{path} points to {target}, outside the repo's blobs/ folder {blobs_dir}")
    if not target.is_file():
        raise UserError(f"{path} names blob {target.name}, which is missing from {blobs_dir}: re-download the dataset")
    return target


def _check_inside(shard_path: str, relpath: str, base: str) -> None:
    # normpath first: "base/../elsewhere" is outside, whatever its first component says. An object's key is its
    # name, never a path to resolve.
    where = shard_path if is_url(shard_path) else os.path.normpath(shard_path)
    if not where.startswith(base.rstrip("/") + "/"):
        raise UserError(
            f"{relpath} resolves to {shard_path}, outside the dataset folder {base}; pass --allow-outside if "
            "that is intended"
        )


def _walk(
    root: Path, is_out: Callable[[Path], bool] | None, hidden: bool = False
) -> tuple[list[tuple[Path, str]], list[tuple[str, str]]]:
    """The shard files under root, (path, relpath), and the folders passed over, (relpath, why).

    Each real folder (st_dev, st_ino) is walked once, by the path with no symlink in it where there is one,
    else by the first link to it in path order: the links to folders wait until every real folder is walked.
    So a link to a folder listed already (`ln -s ../train extra/mirror`, `ln -s . loop`) is passed over,
    whatever order the file system lists names in; a link to a folder not listed yet is walked. Hidden
    folders are walked only where a card's glob names one (`hidden`); a tokpipe OUT (`is_out`) is passed over."""
    seen = {_identity(root): ""}  # each folder walked -> its relpath
    files, passed_over = [], []
    links: list[tuple[str, Path]] = []  # a heap of (relpath, path): the links to folders met, walked last

    def keep(folder: Path, rel: str) -> bool:
        """Whether to walk a folder (it is then seen); if not, why it is passed over."""
        identity = _identity(folder)
        first = seen.get(identity)
        if first is not None:
            above = first == "" or rel.startswith(first + "/")
            why = "above it (a loop)" if above else "listed already"
            passed_over.append((rel, f"a link to {first + '/' if first else 'the dataset folder'}, {why}"))
            return False
        if is_out is not None and is_out(folder):
            passed_over.append((rel, "a tokpipe OUT, never input"))
            return False
        seen[identity] = rel
        return True

    def walk(top: Path, top_rel: str) -> None:
        for dirpath, dirnames, filenames in os.walk(top):  # links to folders come in dirnames, and are not walked
            here = Path(dirpath)
            below = here.relative_to(top).as_posix()
            rel = "/".join(part for part in (top_rel, below) if part not in ("", "."))
            prefix = rel + "/" if rel else ""
            data = (n for n in filenames if DATA_FILE.search(n) or n.endswith(SHARD_SUFFIXES))
            files.extend((here / n, prefix + n) for n in data)
            walked = []
            for name in sorted(d for d in dirnames if hidden or not d.startswith(".")):
                if (here / name).is_symlink():
                    heapq.heappush(links, (prefix + name, here / name))
                elif keep(here / name, prefix + name):
                    walked.append(name)
            dirnames[:] = walked

    walk(root, "")
    while links:
        rel, link = heapq.heappop(links)
        if keep(link, rel):
            walk(link, rel)
    return files, passed_over


def _identity(folder: Path) -> tuple[int, int]:
    st = folder.stat()
    return st.st_dev, st.st_ino


def _shard(pointed: Path, relpath: str, split: str, base: Path, allow_outside: bool) -> Shard:
    source = pointed.resolve()
    try:  # first: a link to nothing is refused as such, not as outside, where --allow-outside was no help
        st = source.stat()
    except FileNotFoundError:
        raise UserError(f"{relpath} is a link to {source}, which does not exist: re-download the dataset") from None
    if not allow_outside:
        _check_inside(str(source), relpath, str(base))
    # A named pipe (or a device) is no shard: reading it may block forever, and its size says nothing.
    if not stat.S_ISREG(st.st_mode):
        raise UserError(
            f"{relpath} is not a regular file (a named pipe, a socket or a device): put the shard there, or remove it"
        )
    names.refuse_a_pointer(relpath, st.st_size, functools.partial(_first_line, source))
    return Shard(split=split, relpath=relpath, path=str(source), size=st.st_size, key=shard_key(relpath))


def _layout_hint(directory: Path) -> str:
    return names.layout_hint(str(directory), sorted(p.name for p in directory.iterdir()) if directory.is_dir() else [])


def _locate(
    given: str | os.PathLike, repo_id: str | None, revision: str | None
) -> tuple[Path, Path | None, str | None, str | None]:
    """(shard root, blobs dir, repo id, revision) for any of the accepted layouts, or a hub name ORG/NAME no folder
    here has, read from the Hugging Face cache as load_dataset(ORG/NAME) reads it offline."""
    dataset_dir = Path(given).absolute()
    if not dataset_dir.exists() and names.is_hub_name(os.fspath(given)):
        from huggingface_hub import constants

        dataset_dir = Path(constants.HF_HUB_CACHE) / (REPO_PREFIX + os.fspath(given).replace("/", "--"))
        if not dataset_dir.is_dir():
            raise UserError(
                f"no folder {given} here, and no dataset {given} in the Hugging Face cache {dataset_dir.parent} (set by"
                f" HF_HUB_CACHE or HF_HOME): fetch it (huggingface-cli download {given} --repo-type dataset), or pass"
                " its folder"
            )
    if not dataset_dir.is_dir():
        raise UserError(f"--dataset-dir {dataset_dir} is not a directory; " + _layout_hint(dataset_dir.parent))
    cache_root, snapshot = None, None
    if dataset_dir.name.startswith(REPO_PREFIX):
        cache_root = dataset_dir.parent
        repo_id = repo_id or repo_id_of(dataset_dir.name)
    elif dataset_dir.parent.name == "snapshots" and dataset_dir.parent.parent.name.startswith(REPO_PREFIX):
        cache_root = dataset_dir.parent.parent.parent
        repo_id = repo_id or repo_id_of(dataset_dir.parent.parent.name)
        snapshot = dataset_dir.name
    elif any(p.name.startswith(REPO_PREFIX) for p in dataset_dir.iterdir()):
        cache_root = dataset_dir
    if cache_root is None:
        return dataset_dir, None, None, None

    # Imported here, not at the top: every Ray worker imports this module, and only `manifest` needs it (~0.1 s).
    from huggingface_hub import scan_cache_dir

    # scan_cache_dir warns of stray files beside the repos (fine), and of a damaged repo, which it leaves out.
    scanned = scan_cache_dir(cache_root)
    repos = {r.repo_id: r for r in scanned.repos if r.repo_type == "dataset"}
    damaged = {repo_id_of(m[0]): str(w) for w in scanned.warnings if (m := re.search(f"{REPO_PREFIX}[^/]+", str(w)))}
    picked = names.pick_repo(sorted({*repos, *damaged}), repo_id, str(cache_root), lambda: _layout_hint(cache_root))
    if picked not in repos:
        raise UserError(
            f"{picked} in the cache at {cache_root} is damaged ({damaged[picked]}): a download cut short or a blob "
            f"removed; download it again (huggingface-cli download {picked} --repo-type dataset), then run the manifest"
        )
    repo = repos[picked]
    snapshots = {r.commit_hash: str(r.snapshot_path) for r in repo.revisions}
    rev = names.pick_revision(
        repo.repo_id, snapshots, {ref: r.commit_hash for r in repo.revisions for ref in r.refs}, snapshot or revision
    )
    return Path(snapshots[rev]), Path(repo.repo_path) / "blobs", repo.repo_id, rev


def build_manifest(
    dataset_dir: str | os.PathLike,
    repo_id: str | None = None,
    revision: str | None = None,
    allow_outside: bool = False,
    is_out: Callable[[Path], bool] | None = None,
    configs: tuple[str, ...] = (),
) -> Manifest:
    """The ordered shard list of a dataset in a folder (one under an s3:// prefix: objects.py, which
    tokpipe.build_manifest calls for an s3:// URL): the files of the card's config (`configs`, else its default:
    card.py), or without one, every file of data, in the splits their names say. Shards whose bytes lie outside it
    (through symlinks) are refused unless allow_outside: a manifest must not quietly read files from elsewhere.
    `is_out` tells a tokpipe OUT (tokpipe/layout/ knows one; the commands pass it): one inside the dataset is passed
    over."""
    root, blobs_dir, repo_id, revision = _locate(dataset_dir, repo_id, revision)
    _refuse_unfinished_downloads(root, blobs_dir, repo_id)
    base = (blobs_dir.parent if blobs_dir else root).resolve()
    card = root / CARD
    text = _resolve_pointer(card, blobs_dir).read_text(errors="replace") if card.is_file() else ""
    chosen = choose(configs_of(text), configs, repo_id or str(root))
    files, passed_over = _walk(root, is_out, chosen is not None and chosen.hidden)
    placed, left = splits(chosen, [relpath for _, relpath in files])
    shards, files_passed_over = [], []
    for path, relpath in files:
        pointed = _resolve_pointer(path, blobs_dir)
        if why := left.get(relpath) or not_a_shard(relpath, functools.partial(_first_line, pointed)):
            files_passed_over.append((relpath, why))
        else:
            shards.append(_shard(pointed, relpath, placed[relpath], base, allow_outside))
    return manifest_of(
        str(root), str(base), allow_outside, repo_id, revision, shards, passed_over, lambda: _layout_hint(root),
        files_passed_over, chosen,
    )  # fmt: skip


def _refuse_unfinished_downloads(root: Path, blobs_dir: Path | None, repo_id: str | None) -> None:
    """huggingface_hub downloads a file as `*.incomplete` (a blob; in a --local-dir folder, under .cache/) and puts it
    in place once whole: one still running, or cut, is a file a manifest would leave out without a word."""
    downloads = blobs_dir if blobs_dir is not None else root / ".cache" / "huggingface" / "download"
    if unfinished := sorted(downloads.rglob("*.incomplete")) if downloads.is_dir() else []:
        shown = f"{unfinished[0].relative_to(downloads.parent)}, {unfinished[0].stat().st_size / 1e6:,.1f} MB so far"
        raise UserError(
            f"{downloads} holds {len(unfinished):,} download(s) not finished ({shown}): their files are not in the "
            f"dataset yet. Let the download end, or run it again (huggingface-cli download {repo_id or 'ORG/NAME'} "
            "--repo-type dataset), then run the manifest; a download given up for good: remove its .incomplete file"
        )


def _first_line(path: Path) -> bytes:
    with open(path, "rb") as f:
        return first_line(lambda start, stop: f.read(stop - start))


def manifest_of(
    root: str,
    base: str,
    allow_outside: bool,
    repo_id: str | None,
    revision: str | None,
    shards: list[Shard],
    passed_over: list[tuple[str, str]],
    hint: Callable[[], str],
    files_passed_over: list[tuple[str, str]] = (),
    chosen: Chosen | None = None,
) -> Manifest:
    """The manifest of the shards a walk found (of a folder, or of a prefix on a store): in order, each key once.
    None found: refused, with `hint()` (layout_hint) of what the dataset dir holds, and each file passed over."""
    if repo_id is None:
        names.refuse_a_cache_inside(root, [s.relpath for s in shards] + [relpath for relpath, _ in files_passed_over])
    if not shards:
        why = "".join(f"; passed over {relpath}: {why}" for relpath, why in sorted(files_passed_over))
        raise UserError(f"no shards (*{', *'.join(SHARD_SUFFIXES)}) under {root}{why}; {hint()}")
    # The order of docs/design.md: per split, plain string order of the path relative to the snapshot root.
    shards.sort(key=lambda s: s.relpath)
    keys = {}
    for shard in shards:
        other = keys.setdefault((shard.split, shard.key), shard.relpath)
        if other != shard.relpath:
            raise UserError(f"{other} and {shard.relpath} would be written to the same shard file: rename one")
    counts, size = dict(Counter(s.split for s in shards)), sum(s.size for s in shards)
    return Manifest(
        root, base, allow_outside, repo_id, revision, fingerprint_of(shards), counts, size, tuple(shards),
        tuple(passed_over), tuple(sorted(files_passed_over)), None if chosen is None else ", ".join(chosen.names),
    )  # fmt: skip


def write_manifest(manifest: Manifest, path: str | os.PathLike) -> None:
    """Write it as JSON with one shard per line; a loaded manifest's shards stream through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(manifest.header())[:-1] + b', "shards": [')  # the header, left open for the shards
            for i, shard in enumerate(manifest.shards()):
                f.write((b"," if i else b"") + b"\n" + orjson.dumps(shard))
            f.write(b"\n]}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: no half-written manifest left beside the path
        tmp.unlink(missing_ok=True)
        raise


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Check a manifest file in one streaming pass and keep what that pass counts; its shards stay in the file."""
    path = Path(path).absolute()
    counts, size = Counter(), 0

    def tallied(shards: Iterator[Shard], header: dict) -> Iterator[Shard]:
        nonlocal size
        for shard in shards:
            counts[shard.split] += 1
            size += shard.size
            if not header["allow_outside"]:
                _check_inside(shard.path, shard.relpath, header["base"])
            yield shard

    try:
        header = _read_header(path)
        if header.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {header.get('version')!r}, expected {MANIFEST_VERSION}")
        fingerprint = fingerprint_of(tallied(_read_shards(path), header))
        manifest = Manifest(*(header[k] for k in HEADER), dict(counts), size, path, config=header.get("config"))
    except FileNotFoundError:
        raise UserError(
            f"manifest {path} does not exist: create it with `tokpipe manifest --dataset-dir DIR -o {path}`"
        ) from None
    except IsADirectoryError:
        raise UserError(
            f"manifest {path} is a folder: a manifest is the file `tokpipe manifest --dataset-dir {path} -o M.json` "
            "writes of a dataset folder; pass that file"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError, ijson.JSONError) as e:
        why = str(e).partition("\n")[0]  # ijson's parse errors go on to show the bytes over several lines
        raise UserError(
            f"manifest {path} is not a tokpipe manifest ({type(e).__name__}: {why}): rebuild it with `tokpipe manifest`"
        ) from None
    if fingerprint != manifest.fingerprint:
        raise UserError(f"manifest {path} was edited by hand (its fingerprint does not match its shards): rebuild it")
    return manifest
