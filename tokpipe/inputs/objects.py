"""A dataset under a prefix of an object store (s3://BUCKET/PREFIX) -> its manifest, by the rules manifest.py walks
a folder by: a Hugging Face cache root, one datasets--ORG--NAME folder, one snapshots/REV folder of it, or a plain
folder of shards; splits from the path (split_of), the same order, keys and refusals.

A store has no folders and no links: a folder is a prefix of keys up to a `/`. The prefix is listed once (a LIST a
thousand keys) and the layout read from the keys, so no folder is met twice and none is passed over as a link; a
folder whose name starts with `.` is not walked unless a card's glob names one, and a tokpipe OUT (run.json and
manifest.json side by side, as a copied-up OUT has them) is passed over. A cache copied up (`aws s3 sync`,
`rclone copy`) holds each snapshot file as an object of its own, the links followed; a link kept as a small text
file naming a blob, which tokpipe follows on disk, is not followed here. Each shard's size and ETag are the
listing's: the manifest records both, and every read of the shard asks for that ETag (tokpipe/store/reader.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from tokpipe.errors import UserError
from tokpipe.inputs import names
from tokpipe.inputs.card import CARD, choose, configs_of, splits
from tokpipe.inputs.manifest import Manifest, Shard, manifest_of
from tokpipe.inputs.names import DATA_FILE, REPO_PREFIX, SHARD_SUFFIXES, first_line, not_a_shard, repo_id_of, shard_key
from tokpipe.store import Bucket, Object, Url, is_url


def build_store_manifest(
    dataset_dir: str,
    repo_id: str | None = None,
    revision: str | None = None,
    allow_outside: bool = False,
    is_out: Callable[..., bool] | None = None,
    configs: tuple[str, ...] = (),
) -> Manifest:
    """The ordered shard list of a dataset under an s3:// prefix, by manifest.py's rules (the card's config read);
    `is_out(folder, names)` tells a tokpipe OUT from the names of the objects in a folder. A store's keys hold no
    link: `allow_outside` changes nothing here."""
    url = Url.parse(dataset_dir)
    bucket = Bucket.of(url)
    prefix = url.key.rstrip("/") + "/" if url.key.strip("/") else ""  # a folder: `a/b` holds a/b/x, not a/bc
    bucket.check(prefix)  # a wrong key, no such bucket, no store there: one line now
    listed = {o.key: o for o in bucket.list(prefix) if not o.key.endswith("/")}  # not a console's "folder" object
    if not listed:
        raise UserError(f"--dataset-dir {bucket.where(prefix)} holds no object: is the bucket or the prefix misspelt?")
    root, repo, repo_id, revision = _locate(bucket, prefix, listed, repo_id, revision)
    card = bucket.get(root + CARD)[0].decode(errors="replace") if root + CARD in listed else ""
    chosen = choose(configs_of(card), configs, repo_id or bucket.where(root))
    files, passed_over = _walk(listed, root, is_out, chosen is not None and chosen.hidden)
    placed, left = splits(chosen, [relpath for _, relpath in files])
    shards, files_passed_over = [], []
    for found, relpath in files:
        if why := left.get(relpath) or not_a_shard(relpath, functools.partial(_first_line, bucket, found)):
            files_passed_over.append((relpath, why))
        else:
            names.refuse_a_pointer(relpath, found.size, functools.partial(_first_line, bucket, found))
            split = placed[relpath]
            shards.append(Shard(split, relpath, bucket.where(found.key), found.size, shard_key(relpath), found.etag))
    return manifest_of(
        bucket.where(root), bucket.where(repo or root), allow_outside, repo_id, revision, shards, passed_over,
        lambda: _hint(bucket, listed, root), files_passed_over, chosen,
    )  # fmt: skip


def _hint(bucket: Bucket, listed: dict[str, Object], folder: str) -> str:
    """layout_hint of what a folder holds."""
    held = {key[len(folder) :].partition("/")[0] for key in listed if key.startswith(folder)}
    return names.layout_hint(bucket.where(folder), sorted(held))


def _first_line(bucket: Bucket, found: Object) -> bytes:
    return first_line(lambda start, stop: bucket.read(found.key, start, stop, found.etag)[0])


def check_reachable(manifest: Manifest) -> None:
    """Refuse, before any work, a manifest of shards on a store that this process cannot read: unreachable, a wrong
    key, no bucket (store.Bucket.check: one line naming the URL and what the store answered)."""
    if is_url(manifest.base):
        url = Url.parse(manifest.base)
        Bucket.of(url).check(url.key)


@contextlib.contextmanager
def manifest_here(path: str | os.PathLike) -> Iterator[str | os.PathLike]:
    """A run's manifest as a file here: `path`, or the copy of one on a store (OUT's own, as `tokpipe status` names
    it there), which the run streams until OUT holds its own copy, and which goes with the run."""
    if not is_url(path):
        yield path
        return
    found = Bucket.of(url := Url.parse(path)).get(url.key)
    if found is None:
        raise UserError(f"manifest {path} does not exist (an OUT on a store keeps its own: OUT/manifest.json)")
    with tempfile.TemporaryDirectory(prefix="tokpipe-manifest-") as here:
        (copy := Path(here) / "manifest.json").write_bytes(found[0])
        yield copy


def _locate(
    bucket: Bucket, prefix: str, listed: dict[str, Object], repo_id: str | None, revision: str | None
) -> tuple[str, str | None, str | None, str | None]:
    """(shard root, repo folder, repo id, revision) for any of the accepted layouts, as prefixes ending in `/`."""
    *above, name = [""] + prefix.rstrip("/").split("/")
    if name.startswith(REPO_PREFIX):  # one repo folder
        return _snapshot(bucket, prefix, listed, repo_id or repo_id_of(name), revision)
    if len(above) >= 3 and above[-1] == "snapshots" and above[-2].startswith(REPO_PREFIX):  # one snapshot
        return prefix, prefix.rsplit("/", 3)[0] + "/", repo_id or repo_id_of(above[-2]), name
    folders = {rel.partition("/")[0] for rel in (key[len(prefix) :] for key in listed) if "/" in rel}
    repos = {repo_id_of(f): f for f in sorted(folders) if f.startswith(REPO_PREFIX)}
    if not repos:
        return prefix, None, None, None
    repo_id = names.pick_repo(list(repos), repo_id, bucket.where(prefix), lambda: _hint(bucket, listed, prefix))
    return _snapshot(bucket, f"{prefix}{repos[repo_id]}/", listed, repo_id, revision)


def _snapshot(
    bucket: Bucket, repo: str, listed: dict[str, Object], repo_id: str, revision: str | None
) -> tuple[str, str, str, str]:
    """The snapshot of a repo folder to read, chosen by its refs/ (each ref a small object holding a commit) as
    huggingface_hub chooses one on disk (names.pick_revision)."""
    snapshots, refs = {}, {}  # commit -> its folder; ref -> commit
    for key in listed:
        kind, _, rest = key.removeprefix(repo).partition("/") if key.startswith(repo) else ("", "", "")
        if kind == "snapshots" and "/" in rest:
            commit = rest.partition("/")[0]
            snapshots[commit] = f"{repo}snapshots/{commit}/"
        elif kind == "refs" and rest and (found := bucket.get(key)) is not None:
            refs[rest] = found[0].decode("utf-8", "replace").strip()
    commit = names.pick_revision(repo_id, snapshots, refs, revision)
    return snapshots[commit], repo, repo_id, commit


def _walk(
    listed: dict[str, Object], root: str, is_out: Callable[..., bool] | None, hidden: bool = False
) -> tuple[list[tuple[Object, str]], list[tuple[str, str]]]:
    """The shard objects under root, (object, relpath), and the folders passed over, (relpath, why): the OUTs.
    Folders whose name starts with `.` are walked only where a card's glob names one (`hidden`), as on disk."""
    under = {key[len(root) :]: found for key, found in sorted(listed.items()) if key.startswith(root)}
    if not hidden:
        under = {rel: found for rel, found in under.items() if not _hidden(rel)}
    names: dict[str, set[str]] = {}  # folder relpath -> the names of the objects right in it
    for rel in under:
        folder, _, name = rel.rpartition("/")
        names.setdefault(folder, set()).add(name)
    passed_over: list[tuple[str, str]] = []
    for folder in sorted(names):
        inside = any(folder.startswith(f"{other}/") for other, _ in passed_over)
        if folder and not inside and is_out is not None and is_out(PurePosixPath(folder), names[folder]):
            passed_over.append((folder, "a tokpipe OUT, never input"))
    files = [
        (found, rel)
        for rel, found in under.items()
        if (rel.endswith(SHARD_SUFFIXES) or DATA_FILE.search(rel))
        and not any(rel.startswith(f"{folder}/") for folder, _ in passed_over)
    ]
    return files, passed_over


def _hidden(relpath: str) -> bool:
    return any(part.startswith(".") for part in relpath.split("/")[:-1])
