"""export: Megatron-LM and llm.c files that read back, with readers written here from the published
formats (not tokpipe's writer), as exactly the tokpipe bins, document boundaries intact. Megatron's
.bin is the split file itself (a hard link) where it can be, and a copy that says so where it cannot;
llm.c's shards can hold the documents in a seeded order, each once and whole, in bounded memory."""

import errno
import json
import os
import shutil
import struct
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from helpers import bind_mount, build_out, cli, failed_checks, write_jsonl

from tokpipe import durability
from tokpipe.commands import export as export_module
from tokpipe.commands.export import export
from tokpipe.data import Permutation
from tokpipe.errors import UserError
from tokpipe.layout.files import load_meta_pkl
from tokpipe.options import RunOptions

# Megatron-LM megatron/core/datasets/indexed_dataset.py, _IndexReader: its DType codes.
MEGATRON_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def read_megatron(prefix):
    """(dtype, documents as arrays, document_indices), read as Megatron's _IndexReader and _MMapBinReader do."""
    idx = open(f"{prefix}.idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", idx[9:17])
    (code,) = struct.unpack("<B", idx[17:18])
    sequence_count, document_count = struct.unpack("<QQ", idx[18:34])
    assert version == 1
    dtype = np.dtype(MEGATRON_DTYPES[code])
    offset = 34
    lengths = np.frombuffer(idx, dtype=np.int32, count=sequence_count, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(idx, dtype=np.int64, count=sequence_count, offset=offset)
    offset += pointers.nbytes
    document_indices = np.frombuffer(idx, dtype=np.int64, count=document_count, offset=offset)
    assert offset + document_indices.nbytes == len(idx)
    data = open(f"{prefix}.bin", "rb").read()
    sequences = [np.frombuffer(data, dtype=dtype, count=n, offset=p) for n, p in zip(lengths, pointers)]
    return dtype, sequences, document_indices


def read_llmc(path):
    """(magic, version, tokens) of one llm.c .bin: 256 int32 header, header[2] tokens after it."""
    raw = open(path, "rb").read()
    header = np.frombuffer(raw, dtype="<i4", count=256)
    dtype = {(20240520, 1): np.uint16, (20240801, 7): np.uint32}[(int(header[0]), int(header[1]))]
    tokens = np.frombuffer(raw, dtype=dtype, offset=256 * 4)
    assert len(tokens) == header[2]
    return int(header[0]), int(header[1]), tokens


def tokpipe_split(out, stem):
    meta = load_meta_pkl(out / "meta.pkl")
    tokens = np.fromfile(out / f"{stem}.bin", dtype=meta["dtype"])
    ends = np.fromfile(out / f"{stem}.idx", dtype="<i8")
    return meta, tokens, ends


def documents_of(tokens, ends) -> list[np.ndarray]:
    return [tokens[a:b] for a, b in zip(np.concatenate(([0], ends[:-1])), ends)]


def llmc_tokens(folder, stem) -> list[np.ndarray]:
    return [read_llmc(f)[2] for f in sorted(folder.glob(f"{stem}_*.bin"))]


@pytest.mark.parametrize("fixture, dtype", [("finished_example", np.int32), ("finished_small", np.uint16)])
def test_megatron_reads_back_document_by_document(fixture, dtype, request, tmp_path):
    out = request.getfixturevalue(fixture)
    result = cli("export", out, "--format", "megatron", "-o", tmp_path / "mg")  # -o: the short --dest, as elsewhere
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"Megatron-LM: --train-data-path {tmp_path / 'mg' / 'train'} --valid-data-path {tmp_path / 'mg' / 'val'} "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR (the tokenizer folder of the run)"
    )
    for stem in ("train", "val"):
        meta, tokens, ends = tokpipe_split(out, stem)
        got_dtype, sequences, document_indices = read_megatron(tmp_path / "mg" / stem)
        assert got_dtype == dtype  # Megatron's rule: uint16 below 65,500 ids, else int32
        assert np.array_equal(document_indices, np.arange(len(ends) + 1))
        assert len(sequences) == len(ends)
        assert np.array_equal(np.cumsum([len(s) for s in sequences]), ends)
        assert np.array_equal(np.concatenate(sequences).astype(np.int64), tokens.astype(np.int64))
        assert all(s[-1] == meta["eos_token_id"] for s in sequences)
    assert sorted(p.name for p in (tmp_path / "mg").iterdir()) == ["train.bin", "train.idx", "val.bin", "val.idx"]
    assert result.stdout.splitlines()[0].endswith(" documents; hard link to the split file (no copy)")


