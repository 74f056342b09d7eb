"""tokpipe/layout: every rule of OUT's files, in one package. Where a shard's files and its held-out part go, what a
checkpoint holds, a parts list (one JSON line per part) and the offsets and meta sums it gives, the
split files' names, meta.pkl read without executing anything, and OUT's lock: held by the live run,
naming it, refusing a second run, dropped by the kernel when the run dies."""

import fcntl
import hashlib
import json
import os
import pickle
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers import EXAMPLE_CACHE, run_args, tokpipe

from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints, PartCounts, write_placed
from tokpipe.layout.files import PROGRESS, Layout, LayoutWriter, ShardFiles, load_meta_pkl, split_file_stem
from tokpipe.layout.locks import lock_holder
from tokpipe.layout.records import parts_line, parts_of, read_parts, split_entry
from tokpipe.layout.run import WriteSpec, output_splits, sources

MANIFEST = build_manifest(EXAMPLE_CACHE)
TRAIN_0, TRAIN_1, HOLDOUT = MANIFEST.shards()


def test_a_shard_s_files_are_named_by_its_split_and_key(tmp_path):
    files = ShardFiles.of(tmp_path, TRAIN_1)
    base = tmp_path / "shards" / "train" / "train__chunk1__example_train_1"
    assert (files.bin, files.idx, files.checkpoint) == tuple(Path(f"{base}{ext}") for ext in (".bin", ".idx", ".json"))
    # Its lock: a byte of its split's one lock file, at the first 7 bytes of the blake2b of its key.
    assert files.lock == (tmp_path / "shards" / "train" / "shards.lock", 0xBB05B45A4AB0CD)
    held = tmp_path / "shards" / "train" / "held-out" / "train__chunk1__example_train_1"
    assert files.part((True, None)) == (Path(f"{held}.bin"), Path(f"{held}.idx"))


def test_a_checkpoint_round_trips_and_a_missing_one_is_none(tmp_path):
    assert Checkpoint.of(tmp_path, HOLDOUT) is None
    ckpt = Checkpoint(lines=5, offset=100, documents=4, tokens=40, skipped={"blank": 1}, skip_log=[[3, "blank"]])
    path = ShardFiles.of(tmp_path, HOLDOUT).checkpoint
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(asdict(ckpt)))
    assert Checkpoint.of(tmp_path, HOLDOUT) == ckpt


def test_a_shard_s_parts_are_found_by_key_each_key_read_once_and_the_index_never_travels(monkeypatch):
    """A shard of 2,000 groups: finalize and the assembler look up each group's part; a scan each read 2 M keys."""
    ckpt = Checkpoint(parts=[PartCounts(False, f"g{n:04d}", tokens=n) for n in range(2000)])
    reads = []
    monkeypatch.setattr(PartCounts, "key", property(lambda part: reads.append(1) or (part.held, part.group)))
    assert [ckpt.part((False, f"g{n:04d}")).tokens for n in range(2000)] == list(range(2000))
    assert ckpt.part((False, None)) is None and ckpt.part((True, "g0001")) is None and len(reads) == 2000
    ckpt.parts = [PartCounts(False, None, tokens=7)]  # replaced, as a writer does: the next lookup sees it
    assert ckpt.part((False, None)).tokens == 7 and ckpt.part((False, "g0001")) is None
    copy = pickle.loads(pickle.dumps(ckpt))  # to and from Ray's workers: the parts, not the index
    assert copy == ckpt and "_by_key" not in copy.__dict__ and copy.part((False, None)).tokens == 7
    assert json.loads(ckpt.encoded()) == asdict(ckpt)


