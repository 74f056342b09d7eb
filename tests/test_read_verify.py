"""verify: passes a good OUT; fails, naming the check, on each kind of damage."""

import collections
import hashlib
import json
import pickle
import shutil

import numpy as np
import pytest
from helpers import QWEN3, build_out, cli, failed_checks, long_document, store_out_run, store_requests, write_jsonl

from tokpipe.layout.files import load_meta_pkl
from tokpipe.read import verify as verify_module
from tokpipe.read.verify import verify
from tokpipe.store import Bucket


def poke(path, index, value, dtype=np.uint32):
    tokens = np.memmap(path, dtype=dtype, mode="r+")
    tokens[index] = value
    tokens.flush()


def test_a_good_out_passes(out):
    assert failed_checks(out) == []
    result = cli("verify", out)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "all 33 checks hold"


def failure(out, name_part):
    matches = [c for c in verify(out) if not c.ok and name_part in c.name]
    assert matches, f"no failed check named like {name_part!r}: {failed_checks(out)}"
    return matches[0].detail


def test_bin_cut_by_a_few_bytes_fails_naming_the_cut(out):
    with open(out / "train.bin", "r+b") as f:
        f.truncate((out / "train.bin").stat().st_size - 3)
    assert failed_checks(out) == ["train: size matches meta (859,703 uint32)"]
    assert "the file was cut" in failure(out, "train: size")


def test_split_file_emptied_fails(out):
    (out / "val.bin").write_bytes(b"")
    assert "the file is empty" in failure(out, "validation: size")


def test_meta_dtype_disagreeing_with_the_files_fails(out):
    meta = load_meta_pkl(out / "meta.pkl")
    meta["dtype"] = "uint16"
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))
    (out / "meta.json").write_text(json.dumps(meta))
    assert "tokens of uint32, but meta says dtype uint16" in failure(out, "train: size")


def test_id_beyond_vocab_fails(out):
    poke(out / "train.bin", 10, 151669)
    assert failed_checks(out) == ["train: sha256 matches meta", "train: ids < vocab_size"]


def swap_two_tokens(out):
    tokens = np.memmap(out / "train.bin", dtype=np.uint32, mode="r+")
    assert tokens[100] != tokens[101]
    tokens[[100, 101]] = tokens[[101, 100]]
    tokens.flush()


def test_two_tokens_swapped_fail_the_checksum(out):
    swap_two_tokens(out)
    assert failed_checks(out) == ["train: sha256 matches meta"]
    assert (
        failure(out, "sha256")
        == "the token bytes changed since finalize, in the range of train/chunk1/example_train_0.jsonl.zst"
    )


def test_lost_eos_fails_count_and_boundaries(out):
    ends = np.fromfile(out / "val.idx", dtype="<i8")
    poke(out / "val.bin", ends[3] - 1, 42)
    assert failed_checks(out) == [
        "validation: sha256 matches meta",
        "validation: EOS count == documents",
        "validation: every document ends with EOS",
    ]


def test_idx_not_matching_fails(out):
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    ends[[5, 6]] = ends[[6, 5]]
    ends.tofile(out / "train.idx")
    assert failed_checks(out) == ["train: idx sha256 matches meta", "train: idx strictly increasing"]


def test_accounting_that_does_not_add_up_fails(out):
    meta = load_meta_pkl(out / "meta.pkl")
    meta["splits"]["train"]["lines"] += 1
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))
    (out / "meta.json").write_text(json.dumps(meta))
    assert failed_checks(out) == ["train: documents + skipped == lines"]


def test_meta_pkl_and_json_disagreeing_fails(out):
    meta = load_meta_pkl(out / "meta.pkl")
    meta["dtype"] = "uint16"
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))
    assert failed_checks(out) == ["meta.pkl == meta.json"]


def test_missing_meta_fails_and_cli_exits_1(out):
    (out / "meta.pkl").unlink()
    assert failed_checks(out) == ["meta.pkl present"]
    result = cli("verify", out, "--json")
    assert result.returncode == 1 and '"ok": false' in result.stdout
    # A folder that holds no run (a dataset's, a subfolder of OUT) is one line, exit 2: no run to wait for.
    refused = cli("verify", out / "logs")
    assert (refused.returncode, refused.stdout) == (2, "")
    said = f"tokpipe verify: error: {out / 'logs'} holds no tokpipe run (no meta.pkl, no manifest.json)\n"
    assert refused.stderr == said


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_hostile_meta_pkl_executes_nothing(out):
    (out / "meta.pkl").write_bytes(pickle.dumps({"dtype": Evil()}))
    result = cli("verify", out)
    assert result.returncode == 1 and "pwned" not in result.stdout
    assert "meta.pkl readable" in result.stdout and "builtins.print" in result.stdout


