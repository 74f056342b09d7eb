"""shard: one shard -> .bin/.idx equal to the reference; checkpoints make any interruption harmless."""

import hashlib
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    LFS_POINTER,
    QWEN3,
    QWEN3_EOS,
    Crash,
    crash_in_batch,
    held_elsewhere,
    held_out,
    is_held_out,
    reference_by_group,
    reference_objects,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    write_jsonl,
)
from helpers import (
    read_shard as read,
)
from helpers import (
    shard_spec as spec_for,
)

from tokpipe.errors import SourceError, TooManyGroups
from tokpipe.inputs.manifest import Shard, build_manifest
from tokpipe.layout.checkpoints import Checkpoint
from tokpipe.layout.files import ShardFiles
from tokpipe.layout.tokens import to_dtype
from tokpipe.write.segments import Spilled, part_arrays
from tokpipe.write.shard import EncodeSpec, tokenize_shard

SHARDS = list(build_manifest(EXAMPLE_CACHE).shards())
HOLDOUT = SHARDS[-1]


@pytest.mark.parametrize(
    "backend, read_ahead", [("fastokens", False), ("fastokens", True), ("gigatoken", False), ("hf", False)]
)
def test_qwen3_shard_is_the_reference_in_uint32(tmp_path, backend, read_ahead):
    result = tokenize_shard(HOLDOUT, tmp_path, spec_for(QWEN3, backend, read_ahead=read_ahead))
    tokens, ends = read(tmp_path, HOLDOUT, np.uint32)
    assert np.array_equal(tokens, reference_tokens([Path(HOLDOUT.path)], QWEN3 / "tokenizer.json", QWEN3_EOS))
    assert tokens.max() >= 65536  # the ids uint16 would have wrapped are really there
    assert result.checkpoint.done and result.checkpoint.tokens == len(tokens)
    assert result.checkpoint.documents == len(ends) == 136 and result.checkpoint.skipped == {"empty_text": 3}
    assert result.checkpoint.lines == 139
    assert np.all(tokens[ends - 1] == QWEN3_EOS) and ends[-1] == len(tokens)


def test_small_vocab_shard_is_the_reference_in_uint16(tmp_path, small_tokenizer):
    spec = spec_for(small_tokenizer, "hf")
    assert spec.dtype == "uint16"
    tokenize_shard(HOLDOUT, tmp_path, spec)
    tokens, _ = read(tmp_path, HOLDOUT, np.uint16)
    expected = reference_tokens([Path(HOLDOUT.path)], small_tokenizer / "tokenizer.json", spec.eos_id, np.uint16)
    assert np.array_equal(tokens, expected)
    assert (tmp_path / "shards" / "validation" / f"{HOLDOUT.key}.bin").stat().st_size == 2 * len(expected)


def test_an_id_that_does_not_fit_is_an_error_never_a_wrap(tmp_path):
    with pytest.raises(OverflowError, match="151643 does not fit uint16"):
        to_dtype(np.array([5, 151643], dtype=np.uint32), "uint16")
    wrong = spec_for(QWEN3).__class__(**{**spec_for(QWEN3).__dict__, "dtype": "uint16"})
    with pytest.raises(OverflowError):
        tokenize_shard(HOLDOUT, tmp_path, wrong)


@pytest.mark.parametrize("read_ahead", [False, True])
def test_interrupted_shard_resumes_to_identical_bytes(tmp_path, read_ahead):
    spec = spec_for(QWEN3, batch_bytes=64 << 10, checkpoint_interval=0.0)
    whole_dir, cut_dir = tmp_path / "whole", tmp_path / "cut"
    tokenize_shard(HOLDOUT, whole_dir, spec)

    # With read_ahead the crash comes while the next batch is already read: that one was never checkpointed.
    with pytest.raises(Crash):
        tokenize_shard(
            HOLDOUT, cut_dir, EncodeSpec(**{**spec.__dict__, "read_ahead": read_ahead}), on_batch=crash_in_batch(5)
        )
    files = ShardFiles.of(cut_dir, HOLDOUT)
    ckpt = Checkpoint.load(files.checkpoint)
    assert not ckpt.done and 0 < ckpt.lines < 139
    # Bytes written after the last checkpoint (a crash between write and checkpoint) are cut and redone.
    with open(files.bin, "ab") as f:
        f.write(np.arange(1000, dtype=np.uint32).tobytes())
    result = tokenize_shard(HOLDOUT, cut_dir, spec)
    assert result.resumed_tokens == ckpt.tokens and result.redone_tokens >= 1000
    for a, b in zip(read(whole_dir, HOLDOUT, np.uint32), read(cut_dir, HOLDOUT, np.uint32)):
        assert np.array_equal(a, b)
    assert Checkpoint.load(files.checkpoint) == Checkpoint.load(ShardFiles.of(whole_dir, HOLDOUT).checkpoint)