def test_checkpoints_read_a_shard_s_own_file_first_then_its_entry_in_a_placing_s_file(tmp_path):
    """Checkpoints, as a run's start, status and report ask for them: a shard's own file where it has one, else its
    entry in a file of the shards placed together (named by the blake2b of its keys); each split's folders listed
    once, so a checkpoint written after the listing is not seen; `forget` removes a shard's every checkpoint."""
    own, placed = Checkpoint(lines=5, offset=9), Checkpoint(lines=7, tokens=70, documents=7, done=True)
    write_placed(Layout(tmp_path), {"train": {TRAIN_0.key: placed, TRAIN_1.key: placed}})
    data = json.dumps({TRAIN_0.key: asdict(placed), TRAIN_1.key: asdict(placed)}, separators=(",", ":")).encode()
    keys = f"{TRAIN_0.key}\n{TRAIN_1.key}".encode()  # named by its keys: the same shards placed again, the same name
    [file] = (tmp_path / "shards" / "train" / "placed").iterdir()
    assert file.name == f"{hashlib.blake2b(keys, digest_size=8).hexdigest()}.json" and file.read_bytes() == data
    ShardFiles.of(tmp_path, TRAIN_1).checkpoint.write_bytes(own.encoded())

    checkpoints = Checkpoints(tmp_path)
    assert [checkpoints.of(s) for s in (TRAIN_0, TRAIN_1, HOLDOUT)] == [placed, own, None]
    assert [checkpoints.done(s) for s in (TRAIN_0, TRAIN_1, HOLDOUT)] == [True, False, False]
    ShardFiles.of(tmp_path, HOLDOUT).checkpoint.parent.mkdir(parents=True)
    ShardFiles.of(tmp_path, HOLDOUT).checkpoint.write_bytes(own.encoded())
    assert checkpoints.of(HOLDOUT) is None  # after the listing: the shard's task reads it
    assert Checkpoints(tmp_path).of(HOLDOUT) == own

    checkpoints.forget([TRAIN_0])  # its entry goes; TRAIN_1's moves to a file of its own before the old one goes
    assert checkpoints.of(TRAIN_0) is None and Checkpoints(tmp_path).of(TRAIN_0) is None
    [file] = (tmp_path / "shards" / "train" / "placed").iterdir()
    assert json.loads(file.read_bytes()) == {TRAIN_1.key: asdict(placed)}
    checkpoints.forget([TRAIN_1])
    assert Checkpoints(tmp_path).of(TRAIN_1) is None
    assert list((tmp_path / "shards" / "train" / "placed").iterdir()) == []
    write_placed(Layout(tmp_path), {"train": {TRAIN_0.key: placed, TRAIN_1.key: placed}})
    Checkpoints(tmp_path).forget([TRAIN_0, TRAIN_1])  # a file's every entry at once: the file goes, none written
    assert list((tmp_path / "shards" / "train" / "placed").iterdir()) == []


def test_a_checkpoint_of_format_1_is_read_as_this_format_and_a_later_one_refused(tmp_path):
    """Format 1 (no `format`) counted a shard's held-out documents in val_* fields (and val_groups) beside its own
    (and groups); read, each is a part by its key. A part is made only where the fields show one: counts, the
    checksums of a done shard, or no sha256 field at all (written before shards were hashed)."""
    path = ShardFiles.of(tmp_path, TRAIN_0).checkpoint
    path.parent.mkdir(parents=True)
    held_out = {"val_documents": 1, "val_tokens": 10, "val_sha256": "c", "val_idx_sha256": "d"}
    by_group = {"x": {"tokens": 3, "documents": 1, "text_bytes": 9, "sha256": "e", "idx_sha256": "f"}}
    unstarted = {"val_documents": 0, "val_tokens": 0, "val_sha256": None, "val_idx_sha256": None, "val_groups": {}}
    cases = [
        ({"tokens": 40, "documents": 4, "sha256": "a", "idx_sha256": "b", **held_out, "groups": {}, "val_groups": {}},
         [PartCounts(False, None, 40, 4, 0, "a", "b"), PartCounts(True, None, 10, 1, 0, "c", "d")]),
        ({"tokens": 3, "documents": 1, "sha256": None, "idx_sha256": None, **unstarted, "groups": by_group},
         [PartCounts(False, "x", 3, 1, 9, "e", "f")]),
        ({"tokens": 0, "documents": 0, "sha256": None, "idx_sha256": None, **unstarted, "groups": {}}, []),
        ({"tokens": 0, "documents": 0}, [PartCounts(False, None)]),
    ]  # fmt: skip
    for fields, parts in cases:
        path.write_text(json.dumps({"lines": 5, "done": True, **fields}))
        expected = Checkpoint(lines=5, done=True, tokens=fields["tokens"], documents=fields["documents"], parts=parts)
        assert Checkpoint.load(path) == expected
    path.write_text(json.dumps({"format": 3, "lines": 5}))
    with pytest.raises(UserError) as refused:
        Checkpoint.load(path)
    assert str(refused.value) == (
        f"{path} is damaged (ValueError: a checkpoint of format 3; this tokpipe reads 2 and 1): remove it and rerun"
        f" the run's command (tokpipe status {tmp_path} prints it): the shard is tokenized again"
    )