@pytest.mark.parametrize(
    "fixture, magic, version", [("finished_example", 20240801, 7), ("finished_small", 20240520, 1)]
)
def test_llmc_shards_read_back_whole_documents(fixture, magic, version, request, tmp_path):
    out = request.getfixturevalue(fixture)
    limit = 100_000
    export(out, "llmc", tmp_path / "llmc", shard_tokens=limit)
    for stem in ("train", "val"):
        meta, tokens, ends = tokpipe_split(out, stem)
        files = sorted((tmp_path / "llmc").glob(f"{stem}_*.bin"))
        assert [f.name for f in files] == [f"{stem}_{k:06d}.bin" for k in range(len(files))]
        shards = [read_llmc(f) for f in files]
        assert {(m, v) for m, v, _ in shards} == {(magic, version)}
        assert np.array_equal(np.concatenate([t for _, _, t in shards]).astype(np.int64), tokens.astype(np.int64))
        assert all(len(t) <= limit for _, _, t in shards)
        # Every shard ends where a document ends (with its EOS), unless that document alone is longer than a shard.
        starts = np.concatenate(([0], ends[:-1]))
        for cut, (_, _, t) in zip(np.cumsum([len(t) for _, _, t in shards]), shards):
            doc = np.searchsorted(ends, cut - 1, side="right")
            assert (cut == ends[doc] and t[-1] == meta["eos_token_id"]) or ends[doc] - starts[doc] > limit
    assert len(list((tmp_path / "llmc").glob("train_*.bin"))) > 1


@pytest.mark.parametrize("form", ["llmc", "megatron"])
def test_an_out_on_a_store_exports_its_tokens(finished_stored, example_reference, form, tmp_path):
    result = cli("export", finished_stored, "--format", form, "--dest", tmp_path / form)
    assert result.returncode == 0, result.stdout + result.stderr
    for stem, expected in example_reference.items():
        if form == "llmc":
            tokens = np.concatenate([read_llmc(f)[2] for f in sorted((tmp_path / form).glob(f"{stem}_*.bin"))])
        else:
            tokens = np.fromfile(tmp_path / form / f"{stem}.bin", dtype=np.int32)
        assert np.array_equal(tokens.astype(np.int64), expected.astype(np.int64))
    if form == "megatron":
        assert result.stdout.splitlines()[0].endswith(" documents; downloaded from the store (a copy)")


def test_a_shuffled_export_of_an_out_on_a_store_is_refused_in_one_line(finished_stored, tmp_path):
    result = cli("export", finished_stored, "--format", "llmc", "--shuffle", "1", "--dest", tmp_path / "llmc")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tokpipe export: error: --shuffle reads the documents at random places, on a store a request each: copy"
        f" {finished_stored} first (aws s3 sync, rclone) and export from the copy"
    ]
    assert not (tmp_path / "llmc").exists()


def test_llmc_splits_a_document_longer_than_a_shard(finished_example, tmp_path):
    _, tokens, ends = tokpipe_split(finished_example, "val")
    limit = int(np.diff(ends, prepend=0).max()) - 1
    export(finished_example, "llmc", tmp_path, shard_tokens=limit)
    shards = [read_llmc(f)[2] for f in sorted(tmp_path.glob("val_*.bin"))]
    assert np.array_equal(np.concatenate(shards), tokens) and max(map(len, shards)) <= limit


def test_non_empty_dest_needs_force_and_force_leaves_no_stale_shards(finished_small, tmp_path):
    dest = tmp_path / "d"
    export(finished_small, "llmc", dest, shard_tokens=20_000)
    many = sorted(p.name for p in dest.iterdir())
    result = cli("export", finished_small, "--format", "llmc", "--dest", dest)
    assert result.returncode == 2 and "is not empty" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    (dest / "notes.txt").write_text("mine")
    export(finished_small, "llmc", dest, force=True)  # one shard per split now
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt", "train_000000.bin", "val_000000.bin"]
    assert len(many) > 2 and not list(dest.glob("*.tmp"))