def test_finished_shard_is_not_redone(tmp_path):
    spec = spec_for(QWEN3)
    tokenize_shard(HOLDOUT, tmp_path, spec)
    calls = []
    result = tokenize_shard(HOLDOUT, tmp_path, spec, on_batch=lambda *a: calls.append(a))
    assert calls == [] and result.checkpoint.done and result.redone_tokens == 0


def test_a_worker_left_over_from_a_killed_run_is_waited_out(tmp_path):
    """The shard's lock held by another process (a Ray worker outliving its driver): a new worker waits for it to
    let go, then takes the shard up as it stands."""
    files, spec, taken = ShardFiles.of(tmp_path, HOLDOUT), spec_for(QWEN3), []
    tokenize_shard(HOLDOUT, tmp_path / "once", spec)  # the encoder loaded: what the worker does next is the shard
    files.folder.mkdir(parents=True)
    worker = threading.Thread(target=lambda: taken.append(tokenize_shard(HOLDOUT, tmp_path, spec)))
    with held_elsewhere(files.folder, files.key):
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and taken == []
    worker.join(60)
    assert taken[0].checkpoint.done and taken[0].checkpoint.tokens > 0


def test_a_write_error_stops_the_shard_and_a_rerun_completes_identically(tmp_path, monkeypatch):
    import errno
    import os

    spec = spec_for(QWEN3, batch_bytes=64 << 10, checkpoint_interval=0.0)
    tokenize_shard(HOLDOUT, tmp_path / "whole", spec)
    real_fsync, calls = os.fsync, []

    def disk_fills_up(fd):
        calls.append(fd)
        if len(calls) > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr("tokpipe.write.shard.os.fsync", disk_fills_up)
    with pytest.raises(OSError, match="No space left"):
        tokenize_shard(HOLDOUT, tmp_path / "full", spec)
    monkeypatch.setattr("tokpipe.write.shard.os.fsync", real_fsync)  # space freed
    result = tokenize_shard(HOLDOUT, tmp_path / "full", spec)
    assert result.resumed_tokens > 0
    for a, b in zip(read(tmp_path / "whole", HOLDOUT, np.uint32), read(tmp_path / "full", HOLDOUT, np.uint32)):
        assert np.array_equal(a, b)


QWEN3_IM_START = 151644
TRAIN = SHARDS[0]


@pytest.mark.parametrize("bos_id, eos_id", [(QWEN3_IM_START, QWEN3_EOS), (QWEN3_IM_START, None), (QWEN3_EOS, None)])
def test_delimiters_are_placed_around_each_document_as_asked(tmp_path, bos_id, eos_id):
    spec = EncodeSpec(**{**spec_for(QWEN3).__dict__, "bos_id": bos_id, "eos_id": eos_id})
    result = tokenize_shard(HOLDOUT, tmp_path, spec)
    tokens, ends = read(tmp_path, HOLDOUT, np.uint32)
    assert np.array_equal(
        tokens, reference_tokens([Path(HOLDOUT.path)], QWEN3 / "tokenizer.json", eos_id, bos_id=bos_id)
    )
    assert len(ends) == result.checkpoint.documents == 136 and ends[-1] == len(tokens) == result.checkpoint.tokens
    assert np.all(tokens[np.concatenate(([0], ends[:-1]))] == bos_id)  # the .idx ends tell where each document starts


