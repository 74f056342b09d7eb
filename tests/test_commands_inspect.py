"""inspect: the eye test. Decoded windows with boundaries marked; a Phantom Zero file is flagged, loudly."""

import json
import pickle
import re

import numpy as np
import pytest
from helpers import QWEN3, QWEN3_EOS, cli, run_args, tokpipe, write_jsonl

from tokpipe.commands.inspect import EOS_MARK, Source, TokenFile, inspect, red_flags, render, scan_ids
from tokpipe.errors import UserError
from tokpipe.inputs.encoders import encoder
from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.layout.files import load_meta_pkl


def failed(ins) -> list[str]:
    return [c.name for c in ins.flags if not c.ok]


def rewrite(out, dtype, transform):
    """Replace every split file by transform(tokens) and say `dtype` in both metas, as a careless pipeline would."""
    meta = load_meta_pkl(out / "meta.pkl")
    for info in meta["splits"].values():
        tokens = np.fromfile(out / info["file"], dtype=meta["dtype"])
        transform(tokens).astype(dtype).tofile(out / info["file"])
    meta["dtype"] = dtype
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))
    (out / "meta.json").write_text(json.dumps(meta))


def test_good_output_has_no_red_flags_and_same_seed_same_windows(finished_example):
    ins = inspect(finished_example, n=4, window=32, seed=11)
    assert ins.ok and ins.tokenizer_path == str((QWEN3 / "tokenizer.json").resolve())
    assert len(ins.windows) == 4 and all(len(w.ids) == 32 for w in ins.windows)
    assert [w.start for w in inspect(finished_example, n=4, window=32, seed=11).windows] == [
        w.start for w in ins.windows
    ]
    result = cli("inspect", finished_example, "--split", "val", "-n", "2", "--seed", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "validation:" in result.stdout and "── 1/2  val.bin[" in result.stdout and lines[-1] == "all 6 checks hold"
    assert sum(line.startswith("── ") and "val.bin[" in line for line in lines) == 2


def test_windows_mark_every_document_boundary(finished_example):
    ins = inspect(finished_example, n=5, window=4000, seed=1)
    for w, text in zip(ins.windows, ins.texts):
        assert text.count(EOS_MARK) == np.count_nonzero(w.ids == QWEN3_EOS)
        assert "<|endoftext|>" not in text  # the marker, never the token's text (which a web page may contain)
    assert sum(text.count(EOS_MARK) for text in ins.texts) > 0


def test_render_shows_boundaries_out_of_vocab_ids_and_no_terminal_escapes():
    decode = encoder("hf", str(QWEN3 / "tokenizer.json")).decode
    ids, _ = encoder("hf", str(QWEN3 / "tokenizer.json")).encode(["Hello", " world\x1b[2J\r"])
    hello, world = ids[:1], ids[1:]
    text = render(np.concatenate([hello, [QWEN3_EOS, 999_999], world]).astype(np.uint32), decode, QWEN3_EOS, 151669)
    assert text == "Hello⟨EOS⟩\n⟨id 999999 ≥ vocab_size⟩ world\\x1b[2J\\x0d"


def test_phantom_zero_uint16_file_is_flagged(out):
    # The incident: Qwen3 ids written as uint16 (wrapped), meta saying uint16.
    rewrite(out, "uint16", lambda t: t)
    ins = inspect(out, n=2)
    assert failed(ins) == ["dtype holds vocab", f"share of EOS (id {QWEN3_EOS})", "ids ≥ 65,536 present"]
    assert EOS_MARK not in "".join(ins.texts)
    result = cli("inspect", out, "-n", "1")
    assert result.returncode == 1
    assert (
        "FAIL  dtype holds vocab  (uint16 holds ids < 65,536; vocab_size 151,669: every id ≥ 65,536 was wrapped "
        "(Phantom Zero))" in result.stdout
    )
    assert "document boundaries are lost" in result.stdout and "RED FLAGS" in result.stdout


def test_wrapped_ids_kept_in_uint32_are_flagged(out):
    # Wrapped once on the way (a uint16 intermediate), stored back as uint32: meta looks right.
    rewrite(out, "uint32", lambda t: t.astype(np.uint16))
    assert failed(inspect(out, n=0)) == [f"share of EOS (id {QWEN3_EOS})", "ids ≥ 65,536 present"]


def _source(tokens, dtype, documents, vocab_size=151669, eos_id=QWEN3_EOS):
    file = TokenFile("x.bin", tokens, np.zeros(0, np.int64))
    return Source(
        "train", True, np.dtype(dtype), vocab_size, eos_id, "<|endoftext|>", "t", "s", None, documents, [file]
    )


def test_uint32_bytes_read_as_uint16_and_saturation_are_flagged(finished_example):
    tokens = np.fromfile(finished_example / "train.bin", dtype=np.uint32)
    documents = len(np.fromfile(finished_example / "train.idx", dtype="<i8"))
    as_u16 = _source(tokens.view(np.uint16), "uint16", documents, vocab_size=65536)
    assert [c.name for c in red_flags(as_u16, scan_ids(as_u16)) if not c.ok] == [
        "share of id 0",
        f"share of EOS (id {QWEN3_EOS})",
    ]
    saturated = _source(
        np.minimum(tokens, 65535).astype(np.uint16), "uint16", documents, vocab_size=65536, eos_id=65535
    )
    assert "ids near the uint16 limit" in [c.name for c in red_flags(saturated, scan_ids(saturated)) if not c.ok]


def test_out_of_vocab_ids_are_flagged(out):
    tokens = np.memmap(out / "train.bin", dtype=np.uint32, mode="r+")
    tokens[100] = 4_000_000_000
    tokens.flush()
    assert failed(inspect(out, n=0)) == ["max id < vocab_size"]


def test_killed_run_is_inspected_as_far_as_checkpoints_cover(killed_example):
    ins = inspect(killed_example, n=20, window=64, seed=3)
    assert ins.ok and not ins.source.finished
    assert {w.file.name for w in ins.windows} <= {
        "shards/train/train__chunk1__example_train_0.bin",
        "shards/train/train__chunk1__example_train_1.bin",
    }
    # The partial shard holds bytes beyond its checkpoint (written, not committed): never shown.
    partial = next(s for s in ins.source.files if s.name.endswith("train_1.bin"))
    on_disk = (killed_example / partial.name).stat().st_size // 4
    assert len(partial.tokens) < on_disk
    assert all(w.start + len(w.ids) <= len(w.file.tokens) for w in ins.windows)
    with pytest.raises(UserError, match="no tokens of split validation are written yet"):
        inspect(killed_example, split="validation")


def test_an_empty_split_of_a_finished_run_is_said_to_be_empty(tmp_path, small_tokenizer):
    """--val-fraction that held out none of a few documents: val.bin is empty, and the run finished. inspect said
    its tokens were not written yet and sent the user to status."""
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", [json.dumps({"text": f"document {i}"}) for i in range(3)])
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    out = tmp_path / "out"
    run = tokpipe(*run_args(tmp_path / "m.json", out, "--val-fraction", "0.0001", tokenizer=small_tokenizer))
    assert run.returncode == 0 and "validation: 0 tokens, 0 documents" in run.stdout, run.stdout + run.stderr
    said = cli("inspect", out, "--split", "val")
    assert (said.returncode, said.stderr) == (
        2,
        f"tokpipe inspect: error: split validation of {out} is empty (0 tokens): the finished run wrote no document"
        " to it\n",
    )


def test_wrong_or_missing_tokenizer_is_a_user_error(out, small_tokenizer):
    with pytest.raises(UserError, match="OUT was made with qwen3@sha256"):
        inspect(out, tokenizer=str(small_tokenizer))
    run = json.loads((out / "run.json").read_text())
    del run["tokenizer_path"]
    (out / "run.json").write_text(json.dumps(run))
    result = cli("inspect", out)
    assert result.returncode == 2 and "pass it with --tokenizer" in result.stderr
    assert cli("inspect", out, "-n", "1", "--tokenizer", QWEN3).returncode == 0
    assert "there are: train, validation" in cli("inspect", out, "--split", "dev", "--tokenizer", QWEN3).stderr


def test_an_unfinished_grouped_run_is_inspected_through_each_shards_group_parts(tmp_path, grouped_reference):
    """--group-by, before finalize: a split is read from its shards' parts of every group, as far as their
    checkpoints cover them."""
    from helpers import GROUP_FIELD, build_out

    from tokpipe.commands.inspect import open_source
    from tokpipe.options import RunOptions

    out = build_out(tmp_path / "out", QWEN3, options=RunOptions(group_by=GROUP_FIELD), finalized=False)
    for stem, reference in grouped_reference.items():
        source = open_source(out, stem)
        assert not source.finished and len(source.files) == {"train": 7, "val": 4}[stem]  # (shard, group) parts
        assert source.shards == {"train": 2, "val": 1}[stem]  # what inspect's first line counts
        assert source.tokens == sum(len(t) for t, _, _ in reference.values())
        assert source.documents == sum(d for _, d, _ in reference.values())
        assert np.array_equal(
            np.sort(np.concatenate([f.tokens for f in source.files])),
            np.sort(np.concatenate([t for t, _, _ in reference.values()])),
        )


def test_an_out_on_a_store_is_inspected_where_it_is(finished_stored):
    result = cli("inspect", finished_stored, "-n", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == (
        "train: 859,703 tokens, 293 documents of a finished run; uint32, vocab_size 151,669,"
        " EOS '<|endoftext|>' = 151643"
    )
    said = result.stdout.splitlines()[2]
    assert re.fullmatch(r"1 window of up to 64 tokens, seed \d+ \(--seed \d+ shows them again\)", said), said


def test_an_unfinished_out_on_a_store_is_inspected_through_its_segments(unfinished_stored, small_reference):
    """Killed as its finish began: its tokens are in segments, several parts a segment, each part read in its range."""
    from tokpipe.commands.inspect import open_source

    in_segments = {
        "train": ["train__chunk1__example_train_0.bin@0", "train__chunk1__example_train_0.bin@738494"],
        "val": ["validation__chunk1__example_holdout_0.bin@0"],
    }
    for stem, names in in_segments.items():
        source = open_source(unfinished_stored, stem)
        assert not source.finished and [f.name for f in source.files] == names
        assert np.array_equal(np.concatenate([np.asarray(f.tokens) for f in source.files]), small_reference[stem])
    result = cli("inspect", unfinished_stored, "-n", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == (
        "train: 1,647,004 tokens, 293 documents of an unfinished run (2 shards with committed tokens); uint16,"
        " vocab_size 600, EOS '<|endoftext|>' = 0"
    )