@pytest.mark.parametrize("form", ["megatron", "llmc"])
def test_an_export_interrupted_before_its_renames_is_run_again_by_the_same_command(
    finished_small, tmp_path, monkeypatch, form
):
    # It left its temporary files (llm.c's a copy of every token), and the same command said "is not empty".
    dest, whole = tmp_path / "d", tmp_path / "whole"
    export(finished_small, form, whole)

    def interrupted(*_):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(export_module.os, "replace", interrupted)
        assert cli("export", finished_small, "--format", form, "--dest", dest).returncode == 130
    assert list(dest.glob("*.tmp")) and not [p for p in dest.iterdir() if not p.name.endswith(".tmp")]
    again = cli("export", finished_small, "--format", form, "--dest", dest)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in whole.iterdir())
    assert all((dest / p.name).read_bytes() == p.read_bytes() for p in whole.iterdir())


def test_out_itself_is_no_dest(finished_small):
    with pytest.raises(UserError, match="is OUT itself"):
        export(finished_small, "megatron", finished_small, force=True)


def test_unfinished_out_cannot_be_exported(killed_example, tmp_path):
    with pytest.raises(UserError, match="not a finished tokpipe output"):
        export(killed_example, "megatron", tmp_path / "d")


@pytest.mark.parametrize("shuffle", [None, 1])
def test_a_llmc_shard_of_a_few_tokens_has_its_header(tmp_path, small_tokenizer, shuffle):
    # The header was written at offset 0 beside the buffered file, then the buffer's zeros over it: a shard smaller
    # than a write buffer (8 KiB: a small split, a split's last shard) was all zeros where llm.c checks its magic.
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", [json.dumps({"text": f"document {i}"}) for i in range(3)])
    out = build_out(tmp_path / "out", small_tokenizer, backend="hf", dataset=tmp_path / "data")
    export(out, "llmc", tmp_path / "llmc", shuffle=shuffle)
    magic, version, tokens = read_llmc(tmp_path / "llmc" / "train_000000.bin")
    assert (magic, version) == (20240520, 1)
    expected = tokpipe_split(out, "train")[1]
    assert (tokens.tolist() if shuffle is None else sorted(tokens.tolist())) == (
        expected.tolist() if shuffle is None else sorted(expected.tolist())
    )

def test_llmc_s_line_names_only_the_splits_it_wrote(tmp_path, small_tokenizer):
    """A dataset of a train split alone: the line said to evaluate on val_*.bin, which no file matched."""
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", [json.dumps({"text": f"document {i}"}) for i in range(3)])
    out = build_out(tmp_path / "out", small_tokenizer, backend="hf", dataset=tmp_path / "data")
    result = cli("export", out, "--format", "llmc", "--dest", tmp_path / "llmc")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"llm.c / modded-nanogpt: train on '{tmp_path / 'llmc' / 'train_*.bin'}'; no val split has documents to"
        " evaluate on"
    )


def test_megatron_s_line_leaves_out_an_empty_split(tmp_path, small_tokenizer):
    """--val-fraction that held out none of 3 documents: val has no token. Megatron-Core's GPTDataset adds epochs of a
    dataset until they hold the samples asked for (_get_num_epochs), which an empty one never does."""
    from tokpipe.options import RunOptions

    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", [json.dumps({"text": f"document {i}"}) for i in range(3)])
    options = RunOptions(val_fraction=0.0001)
    out = build_out(tmp_path / "out", small_tokenizer, backend="hf", options=options, dataset=tmp_path / "data")
    result = cli("export", out, "--format", "megatron", "-o", tmp_path / "mg")  # -o: the short --dest, as elsewhere
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"Megatron-LM: --train-data-path {tmp_path / 'mg' / 'train'} --tokenizer-type HuggingFaceTokenizer"
        " --tokenizer-model TOKENIZER_DIR (the tokenizer folder of the run); val left out: no documents (Megatron-LM's"
        " index of an empty one never ends)"
    )


def test_exports_keep_the_delimiters_the_run_placed(tmp_path):
    from helpers import QWEN3, build_out

    from tokpipe.options import RunOptions

    out = build_out(tmp_path / "out", QWEN3, options=RunOptions(bos=True, bos_token="<|im_start|>"))
    export(out, "megatron", tmp_path / "mg")
    export(out, "llmc", tmp_path / "llmc", shard_tokens=100_000)  # longer than any document here
    for stem in ("train", "val"):
        _, tokens, ends = tokpipe_split(out, stem)
        _, sequences, _ = read_megatron(tmp_path / "mg" / stem)
        assert np.array_equal(np.concatenate(sequences).astype(np.int64), tokens.astype(np.int64))
        assert np.array_equal(np.cumsum([len(s) for s in sequences]), ends) and all(s[0] == 151644 for s in sequences)
        shards = [read_llmc(f)[2] for f in sorted((tmp_path / "llmc").glob(f"{stem}_*.bin"))]
        assert np.array_equal(np.concatenate(shards), tokens) and len(shards) > 1
        assert all(t[0] == 151644 for t in shards)  # each llm.c shard starts where a document does