def test_bytes_after_meta_pkl_s_pickle_are_damage(out):
    # pickle.load stops at its STOP opcode: bytes appended after it (a second meta concatenated, a stray write) were
    # read past, and verify held. No writer of a whole file leaves them.
    with open(out / "meta.pkl", "ab") as meta:
        meta.write(b"\x00\x00\x00")
    assert failed_checks(out) == ["meta.pkl readable"]
    result = cli("verify", out)
    assert "UnpicklingError: 3 bytes follow its pickle" in result.stdout

def reseal(out, split):
    """Recompute a split's range checksums and the parts list's sha256 in meta, as a forger would."""
    meta = load_meta_pkl(out / "meta.pkl")
    info = meta["splits"][split]
    tokens = np.fromfile(out / info["file"], dtype=meta["dtype"])
    records, start = [], 0
    for line in (out / info["parts"]).read_text().splitlines():
        record = json.loads(line)
        record["sha256"] = hashlib.sha256(tokens[start : start + record["tokens"]].tobytes()).hexdigest()
        records.append(json.dumps(record))
        start += record["tokens"]
    (out / info["parts"]).write_text("".join(r + "\n" for r in records))
    info["parts_sha256"] = hashlib.sha256((out / info["parts"]).read_bytes()).hexdigest()
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))
    (out / "meta.json").write_text(json.dumps(meta))


def test_sample_re_tokenizes_source_documents_and_catches_a_self_consistent_wrong_id(small_out):
    from tokpipe.read.sample import verify_sample

    # The 600-id tokenizer's OUT: the sample encodes its documents again three times, and Qwen3's load and
    # encode (~5 CPU-s of this test) are not the subject.
    out = small_out
    checks = verify_sample(out, 1000)
    assert all(c.ok for c in checks) and len(checks) == 2
    # What a wrong backend would produce: one id off inside document 7 (another id of the vocabulary), with
    # checksums to match.
    ends = np.fromfile(out / "val.idx", dtype="<i8")
    wrong = (int(np.fromfile(out / "val.bin", dtype=np.uint16)[ends[6] + 2]) + 1) % 600
    poke(out / "val.bin", ends[6] + 2, wrong, np.uint16)
    reseal(out, "validation")
    assert failed_checks(out) == []  # every structural check still holds
    bad = [c for c in verify_sample(out, 1000) if not c.ok]
    assert len(bad) == 1 and "document 7 " in bad[0].detail
    result = cli("verify", out, "--sample", "1000")
    assert result.returncode == 1 and "FAIL" in result.stdout


def test_a_parts_list_edited_to_match_damage_fails_its_own_checksum(out):
    poke(out / "train.bin", 10, 7)
    lines = (out / "train.parts").read_text().splitlines()
    first = json.loads(lines[0])
    first["sha256"] = "0" * 64
    (out / "train.parts").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert failed_checks(out) == ["train: parts list sha256 matches meta"]


def as_written_by_tokpipe_0_1(out):
    """The OUT as tokpipe 0.1 finalized it: whole-file sha256s in meta, no parts lists."""
    meta = load_meta_pkl(out / "meta.pkl")
    for info in meta["splits"].values():
        (out / info.pop("parts")).unlink()
        del info["parts_sha256"]
        info["sha256"] = hashlib.sha256((out / info["file"]).read_bytes()).hexdigest()
        info["idx_sha256"] = hashlib.sha256((out / info["idx"]).read_bytes()).hexdigest()
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))
    (out / "meta.json").write_text(json.dumps(meta))


def test_an_out_of_an_earlier_tokpipe_still_verifies_and_catches_two_swapped_tokens(out):
    as_written_by_tokpipe_0_1(out)
    assert failed_checks(out) == []
    swap_two_tokens(out)
    assert failed_checks(out) == ["train: sha256 matches meta"]
    assert failure(out, "sha256") == "the token bytes changed since finalize"


