"""export: Megatron-LM and llm.c files that read back, with readers written here from the published
formats (not tokpipe's writer), as exactly the tokpipe bins, document boundaries intact."""

import struct

import numpy as np
import pytest
from helpers import tokpipe

from tokpipe.errors import UserError
from tokpipe.export import export
from tokpipe.layout import load_meta_pkl

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


@pytest.mark.parametrize("fixture, dtype", [("finished_example", np.int32), ("finished_small", np.uint16)])
def test_megatron_reads_back_document_by_document(fixture, dtype, request, tmp_path):
    out = request.getfixturevalue(fixture)
    result = tokpipe("export", out, "--format", "megatron", "--dest", tmp_path / "mg")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"Megatron-LM: --train-data-path {tmp_path / 'mg' / 'train'} --valid-data-path {tmp_path / 'mg' / 'val'} "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR (the run's)"
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
    result = tokpipe("export", finished_small, "--format", "llmc", "--dest", dest)
    assert result.returncode == 2 and "is not empty" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    (dest / "notes.txt").write_text("mine")
    export(finished_small, "llmc", dest, force=True)  # one shard per split now
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt", "train_000000.bin", "val_000000.bin"]
    assert len(many) > 2 and not list(dest.glob("*.tmp"))


def test_unfinished_out_cannot_be_exported(killed_example, tmp_path):
    with pytest.raises(UserError, match="not a finished tokpipe output"):
        export(killed_example, "megatron", tmp_path / "d")


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
    result = tokpipe("export", finished_grouped, "--format", "megatron", "--dest", dest)
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