def test_a_grouped_output_exports_a_megatron_prefix_per_group_and_its_token_weighted_blend(
    finished_grouped, grouped_reference, tmp_path
):
    """--group-by: Megatron gets DEST/<split>/<group>.bin/.idx per group, and the command line weighs each
    group by its share of the split's tokens: `--train-data-path W1 PREFIX1 W2 PREFIX2 ...`."""
    dest = tmp_path / "megatron"
    result = cli("export", finished_grouped, "--format", "megatron", "--dest", dest)
    assert result.returncode == 0, result.stderr
    flags = []
    for stem, flag in (("train", "--train-data-path"), ("val", "--valid-data-path")):
        reference = grouped_reference[stem]
        total = sum(len(t) for t, _, _ in reference.values())
        flags.append(flag)
        for group, (tokens, documents, _) in reference.items():
            assert np.array_equal(np.fromfile(dest / stem / f"{group}.bin", dtype=np.int32), tokens)
            idx = (dest / stem / f"{group}.idx").read_bytes()
            assert struct.unpack("<Q", idx[18:26])[0] == documents
            flags += [f"{len(tokens) / total:.6f}", str(dest / stem / group)]
    assert f"Megatron-LM: {' '.join(flags)} --tokenizer-type" in result.stdout


# -- megatron: the split file's bytes, linked where they can be ------------------------------------------


def test_megatron_bin_is_the_split_file_itself(out, tmp_path):
    written = export(out, "megatron", tmp_path / "mg")
    for stem in ("train", "val"):
        split, exported = os.stat(out / f"{stem}.bin"), os.stat(tmp_path / "mg" / f"{stem}.bin")
        assert (exported.st_ino, exported.st_nlink) == (split.st_ino, 2)  # no byte copied, no block used
    assert {e.how for e in written} == {"hard link to the split file (no copy)"}
    export(out, "megatron", tmp_path / "mg", force=True)  # again: still one link, no .tmp left beside it
    assert os.stat(out / "train.bin").st_nlink == 2 and not list((tmp_path / "mg").glob("*.tmp"))