@pytest.mark.parametrize("buffer", [8 << 20, 4 * 997], ids=["a buffer holds the file", "buffers cross its parts"])
def test_a_token_changed_at_either_end_of_any_part_fails_naming_that_part(out, monkeypatch, buffer):
    """A split file's parts are read back to back, a buffer at a time (a store's GET each), whatever parts a buffer
    spans: each part's checksum takes its own bytes, and a token changed at a part's edge names that part."""
    monkeypatch.setattr(verify_module, "HASH_CHUNK", buffer)  # each verify's threads make their buffers anew
    monkeypatch.setattr(verify_module, "_size_chunks", lambda parts, itemsize, jobs: [parts])  # one thread's run
    records = [json.loads(line) for line in (out / "train.parts").read_text().splitlines()]
    offsets = np.cumsum([0] + [r["tokens"] for r in records])
    assert len(records) == 2 and all(r["tokens"] for r in records)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint32)
    for name, start, end in zip([r["shard"] for r in records], offsets, offsets[1:]):
        for at in (start, end - 1):
            poke(out / "train.bin", at, tokens[at] ^ 1)
            failed = {c.name: c.detail for c in verify(out, jobs=1) if not c.ok}
            poke(out / "train.bin", at, tokens[at])
            changed = {"train: sha256 matches meta": f"the token bytes changed since finalize, in the range of {name}"}
            if at == end - 1:  # the part's last document's EOS
                changed |= {"train: EOS count == documents": "EOS 292, documents 293"}
                changed |= {"train: every document ends with EOS": "1 do not"}
            assert failed == changed, at
    assert failed_checks(out) == []


def test_checks_give_the_same_verdicts_on_one_thread_and_on_many(out):
    ends = np.fromfile(out / "val.idx", dtype="<i8")
    poke(out / "val.bin", ends[3] - 1, 42)
    one = [(c.name, c.ok, c.detail) for c in verify(out, jobs=1)]
    assert one == [(c.name, c.ok, c.detail) for c in verify(out, jobs=8)] and not all(ok for _, ok, _ in one)


def test_a_grouped_output_is_verified_group_by_group(finished_grouped, tmp_path):
    """--group-by: every group's file is checked against its parts' checksums, and the groups against the
    split; a byte changed in one group's file fails the checksum, naming the shard whose range it is in."""
    assert not failed_checks(finished_grouped)
    names = [c.name for c in verify(finished_grouped)]
    assert "train: groups add up to meta" in names and "validation: groups add up to meta" in names
    out = shutil.copytree(finished_grouped, tmp_path / "out")
    with open(out / "train" / "RedPajamaGithub.bin", "r+b") as f:
        f.seek(4 * 100)
        f.write((7).to_bytes(4, "little"))
    failed = {c.name: c.detail for c in verify(out) if not c.ok}
    assert failed == {
        "train: sha256 matches meta": "the token bytes changed since finalize, in the range of "
        "train/chunk1/example_train_0.jsonl.zst"
    }


def test_sample_re_encodes_a_long_document_a_piece_at_a_time(tmp_path, monkeypatch):
    from tokpipe.inputs.encoders import PIECE_CHARS, HFEncoder
    from tokpipe.read.sample import verify_sample

    texts = ["a short one", long_document(PIECE_CHARS + 5_000), "another short one"]
    write_jsonl(tmp_path / "data" / "train" / "part.jsonl", [json.dumps({"text": t}) for t in texts])
    out = build_out(tmp_path / "out", QWEN3, dataset=tmp_path / "data")
    calls, encode = [], HFEncoder._encode
    monkeypatch.setattr(HFEncoder, "_encode", lambda self, t: calls.append(sum(map(len, t))) or encode(self, t))
    checks = verify_sample(out, 3)
    assert [(c.name, c.ok, c.detail) for c in checks] == [
        (
            "train: 3 sampled documents re-tokenized by tokenizers match",
            True,
            "1 of them over 262,144 characters, re-encoded in pieces",
        )
    ]
    assert max(calls) < PIECE_CHARS + 100  # the reference never holds the whole document
    # and it still sees a wrong id inside that document, past its first piece
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    poke(out / "train.bin", ends[1] - 10, 12345)
    reseal(out, "train")
    assert [c.ok for c in verify_sample(out, 3)] == [False]


def test_sample_passes_over_a_long_document_of_a_tokenizer_it_cannot_cut_and_says_so(tmp_path):
    from tokpipe.inputs.encoders import PIECE_CHARS
    from tokpipe.read.sample import verify_sample

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(QWEN3, tokenizer)
    config = json.loads((tokenizer / "tokenizer.json").read_text())
    config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\S+|\s+"  # not one inputs/pieces.py knows
    (tokenizer / "tokenizer.json").write_text(json.dumps(config))
    texts = ["a short one", long_document(PIECE_CHARS + 5_000), "another short one"]
    write_jsonl(tmp_path / "data" / "train" / "part.jsonl", [json.dumps({"text": t}) for t in texts])
    out = build_out(tmp_path / "out", tokenizer, backend="hf", dataset=tmp_path / "data")
    assert [(c.name, c.ok, c.detail) for c in verify_sample(out, 3)] == [
        (
            "train: 2 sampled documents re-tokenized by tokenizers match",
            True,
            "1 more passed over, not checked: over 262,144 characters, and this tokenizer's pre-tokenizer is not"
            " one tokpipe can cut exactly (tokpipe/inputs/pieces.py)",
        )
    ]