def test_no_eos_places_none_even_where_a_text_holds_its_string(tmp_path):
    path = write_jsonl(
        tmp_path / "specials.jsonl",
        ['{"text": "a <|endoftext|> b"}', '{"text": "<|im_start|>user hi"}', '{"text": "plain"}'],
    )
    shard = Shard("train", "specials.jsonl", str(path), path.stat().st_size, "specials")
    tokenize_shard(
        shard, tmp_path / "out", EncodeSpec(**{**spec_for(QWEN3).__dict__, "bos_id": QWEN3_IM_START, "eos_id": None})
    )
    tokens, ends = read(tmp_path / "out", shard, np.uint32)
    assert QWEN3_EOS not in tokens
    assert np.array_equal(np.flatnonzero(tokens == QWEN3_IM_START), np.concatenate(([0], ends[:-1])))


@pytest.mark.parametrize("read_ahead", [False, True])
def test_held_out_documents_are_chosen_by_their_text_and_survive_a_crash(tmp_path, read_ahead):
    """--val-fraction: a train shard's documents whose text hashes below F go to its held-out files, the rest
    to its own; both parts are cut back to the checkpoint and redone after a crash, to identical bytes."""
    fraction = 0.3
    spec = spec_for(QWEN3, batch_bytes=64 << 10, checkpoint_interval=0.0, val_fraction=fraction, bos_id=QWEN3_IM_START)
    with pytest.raises(Crash):
        tokenize_shard(
            TRAIN, tmp_path, EncodeSpec(**{**spec.__dict__, "read_ahead": read_ahead}), on_batch=crash_in_batch(4)
        )
    files = ShardFiles.of(tmp_path, TRAIN)
    partial = Checkpoint.load(files.checkpoint)
    assert partial.part((True, None)).documents > 0 and not partial.done
    for path in (files.bin, files.part((True, None))[0]):  # bytes written after the last checkpoint: cut and redone
        with open(path, "ab") as f:
            f.write(np.arange(100, dtype=np.uint32).tobytes())
    result = tokenize_shard(TRAIN, tmp_path, spec)
    assert result.redone_tokens >= 100

    held = [is_held_out(t, fraction) for t in reference_texts(Path(TRAIN.path))]
    kept_tokens, kept_ends = read(tmp_path, TRAIN, np.uint32)
    held_bin, held_idx = files.part((True, None))
    held_tokens, held_ends = np.fromfile(held_bin, dtype=np.uint32), np.fromfile(held_idx, dtype="<i8")
    reference = [
        reference_tokens(
            [Path(TRAIN.path)],
            QWEN3 / "tokenizer.json",
            QWEN3_EOS,
            bos_id=QWEN3_IM_START,
            keep=held_out(fraction, h),
        )
        for h in (False, True)
    ]
    assert np.array_equal(kept_tokens, reference[0]) and np.array_equal(held_tokens, reference[1])
    ckpt = result.checkpoint
    val_tokens, val_documents = ckpt.counts(True)
    assert (ckpt.documents, val_documents) == (len(kept_ends), len(held_ends)) == (held.count(False), held.count(True))
    assert (ckpt.tokens, val_tokens) == (kept_ends[-1], held_ends[-1])  # each part's ends counted within it
    assert ckpt.lines == ckpt.documents + val_documents + sum(ckpt.skipped.values())
    tokenize_shard(HOLDOUT, tmp_path, spec)  # the validation split's own documents are never held out
    assert not ShardFiles.of(tmp_path, HOLDOUT).part((True, None))[0].exists()


GROUP_BY = "meta.redpajama_set_name"


def _files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.suffix in (".bin", ".idx")}