def test_split_files_are_named_by_stem_and_val_fraction_adds_a_validation_split():
    assert [split_file_stem(s) for s in ("train", "validation", "test")] == ["train", "val", "test"]
    assert output_splits(MANIFEST, 0.0) == output_splits(MANIFEST, 0.1) == ["train", "validation"]
    train_only = build_manifest(EXAMPLE_CACHE.parent / "hf-cache-parquet")
    assert output_splits(train_only, 0.0) == ["train", "validation"]  # it has its own
    # val.bin with --val-fraction: the held-out part of every train shard, in manifest order, then its own.
    assert [(s.relpath, held) for s, held in sources(MANIFEST, "val", 0.1)] == [
        (TRAIN_0.relpath, True),
        (TRAIN_1.relpath, True),
        (HOLDOUT.relpath, False),
    ]
    assert [(s.relpath, held) for s, held in sources(MANIFEST, "val", 0.0)] == [(HOLDOUT.relpath, False)]


def test_a_parts_list_gives_each_part_its_offsets_and_meta_its_sums(tmp_path):
    records = [
        {"shard": "a", "tokens": 10, "documents": 2, "lines": 3, "held_out": 1, "skipped": {"blank": 1}},
        {"shard": "a", "part": "held-out", "tokens": 4, "documents": 1, "held_in": 1},
        {"shard": "b", "tokens": 7, "documents": 1, "lines": 1, "held_out": 0, "repaired": {"bom": 1}},
    ]
    raw = b"".join(parts_line(r) for r in records)
    assert raw.count(b"\n") == 3
    (tmp_path / "val.parts").write_bytes(raw)
    assert list(read_parts(tmp_path / "val.parts")) == records
    parts = list(parts_of("val", read_parts(raw)))
    assert [(p.seq, p.token_offset, p.doc_offset, p.token_end, p.doc_end) for p in parts] == [
        (0, 0, 0, 10, 2),
        (1, 10, 2, 14, 3),
        (2, 14, 3, 21, 4),
    ]
    entry = split_entry("val", raw, WriteSpec()).as_dict()
    assert {k: v for k, v in entry.items() if k != "parts_sha256"} == {
        "file": "val.bin",
        "idx": "val.idx",
        "parts": "val.parts",
        "tokens": 21,
        "documents": 4,
        "lines": 4,
        "held_out": 1,
        "held_in": 1,
        "skipped": {"blank": 1},
        "repaired": {"bom": 1},
        "shards": 2,  # a held-out part is no shard of its own
    }