def test_a_sample_of_a_dataset_moved_or_changed_since_the_run_is_one_line(tmp_path):
    # Else its documents would be read from elsewhere, or be other documents, and said not to match their tokens.
    write_jsonl(tmp_path / "data" / "train" / "part.jsonl", [json.dumps({"text": t}) for t in ("one", "two")])
    out = build_out(tmp_path / "out", QWEN3, dataset=tmp_path / "data")
    part = tmp_path / "data" / "train" / "part.jsonl"
    part.write_text(part.read_text() + '{"text": "three"}\n')
    said = f"tokpipe verify: error: --sample re-reads documents from the run's dataset, and {part} (train/part.jsonl in"
    advice = "put the dataset back as the run read it, or verify without --sample\n"
    assert (
        cli("verify", out, "--sample", "1").stderr
        == f"{said} OUT's manifest.json) is 50 bytes, where the run read 32: {advice}"
    )
    part.unlink()
    assert cli("verify", out, "--sample", "1").stderr == f"{said} OUT's manifest.json) is not there: {advice}"
    assert cli("verify", out).returncode == 0  # the output itself holds


def test_every_check_and_a_sample_hold_where_out_is_in_a_folder_or_on_a_store(finished_either):
    result = cli("verify", finished_either, "--sample", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-3:] == [  # the sample: each document read from its source and encoded again by `tokenizers`
        "ok    train: 1 sampled document re-tokenized by tokenizers matches",
        "ok    validation: 1 sampled document re-tokenized by tokenizers matches",
        "all 35 checks hold",
    ]
    assert f"ok    train: parts list present  ({finished_either}/train.parts)" in lines


def test_on_a_store_each_token_file_is_found_in_the_listing_and_its_parts_read_in_one_get(finished_stored, monkeypatch):
    """No HEAD: each file as the LIST of OUT found it (its size checked, its ETag kept for every read); a GET for a span
    of back-to-back parts' document ends, one for each buffer of their tokens: a request is a round trip, and 2,000
    groups' files took 130 s to verify on SeaweedFS a part at a time and each file looked up twice."""
    asked = collections.Counter()
    for request in ("head", "read"):

        def counted(bucket, key, *args, asked_for=getattr(Bucket, request), request=request):
            asked[request, key.rsplit("/", 1)[-1]] += 1
            return asked_for(bucket, key, *args)

        monkeypatch.setattr(Bucket, request, counted)
    assert failed_checks(finished_stored) == []
    files = ("train.bin", "train.idx", "val.bin", "val.idx")
    assert {(request, name): n for (request, name), n in asked.items() if name in files} == {
        ("read", name): 1 for name in files  # train.bin's two parts in one buffer, their ends in one GET
    }


def test_a_token_changed_on_the_store_fails_the_checksum_read_by_ranged_gets(
    s3_server, s3_prefix, manifest, small_tokenizer
):
    url = s3_server.url(s3_prefix)
    run = store_out_run(manifest, url, tokenizer=small_tokenizer)
    assert run.returncode == 0, run.stdout + run.stderr
    key = f"{s3_prefix}/train.bin"
    tokens = np.frombuffer(s3_server.client().get_object(Bucket=s3_server.bucket, Key=key)["Body"].read(), "<u2")
    tokens = tokens.copy()
    tokens[[100, 101]] = tokens[[101, 100]]
    s3_server.put(key, tokens.tobytes())
    assert failed_checks(url) == ["train: sha256 matches meta"]


def test_an_unfinished_out_on_a_store_is_said_unfinished_without_a_copy_of_its_segments_records(
    unfinished_stored, monkeypatch
):
    # A live run of 2.5 TB holds ~60,000 segments: their records (~2 ms of botocore a GET) took minutes to copy before
    # verify said that meta.pkl is missing. Its meta's HEAD, then its manifest, say it.
    asked = store_requests(monkeypatch)
    verified = cli("verify", unfinished_stored)
    assert verified.returncode == 1
    assert verified.stdout.splitlines()[-1] == "1 of 1 checks FAILED"
    prefix = unfinished_stored.removeprefix("s3://").partition("/")[2]
    reads = [(operation, p["Key"].removeprefix(f"{prefix}/")) for operation, p in asked if "Key" in p]
    assert reads == [("HeadObject", "meta.pkl"), ("GetObject", "manifest.json")]
