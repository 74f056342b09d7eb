"""`tokpipe run --out s3://BUCKET/PREFIX`: what a run into an OUT on a store does before and after its work (the
work itself is a run's: runner/driver.py). OUT is held by a lease (layout/lease.py: a second run on a live OUT is
refused in one line; after a kill -9 the same command resumes within one lease); run.json is compared with this
run's identity and written, with the manifest's copy, into the run's local folder (layout/stored.py `work`) and
uploaded; the logs are uploaded at the end, whatever the end, and the local folder removed once they are.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from tokpipe.errors import UserError
from tokpipe.inputs.manifest import Manifest, write_manifest
from tokpipe.inputs.tokenizer import TokenizerInfo
from tokpipe.layout.lease import Lease
from tokpipe.layout.meta import Meta
from tokpipe.layout.stored import StoredOut
from tokpipe.options import RunOptions
from tokpipe.runner.events import Listener, Said
from tokpipe.runner.identity import describe_changes, identity_changes, record_run, run_identity


@contextmanager
def held_store(
    url: str, manifest: Manifest, info: TokenizerInfo, opts: RunOptions, tell: Listener
) -> Iterator[tuple[StoredOut, Manifest, Lease]]:
    """OUT held for this run (its lease), its run recorded; yields it, the manifest of its copy, and the lease."""
    stored = StoredOut.of(url)
    with Lease(stored.bucket, stored.lock) as lease:
        shutil.rmtree(stored.work, ignore_errors=True)  # what an earlier attempt on this machine left: the store's
        stored.work.mkdir(parents=True)
        try:
            yield stored, _record(stored, manifest, info, opts, tell), lease
        finally:
            if _upload_logs(stored):  # else the logs stay here, the one copy of them
                shutil.rmtree(stored.work, ignore_errors=True)


def _record(stored: StoredOut, manifest: Manifest, info: TokenizerInfo, opts: RunOptions, tell: Listener) -> Manifest:
    """Refuse an OUT that holds a run with other inputs (or, not yet on a store, more shards: an append); start over
    one that holds no token; then write run.json and the manifest's copy, here and on the store."""
    bucket, out = stored.bucket, stored.layout
    found = bucket.get(stored.of_local(out.run_json))
    if found is not None:
        out.run_json.write_bytes(found[0])
    changed = identity_changes(stored.work, run_identity(manifest, info, opts))
    if changed:
        if _holds_tokens(stored):
            append = (
                " (appending shards to an OUT on a store is not supported yet)"
                if list(changed) == ["manifest_sha256"]
                else ""
            )
            raise UserError(
                f"{stored} holds a run with other inputs ({describe_changes(changed)}){append}; use a new --out, or"
                " the original inputs to resume"
            )
        for found in list(bucket.list(stored.prefix)):
            if found.key != stored.lock:
                bucket.delete(found.key)
        out.run_json.unlink()
        tell(Said(f"{stored} holds no token yet: starting it over with these inputs ({describe_changes(changed)})"))
    record_run(stored.work, manifest, info, opts, tell)
    write_manifest(manifest, out.manifest)
    for path in (out.run_json, out.manifest):
        bucket.put(stored.of_local(path), path.read_bytes())
    return replace(manifest, source=out.manifest)  # its shards stream from the local copy


def _holds_tokens(stored: StoredOut) -> bool:
    """Whether OUT holds anything made under its recorded identity: a segment, a checkpoint, a split file."""
    for found in stored.bucket.list(stored.prefix):
        if stored.name(found.key) not in ("run.json", "manifest.json", ".lock") and not found.key.startswith(
            stored.key("logs/")
        ):
            return True
    return False


def stored_meta(stored: StoredOut) -> Meta | None:
    """meta.json, None while OUT is not finished."""
    found = stored.bucket.get(stored.of_local(stored.layout.meta_json))
    return None if found is None else Meta.of(json.loads(found[0]))


def _upload_logs(stored: StoredOut) -> bool:
    """The run's logs, each uploaded whole; whether they were (a store that does not answer: the run's error is
    said, and the logs stay in the local folder)."""
    logs = stored.work / "logs"
    try:
        for path in sorted(logs.iterdir()) if logs.is_dir() else []:
            stored.bucket.put(stored.of_local(path), path.read_bytes())
    except OSError:
        return False
    return True