def test_each_loader_refuses_its_file_damaged_in_one_line_naming_it_and_what_to_do(small_out):
    """tokpipe/layout/ reads each file of OUT in one place, and refuses it there, damaged, with a UserError that names
    it, what is wrong and what to do: a checkpoint, a parts list (cut at a line's end too, which parses: its
    sha256 is meta's no more), one being assembled (a line garbled before its last), a log."""
    out, rerun = Layout(small_out), f"rerun the run's command (tokpipe status {small_out} prints it)"
    checkpoint = ShardFiles.of(small_out, TRAIN_0).checkpoint
    checkpoint.write_bytes(b'{"lines": 3, "done": tru')
    with pytest.raises(UserError) as refused:
        Checkpoint.load(checkpoint)
    assert str(refused.value) == (
        f"{checkpoint} is damaged (JSONDecodeError: Expecting value: line 1 column 22 (char 21)): remove it and"
        f" {rerun}: the shard is tokenized again"
    )
    checkpoint.write_text('{"lines": 3, "bytes": 7}')  # a field no checkpoint has
    with pytest.raises(UserError, match=r"is damaged \(TypeError: .*'bytes'\): remove it and rerun"):
        Checkpoint.load(checkpoint)

    parts = small_out / "train.parts"
    sha256 = json.loads((small_out / "meta.json").read_text())["splits"]["train"]["parts_sha256"]
    parts.write_bytes(parts.read_bytes().splitlines(keepends=True)[0])
    relist = f"remove {small_out}/meta.json and {rerun}: it lists the split's parts again"
    with pytest.raises(UserError) as refused:
        list(read_parts(parts, sha256))
    assert str(refused.value) == f"{parts} is damaged (ValueError: its sha256 is not the one meta records): {relist}"

    assembled = out.assembly("val")[2]
    assembled.write_bytes(parts_line({"shard": "a", "tokens": 1, "documents": 1}) + b"{garbled\n" + b'{"shard": "c"')
    with pytest.raises(UserError) as refused:
        list(read_parts(assembled, torn="cut"))
    assert str(refused.value) == (
        f"{assembled} is damaged (JSONDecodeError: unexpected character, expected a string key: line 1 column 2"
        f" (char 1)): {rerun}: it keeps the parts listed before the damaged line and places the others again"
    )
    # The rerun's reading of the same list: its records end at the damaged line (what follows is placed again).
    assert [r["shard"] for r in read_parts(assembled, torn="stop")] == ["a"]
    # A whole line of JSON that is no part's record (a hand's, or storage's damage: no writer leaves one) is as damaged:
    # it was kept as a record, and the rerun failed on it ("unexpected KeyError: 'tokens'"), again at every rerun.
    assembled.write_bytes(parts_line({"shard": "a", "tokens": 1, "documents": 1}) + b'{"x": 1}\n')
    with pytest.raises(UserError) as refused:
        list(read_parts(assembled, torn="cut"))
    assert str(refused.value) == (
        f"{assembled} is damaged (ValueError: a line that is no part's record: '{{\"x\": 1}}\\n'): {rerun}: it keeps"
        " the parts listed before the damaged line and places the others again"
    )
    assert [r["shard"] for r in read_parts(assembled, torn="stop")] == ["a"]
    assembled.write_bytes(parts_line({"shard": "a", "tokens": 1, "documents": 1}) + b'{"shard": "c"')  # cut by a crash
    assert [r["shard"] for r in read_parts(assembled, torn="cut")] == ["a"]
    assert [r["shard"] for r in read_parts(assembled, torn="stop")] == ["a"]

    out.log(PROGRESS).parent.mkdir(exist_ok=True)
    out.log(PROGRESS).write_text("[1, 2]")
    with pytest.raises(UserError) as refused:
        out.load_log(PROGRESS)
    assert str(refused.value) == (
        f"{out.log(PROGRESS)} is damaged (ValueError: a JSON list, not an object): a log, not the run's state: the"
        " next run writes it anew"
    )


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_meta_pkl_is_read_without_executing_anything(tmp_path):
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"dtype": "uint32", "splits": {"train": {"tokens": 1}}}))
    assert load_meta_pkl(tmp_path / "meta.pkl") == {"dtype": "uint32", "splits": {"train": {"tokens": 1}}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"dtype": Evil()}))
    with pytest.raises(UserError, match="refers to posix.system; a tokpipe meta holds only plain values"):
        load_meta_pkl(tmp_path / "meta.pkl")
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(UserError, match="meta.pkl holds a list, not a dict"):
        load_meta_pkl(tmp_path / "meta.pkl")


def test_the_lock_names_the_live_run_and_is_gone_when_it_is(tmp_path):
    assert lock_holder(tmp_path / ".lock") is None
    held = LayoutWriter(tmp_path).lock()
    assert lock_holder(tmp_path / ".lock") == f"pid {os.getpid()} on {os.uname().nodename}"
    with pytest.raises(UserError, match=rf"in use by another tokpipe run \(pid {os.getpid()} on "):
        LayoutWriter(tmp_path).lock()
    held.close()  # as the kernel does when the run dies
    assert lock_holder(tmp_path / ".lock") is None
    LayoutWriter(tmp_path).lock().close()


def test_a_second_run_on_the_same_out_is_refused_while_the_first_holds_it(manifest, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on elsewhere")
        held.flush()
        result = tokpipe(*run_args(manifest, out))
    assert result.returncode == 2
    assert result.stderr == (
        f"tokpipe run: error: {out} is in use by another tokpipe run (pid 4242 on elsewhere); wait for it to "
        "finish or stop it\n"
    )


def test_a_group_value_becomes_a_safe_file_name_and_no_two_values_share_one():
    """--group-by: a value that is a safe name names its files as it is; any other gets its unsafe
    characters made `_` and 8 hex digits of its sha256, so "a/b", "a b" and "a_b" stay apart."""
    from tokpipe.layout.files import group_stem

    assert group_stem("RedPajamaCommonCrawl") == "RedPajamaCommonCrawl"
    assert group_stem("__missing__") == "__missing__"
    values = ["a/b", "a b", "a_b", "..", ".", "", "../../etc", "Ελληνικά", "x" * 300, "a\\b", "-"]
    stems = [group_stem(v) for v in values]
    assert len(set(stems)) == len(values)
    assert stems[0] == "a_b-" + hashlib.sha256(b"a/b").hexdigest()[:8]
    for stem in stems:
        assert "/" not in stem and "\\" not in stem and not stem.startswith(".") and stem and len(stem) <= 73