def test_across_file_systems_the_bin_is_copied_and_says_so(out, tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(durability, "reflink", lambda src_fd, dst_fd: False)
    written = export(out, "megatron", tmp_path / "mg")
    assert {e.how for e in written} == {
        "copied in the kernel (copy_file_range) (OUT and --dest are on different file systems)"
    }
    for stem in ("train", "val"):
        assert os.stat(tmp_path / "mg" / f"{stem}.bin").st_nlink == 1
        assert (tmp_path / "mg" / f"{stem}.bin").read_bytes() == (out / f"{stem}.bin").read_bytes()
        _, sequences, _ = read_megatron(tmp_path / "mg" / stem)
        _, tokens, ends = tokpipe_split(out, stem)
        assert all(np.array_equal(s, d) for s, d in zip(sequences, documents_of(tokens, ends), strict=True))


def test_on_another_file_system_for_real(out):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(out).st_dev:
        pytest.skip("no second file system here")
    dest = __import__("tempfile").mkdtemp(dir=shm)
    try:
        written = export(out, "megatron", dest)
        assert written[0].how.endswith("(OUT and --dest are on different file systems)")
        assert open(f"{dest}/train.bin", "rb").read() == (out / "train.bin").read_bytes()
    finally:
        shutil.rmtree(dest)


def test_ids_of_another_width_are_converted_and_read_back(finished_small, tmp_path, monkeypatch):
    # A vocabulary of 65,500 to 65,536 ids: tokpipe's uint16, Megatron's int32. Stood in for by the small one.
    monkeypatch.setattr(export_module, "megatron_dtype", lambda vocab_size: "int32")
    written = export(finished_small, "megatron", tmp_path / "mg")
    assert written[0].how == "converted uint16 to int32 (a copy: Megatron stores 600 ids as int32)"
    _, tokens, ends = tokpipe_split(finished_small, "train")
    dtype, sequences, _ = read_megatron(tmp_path / "mg" / "train")
    assert dtype == np.int32 and [s.tolist() for s in sequences] == [d.tolist() for d in documents_of(tokens, ends)]


def test_a_killed_exports_link_is_never_written_through(finished_small, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(finished_small, out)
    before = (out / "train.bin").read_bytes()
    (tmp_path / "mg").mkdir()
    os.link(out / "train.bin", tmp_path / "mg" / "train.bin.tmp")  # killed between the link and the rename
    monkeypatch.setattr(export_module, "megatron_dtype", lambda vocab_size: "int32")  # this export converts
    export(out, "megatron", tmp_path / "mg", force=True)
    assert (out / "train.bin").read_bytes() == before
    assert len((tmp_path / "mg" / "train.bin").read_bytes()) == 2 * len(before)


def test_a_no_concat_split_is_joined_into_one_bin(tmp_path):
    from helpers import QWEN3, build_out

    from tokpipe.options import RunOptions

    out = build_out(tmp_path / "out", QWEN3, options=RunOptions(no_concat=True))
    written = export(out, "megatron", tmp_path / "mg")
    assert written[0].how == "2 --no-concat files joined by copy_file_range (a copy)"
    files = [out / f["bin"] for f in load_meta_pkl(out / "meta.pkl")["splits"]["train"]["files"]]
    assert (tmp_path / "mg" / "train.bin").read_bytes() == b"".join(f.read_bytes() for f in files)


# -- llmc --shuffle: every document once, whole, in a seeded order ------------------------------------------


# The order is tokpipe.data.Permutation's (a bijection: tests/test_data_sequences.py).


@pytest.mark.parametrize("fixture", ["finished_example", "finished_small"])
def test_shuffled_llmc_holds_every_document_once_whole_in_the_seeds_order(fixture, request, tmp_path):
    out = request.getfixturevalue(fixture)
    limit = 50_000
    result = cli("export", out, "--format", "llmc", "--dest", tmp_path / "s1", "--shuffle", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith("(documents in the order of --shuffle 1)")
    export(out, "llmc", tmp_path / "s1again", shard_tokens=limit, shuffle=1)
    export(out, "llmc", tmp_path / "s2", shard_tokens=limit, shuffle=2)
    for stem in ("train", "val"):
        meta, tokens, ends = tokpipe_split(out, stem)
        documents = documents_of(tokens, ends)
        shards = llmc_tokens(tmp_path / "s1again", stem)
        got = np.concatenate(shards)
        # Read back by EOS alone (no document of these holds one inside): the same documents, each once.
        assert np.count_nonzero(tokens == meta["eos_token_id"]) == len(documents)
        cuts = np.flatnonzero(got == meta["eos_token_id"]) + 1
        read = np.split(got, cuts[:-1])
        assert Counter(d.tobytes() for d in read) == Counter(d.tobytes() for d in documents)
        # In the order of Permutation(documents, seed), which is a bijection (tested above).
        order = Permutation(len(documents), 1)[np.arange(len(documents))]
        assert all(np.array_equal(r, documents[i]) for r, i in zip(read, order))
        assert [r.tobytes() for r in read] != [d.tobytes() for d in documents]
        # llm.c's shard sizes: each shard ends at the last document that fits, the next would not; only a
        # document longer than a whole shard is cut, at the shard's end.
        lengths = [len(documents[i]) for i in order]
        doc_ends = np.cumsum(lengths)
        assert all(len(s) <= limit for s in shards)
        for k, end in enumerate(np.cumsum([len(s) for s in shards])[:-1]):
            i = int(np.searchsorted(doc_ends, end))
            if doc_ends[i] == end:
                assert len(shards[k]) + lengths[i + 1] > limit
            else:
                assert len(shards[k]) == limit and lengths[i] > limit
        # The same seed, the same bytes; another seed, another order of the same tokens.
        again = np.concatenate(llmc_tokens(tmp_path / "s1", stem))
        other = np.concatenate(llmc_tokens(tmp_path / "s2", stem))
        assert np.array_equal(again, got) and not np.array_equal(other, got)
        assert np.array_equal(np.sort(other), np.sort(tokens))
    export(out, "llmc", tmp_path / "s1thrice", shard_tokens=limit, shuffle=1)
    files = sorted((tmp_path / "s1again").iterdir())
    assert [p.read_bytes() for p in files] == [(tmp_path / "s1thrice" / p.name).read_bytes() for p in files]


def test_a_shuffled_no_concat_split_gives_the_bytes_of_a_concatenated_one(finished_example, tmp_path):
    from helpers import QWEN3, build_out

    from tokpipe.options import RunOptions

    files_out = build_out(tmp_path / "out", QWEN3, options=RunOptions(no_concat=True))
    export(files_out, "llmc", tmp_path / "files", shard_tokens=30_000, shuffle=5)
    export(finished_example, "llmc", tmp_path / "concat", shard_tokens=30_000, shuffle=5)
    names = sorted(p.name for p in (tmp_path / "concat").iterdir())
    assert len(names) > 4 and names == sorted(p.name for p in (tmp_path / "files").iterdir())
    assert all((tmp_path / "files" / n).read_bytes() == (tmp_path / "concat" / n).read_bytes() for n in names)


def test_token_positions_of_documents_one_after_another():
    starts, lengths = np.array([50, 7, 90, 0, 3]), np.array([3, 2, 0, 4, 1])
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert export_module._positions(starts, lengths).tolist() == expected.tolist()


def test_a_shuffled_export_holds_chunks_not_the_split(finished_example, tmp_path, monkeypatch):
    # Small steps, so the split is many of them: the peak is a step's, whatever the split's size.
    monkeypatch.setattr(export_module, "SHUFFLE_DOCUMENTS", 16)
    monkeypatch.setattr(export_module, "SHUFFLE_TOKENS", 4096)
    split_bytes = (finished_example / "train.bin").stat().st_size
    tracemalloc.start()
    export(finished_example, "llmc", tmp_path, shuffle=3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert split_bytes > 3_000_000 and peak < 400_000  # measured: 167 kB


def test_shuffle_is_for_llmc(finished_small, tmp_path):
    result = cli("export", finished_small, "--format", "megatron", "--dest", tmp_path, "--shuffle", "1")
    assert result.returncode == 2 and result.stderr.strip() == (
        "tokpipe export: error: --shuffle is for --format llmc: Megatron-LM shuffles its samples itself "
        "(its shuffle index)"
    )


# -- never into OUT, by whichever path it is reached ----------------------------------------------------------


def test_force_through_a_bind_mount_of_out_is_refused_and_out_stays_whole(out, tmp_path):
    """OUT mounted at a second path (a container's volume, `mount --bind`): the same folder, which a path compares
    as another. Megatron's .idx through it replaced OUT's own (verify then failed); refused, by identity."""
    before = sorted(p.name for p in out.iterdir())
    with bind_mount(out, tmp_path / "mnt") as other:
        for fmt in ("megatron", "llmc"):
            result = cli("export", out, "--format", fmt, "--dest", other, "--force")
            assert (result.returncode, result.stderr) == (
                2,
                f"tokpipe export: error: --dest {other} is OUT itself: the export's files would mix with OUT's"
                " (Megatron's .idx would replace OUT's); choose another folder\n",
            )
    assert failed_checks(out) == [] and sorted(p.name for p in out.iterdir()) == before


def test_force_through_a_symlink_to_a_folder_of_out_is_refused_before_it_touches_a_file_of_out(
    tmp_path, small_tokenizer
):
    """A folder of OUT at another path, where no mount is possible: a symlink to a split's folder of group files
    (--group-by). A group named as an llm.c shard, val_000000, has OUT/train/val_000000.bin, which an llm.c
    export with --force there removed as a stale shard of an earlier export; compared by identity, it is OUT's.
    A folder named inside OUT by its own path is the user's: its files are the export's."""
    lines = [json.dumps({"text": f"document {i}", "source": "val_000000"}) for i in range(20)]
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", lines)
    options = RunOptions(group_by="source")
    out = build_out(tmp_path / "out", small_tokenizer, "hf", options, dataset=tmp_path / "data")
    link = tmp_path / "link"
    link.symlink_to(out / "train")
    result = cli("export", out, "--format", "llmc", "--dest", link, "--force")
    assert (result.returncode, result.stderr) == (
        2,
        f"tokpipe export: error: --dest {link}: the export would replace or remove {link}/val_000000.bin, which is"
        f" {out}/train/val_000000.bin of OUT reached through another path (a bind mount, a symlink); choose a"
        " folder outside OUT\n",
    )
    assert failed_checks(out) == [] and sorted(p.name for p in (out / "train").iterdir()) == [
        "val_000000.bin",
        "val_000000.idx",
    ]
    # A folder named inside OUT by its path is the user's, not one of OUT's: exported into, and again with --force.
    export(out, "llmc", out / "llmc")
    assert [e.path.name for e in export(out, "llmc", out / "llmc", force=True)] == ["train_000000.bin"]