def test_group_by_writes_a_part_per_group_that_survives_a_crash(tmp_path):
    """--group-by: a shard's documents go to one part per group, in file order within each; after a crash,
    each part is cut back to the checkpoint, a group's files begun after it are removed, and the rerun
    leaves exactly the files of a shard never interrupted."""
    spec = spec_for(QWEN3, batch_bytes=32 << 10, checkpoint_interval=0.0, group_by=GROUP_BY)
    whole = tokenize_shard(TRAIN, tmp_path / "whole", spec).checkpoint
    out = tmp_path / "crashed"
    with pytest.raises(Crash):
        tokenize_shard(TRAIN, out, spec, on_batch=crash_in_batch(3))
    files = ShardFiles.of(out, TRAIN)
    partial = Checkpoint.load(files.checkpoint)
    partial_groups = [part.group for part in partial.parts]
    assert partial_groups and not partial.done
    for group in partial_groups:  # bytes written after the last checkpoint: cut and redone
        with open(files.part((False, group))[0], "ab") as f:
            f.write(np.arange(100, dtype=np.uint32).tobytes())
    stray = files.part((False, "begun after the checkpoint"))[0]
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"\0" * 8)
    result = tokenize_shard(TRAIN, out, spec)
    assert result.redone_tokens >= 100 * len(partial_groups)
    assert _files_under(out) == _files_under(tmp_path / "whole")

    reference = reference_by_group([Path(TRAIN.path)], QWEN3 / "tokenizer.json", GROUP_BY, QWEN3_EOS)
    ckpt = result.checkpoint
    assert (
        [part.group for part in ckpt.parts]
        == list(reference)
        == ["RedPajamaC4", "RedPajamaCommonCrawl", "RedPajamaGithub", "RedPajamaWikipedia"]
    )
    for group, (tokens, documents, text_bytes) in reference.items():
        bin_path, idx_path = files.part((False, group))
        assert np.array_equal(np.fromfile(bin_path, dtype=np.uint32), tokens)
        assert np.fromfile(idx_path, dtype="<i8")[-1] == len(tokens)
        counts = ckpt.part((False, group))
        assert (counts.tokens, counts.documents, counts.text_bytes) == (len(tokens), documents, text_bytes)
    assert ckpt.parts == whole.parts  # checksums included
    assert ckpt.documents == sum(d for _, d, _ in reference.values()) and ckpt.lines == ckpt.documents + 1


def _reference_parts(path: Path, fraction: float, group_by: str | None) -> dict[tuple, tuple[np.ndarray, int, int]]:
    """A train shard file's parts as the reference makes them: (held out, group) -> (tokens, documents, their texts'
    UTF-8 bytes: a group's, else 0), its own before those held out, groups in value order."""
    tokenizer, parts = QWEN3 / "tokenizer.json", {}
    for held in (False, True):
        keep = held_out(fraction, held)
        if group_by is None:
            tokens = reference_tokens([path], tokenizer, QWEN3_EOS, keep=keep)
            parts[held, None] = (tokens, int(np.count_nonzero(tokens == QWEN3_EOS)), 0)
        else:
            for group, found in reference_by_group([path], tokenizer, group_by, QWEN3_EOS, keep=keep).items():
                parts[held, group] = found
    return parts


def _ends(tokens: np.ndarray) -> np.ndarray:
    """Each document's end, from the EOS that ends it (the only one in it: a text's `<|endoftext|>` is text)."""
    return (np.flatnonzero(tokens == QWEN3_EOS) + 1).astype("<i8")


@pytest.mark.parametrize("group_by", [None, GROUP_BY])
def test_a_shard_killed_under_checkpoint_format_1_resumes_to_the_reference(tmp_path, group_by):
    """A shard killed mid-way by a tokpipe of checkpoint format 1: its checkpoint has no `format`, the counts of
    the documents it held out are in val_* fields (and `val_groups`) beside its own (and `groups`), and its files
    hold bytes written after it. Loaded, it is converted: the shard resumes to the reference bytes and checksums,
    and its checkpoint is written in this tokpipe's format."""
    fraction = 0.3
    lines = [json.dumps(obj) for obj in reference_objects(Path(TRAIN.path))]
    shard = _shard_of(write_jsonl(tmp_path / "data" / "shard.jsonl", lines))
    covered = write_jsonl(tmp_path / "covered.jsonl", lines[: len(lines) // 2])  # what the checkpoint covers
    files = ShardFiles.of(tmp_path / "out", shard)
    sums = {False: [0, 0, {}], True: [0, 0, {}]}  # tokens, documents, groups: as format 1 counts them
    for (held, group), (tokens, documents, text_bytes) in _reference_parts(covered, fraction, group_by).items():
        bin_path, idx_path = files.part((held, group))
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        bin_path.write_bytes(tokens.tobytes() + b"written after the checkpoint")
        idx_path.write_bytes(_ends(tokens).tobytes() + b"\xff" * 16)
        sums[held][0] += len(tokens)
        sums[held][1] += documents
        if group is not None:
            sums[held][2][group] = {"tokens": len(tokens), "documents": documents, "text_bytes": text_bytes}
    size = covered.stat().st_size
    format_1 = {
        "lines": len(lines) // 2,
        "offset": size,
        "source_pos": size,
        "frame_source_pos": 0,
        "frame_offset": 0,
        "documents": sums[False][1],
        "tokens": sums[False][0],
        "skipped": {},
        "repaired": {},
        "skip_log": [],
        "done": False,
        "sha256": None,
        "idx_sha256": None,
        "val_documents": sums[True][1],
        "val_tokens": sums[True][0],
        "val_sha256": None,
        "val_idx_sha256": None,
        "groups": sums[False][2],
        "val_groups": sums[True][2],
        "text_bytes": size,
        "seconds": 1.5,
    }
    files.checkpoint.write_text(json.dumps(format_1))

    spec = spec_for(QWEN3, batch_bytes=64 << 10, val_fraction=fraction, group_by=group_by)
    ckpt = tokenize_shard(shard, tmp_path / "out", spec).checkpoint
    reference = _reference_parts(Path(shard.path), fraction, group_by)
    assert [(p.key, p.tokens, p.documents, p.text_bytes) for p in ckpt.parts] == [
        (key, len(tokens), documents, text_bytes) for key, (tokens, documents, text_bytes) in reference.items()
    ]
    for part in ckpt.parts:
        tokens, (bin_path, idx_path) = reference[part.key][0], files.part(part.key)
        assert bin_path.read_bytes() == tokens.tobytes() and idx_path.read_bytes() == _ends(tokens).tobytes()
        assert part.sha256 == hashlib.sha256(tokens.tobytes()).hexdigest()
        assert part.idx_sha256 == hashlib.sha256(_ends(tokens).tobytes()).hexdigest()
    assert ckpt.done and ckpt.lines == len(lines)
    written = json.loads(files.checkpoint.read_text())  # in this tokpipe's format: no val_* field
    assert written["format"] == 2 and [key for key in written if key.startswith("val_")] == []


def test_group_by_refuses_a_shard_with_more_values_than_a_split_may_have_groups(tmp_path, monkeypatch):
    monkeypatch.setattr("tokpipe.write.shard.MAX_GROUPS", 3)
    path = write_jsonl(tmp_path / "ids.jsonl", [f'{{"text": "t{i}", "id": "doc-{i}"}}' for i in range(10)])
    shard = Shard("train", "ids.jsonl", str(path), path.stat().st_size, "ids")
    with pytest.raises(
        TooManyGroups,
        match=r"^--group-by id: shard ids.jsonl alone has more than 3 distinct values "
        r"\(e.g. 'doc-0', 'doc-1', 'doc-2'\)",
    ):
        tokenize_shard(shard, tmp_path / "out", spec_for(QWEN3, group_by="id"))


def _joined(buffered) -> tuple[np.ndarray, np.ndarray]:
    tokens, ends = buffered
    return np.concatenate(tokens), np.concatenate(ends)


def test_a_shard_begun_afresh_keeps_its_parts_in_memory_and_writes_nothing(tmp_path):
    """A run's shard keeps its tokens in memory until the runner writes them into place: the shard's own
    files are never written, nor its checkpoint (nothing on disk covers the tokens yet), and a stale file
    of an earlier attempt goes."""
    fraction = 0.3
    spec = spec_for(QWEN3, batch_bytes=64 << 10, checkpoint_interval=0.0, val_fraction=fraction, buffer_bytes=1 << 30)
    files = ShardFiles.of(tmp_path, TRAIN)
    files.bin.parent.mkdir(parents=True)
    files.bin.write_bytes(b"left by an attempt that never checkpointed")
    result = tokenize_shard(TRAIN, tmp_path, spec)
    assert sorted(result.buffered) == [(False, None), (True, None)]
    for held in (False, True):
        tokens, ends = _joined(result.buffered[held, None])
        expected = reference_tokens(
            [Path(TRAIN.path)], QWEN3 / "tokenizer.json", QWEN3_EOS, keep=held_out(fraction, held)
        )
        assert np.array_equal(tokens, expected) and ends[-1] == len(expected) and tokens.dtype == np.uint32
    assert result.checkpoint.done and result.checkpoint.tokens == len(_joined(result.buffered[False, None])[0])
    assert [p.name for p in files.bin.parent.rglob("*") if p.is_file()] == ["shards.lock"]


def test_a_shard_past_its_buffer_goes_on_in_its_own_files_and_survives_a_crash(tmp_path):
    """Past buffer_bytes, what was in memory goes to the shard's own files, checkpointed at once, and the shard
    goes on there: a crash after that resumes from the checkpoint to the bytes of one whole run."""
    spec = spec_for(QWEN3, batch_bytes=64 << 10, buffer_bytes=256 << 10)
    with pytest.raises(Crash):
        tokenize_shard(HOLDOUT, tmp_path, spec, on_batch=crash_in_batch(5))
    files = ShardFiles.of(tmp_path, HOLDOUT)
    spilled = Checkpoint.load(files.checkpoint)
    assert not spilled.done and spilled.tokens > 0 and files.bin.stat().st_size >= spilled.tokens * 4
    result = tokenize_shard(HOLDOUT, tmp_path, spec)
    assert result.buffered is None and result.resumed_tokens == spilled.tokens
    tokens, ends = read(tmp_path, HOLDOUT, np.uint32)
    assert np.array_equal(tokens, reference_tokens([Path(HOLDOUT.path)], QWEN3 / "tokenizer.json", QWEN3_EOS))
    assert Checkpoint.load(files.checkpoint) == result.checkpoint and len(ends) == 136


def test_a_buffering_shard_asked_to_stop_leaves_a_checkpoint_a_worker_goes_on_from(tmp_path):
    """The driver stops its shard once Ray is up: what it buffered goes to the shard's files, checkpointed, and
    the worker that takes the shard over ends with the bytes of one whole run."""
    spec = spec_for(QWEN3, batch_bytes=64 << 10, buffer_bytes=1 << 30)
    batches = []
    stopped = tokenize_shard(
        HOLDOUT, tmp_path, spec, on_batch=lambda *a: batches.append(a), stop=lambda: len(batches) == 2
    )
    assert stopped.buffered is None and not stopped.checkpoint.done
    assert Checkpoint.load(ShardFiles.of(tmp_path, HOLDOUT).checkpoint) == stopped.checkpoint
    tokenize_shard(HOLDOUT, tmp_path, spec)
    tokens, _ = read(tmp_path, HOLDOUT, np.uint32)
    assert np.array_equal(tokens, reference_tokens([Path(HOLDOUT.path)], QWEN3 / "tokenizer.json", QWEN3_EOS))


def _shard_of(path: Path) -> Shard:
    return Shard("train", path.name, str(path), path.stat().st_size, path.name.split(".")[0])


@pytest.mark.parametrize("what", ["a Git LFS pointer", "a JSON array of rows as lists"])
def test_a_shard_that_is_not_json_lines_fails_in_its_first_batch(tmp_path, what):
    """More than half of its lines (or items) not JSON objects: the wrong format, never dirty data to skip at exit 0."""
    if what == "a Git LFS pointer":
        path, counts = write_jsonl(tmp_path / "data" / "pointer.jsonl.zst", LFS_POINTER), "invalid_json 3, not_object 0"
    else:
        path, counts = tmp_path / "rows.json", "invalid_json 0, not_object 3"
        path.write_text('[["text", "label"], ["hello world", 1], ["another", 0]]')
    encoded = []
    with pytest.raises(SourceError) as failed:
        tokenize_shard(_shard_of(path), tmp_path / "out", spec_for(QWEN3), on_batch=lambda *a: encoded.append(a))
    assert str(failed.value) == (
        f"{path}: 3 of the 3 lines read are not JSON objects ({counts}): it is neither JSON Lines nor a JSON array"
        " of objects or texts (CSV? rows as lists? a Git LFS pointer?), or in a compression tokpipe does not read (it"
        " reads zstd, gzip, bz2 and xz), or binary"
    )
    assert encoded == []  # failed before its first batch was encoded


def test_the_share_of_lines_not_json_is_of_the_shard_from_its_start_resumes_included(tmp_path):
    # Batches of 4 lines (17 bytes each): 4 documents, then 4 lines not JSON (4 of 8: half, not more), then 4 more.
    lines = [f'{{"text": "doc{i}"}}' for i in range(4)] + [f"not json, line {i}" for i in range(8)]
    path = write_jsonl(tmp_path / "data" / "x.jsonl", lines)
    shard, spec = _shard_of(path), spec_for(QWEN3, batch_bytes=4 * 17, checkpoint_interval=0.0)
    with pytest.raises(Crash):  # in the second batch, the first one checkpointed
        tokenize_shard(shard, tmp_path / "out", spec, on_batch=crash_in_batch(2))
    assert Checkpoint.load(ShardFiles.of(tmp_path / "out", shard).checkpoint).lines == 4
    # Its resumed attempt reads 8 lines, none JSON: counted alone they would fail it at its first batch.
    with pytest.raises(SourceError, match=f"^{path}: 8 of the 12 lines read are not JSON objects "):
        tokenize_shard(shard, tmp_path / "out", spec)


def test_for_an_out_on_a_store_a_large_part_past_the_buffer_goes_to_files_of_the_node(tmp_path):
    """An OUT on a store has no files of its shards: past buffer_bytes its parts of at least a segment's size
    (6 MiB of tokens here) go to files of this node's, in this run's spill folder (an earlier run's removed), for
    the node's Placer to upload and then remove; its small parts (the held-out one, 0.6 MiB) stay in memory."""
    copies, fraction = 4, 0.1
    shard_file = tmp_path / "big.jsonl.zst"
    shard_file.write_bytes(Path(TRAIN.path).read_bytes() * copies)  # zstd frames one after another: one stream
    shard = _shard_of(shard_file)
    earlier = tmp_path / "spill" / "earlier-run"
    earlier.mkdir(parents=True)
    spill = str((tmp_path / "spill" / "this-run").relative_to(tempfile.gettempdir()))
    spec = spec_for(QWEN3, batch_bytes=256 << 10, val_fraction=fraction, buffer_bytes=1 << 20, spill=spill)
    result = tokenize_shard(shard, "s3://bucket/out", spec)
    large, small = result.buffered[False, None], result.buffered[True, None]
    assert isinstance(large, Spilled) and isinstance(small, tuple)
    assert Path(large.bin).parent.parent.parent.parent == tmp_path / "spill" / "this-run" and not earlier.exists()
    for held, part in ((False, large), (True, small)):
        tokens, ends = _joined(part_arrays(part))
        one = reference_tokens([Path(TRAIN.path)], QWEN3 / "tokenizer.json", QWEN3_EOS, keep=held_out(fraction, held))
        assert np.array_equal(tokens, np.tile(one, copies)) and ends[-1] == len(tokens)
    assert result.checkpoint.done and result.checkpoint.tokens == len(_joined(part_arrays(large))[0])
    large.remove()
    assert not Path(large.bin).exists() and not Path(large.idx).exists()


# A shard of 300 groups written to its parts' own files from its first batch (--shard-buffer 0; so does one that
# outgrew its buffer, or resumed), in a process of 64 descriptors: two a group were held open, which at 990 groups ran
# past a login shell's limit of 1,024 (EMFILE).
SPILLED_GROUPS = """
import resource, sys
sys.path.insert(0, sys.argv[1])
from helpers import shard_spec
from tokpipe.inputs.manifest import Shard
from tokpipe.write.shard import tokenize_shard

tokenizer, path, out = sys.argv[2:]
spec = shard_spec(tokenizer, group_by="lang", buffer_bytes=0)
shard = Shard(split="train", relpath="train/a.jsonl", path=path, size=0, key="train__a")
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
assert tokenize_shard(shard, out, spec).checkpoint.done
"""


def test_a_shard_of_300_groups_in_its_own_files_holds_no_descriptor_a_group(tmp_path, small_tokenizer):
    lines = [json.dumps({"text": f"document {i} of group {i % 300}", "lang": f"g{i % 300:03d}"}) for i in range(900)]
    path = write_jsonl(tmp_path / "train" / "a.jsonl", lines)
    args = [Path(__file__).parent, small_tokenizer, path, tmp_path / "out"]
    done = subprocess.run([sys.executable, "-c", SPILLED_GROUPS, *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    eos = reference_tokenizer(small_tokenizer / "tokenizer.json").token_to_id("<|endoftext|>")
    reference = reference_by_group([path], small_tokenizer / "tokenizer.json", "lang", eos)
    files = ShardFiles(tmp_path / "out" / "shards" / "train", "train__a")
    assert len(reference) == 300
    for group, (tokens, documents, _) in reference.items():
        bin_path, idx_path = files.part((False, group))
        assert np.array_equal(np.fromfile(bin_path, np.uint16), tokens), group
        assert len(np.fromfile(idx_path, "<i8")) == documents == 3
