"""inputs/card.py: a hub repo's README.md `configs:`, read as Hugging Face `datasets` reads them. Each test makes a
replica of a real repo's layout (its folders, file names and card) and compares, split by split, the documents of
the shards `tokpipe manifest` lists with those `datasets.load_dataset` itself gives (the reference), or checks that
both refuse. Documents are compared as multisets of their non-empty texts (tokpipe skips an empty one, counted)."""

import json
import random
import zipfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import cli, write_jsonl

import tokpipe
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.source import read_batches


def _load(root: Path, *name: str, cache_dir: Path):
    """`datasets.load_dataset` itself, the reference (imported here: 1.1 s, paid by the tests that use it)."""
    import datasets

    return datasets.load_dataset(str(root), *name, cache_dir=str(cache_dir))


def _write(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _card(root: Path, configs: str) -> None:
    (root / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# A dataset\n")


def _tokpipe(root: Path, *configs: str) -> dict[str, Counter]:
    found: dict[str, Counter] = {}
    for shard in build_manifest(root, configs=configs).shards():
        texts = (t for batch in read_batches(shard.path) for t in batch.texts)
        found.setdefault(shard.split, Counter()).update(texts)
    return found


def _datasets(root: Path, tmp_path: Path, *configs: str | None) -> dict[str, Counter]:
    found: dict[str, Counter] = {}
    for name in configs:
        loaded = _load(root, name, cache_dir=tmp_path / "hf-cache")
        for split, rows in loaded.items():
            found.setdefault(split, Counter()).update(t for t in rows["text"] if t)
    return found


def test_of_two_configs_one_a_superset_the_one_asked_is_read_and_none_asked_is_refused(tmp_path):
    # allenai/c4: en, and en.noblocklist, which holds en's documents and more; neither is the default.
    root = tmp_path / "c4"
    for config, extra in (("en", []), ("en.noblocklist", ["blocked page"])):
        _write(root / config / "c4-train.00000-of-00002.json", ["a page", "another page", *extra])
        _write(root / config / "c4-train.00001-of-00002.json", ["a third page"])
        _write(root / config / "c4-validation.00000-of-00001.json", ["held out", *extra])
    _card(root, "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/c4-train.*.json\n"
        f"  - split: validation\n    path: {c}/c4-validation.*.json\n"
        for c in ("en", "en.noblocklist")
    ))  # fmt: skip
    assert _tokpipe(root, "en") == _datasets(root, tmp_path, "en")
    assert _tokpipe(root, "en.noblocklist") == _datasets(root, tmp_path, "en.noblocklist")
    with pytest.raises(ValueError):
        _load(root, cache_dir=tmp_path / "hf-cache")
    with pytest.raises(UserError) as refused:
        build_manifest(root)
    assert str(refused.value) == (
        f"{root}'s README.md lists configs en, en.noblocklist and none is the default: pick one with --config NAME"
        " (repeat it to read several)"
    )


def test_wikitext_s_two_sizes_of_parquet_files_are_read_one_at_a_time(tmp_path):
    # Salesforce/wikitext: wikitext-103-raw-v1 and wikitext-2-raw-v1 (a subset of it), each with three splits.
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "wikitext"
    for config, texts in (("wikitext-103-raw-v1", ["big", "small"]), ("wikitext-2-raw-v1", ["small"])):
        for split in ("train", "validation", "test"):
            (root / config).mkdir(parents=True, exist_ok=True)
            table = pa.table({"text": [f"{split}: {t}" for t in texts]})
            pq.write_table(table, root / config / f"{split}-00000-of-00001.parquet")
    _card(root, "".join(
        f"- config_name: {c}\n  data_files:\n"
        + "".join(f"  - split: {s}\n    path: {c}/{s}-*\n" for s in ("train", "validation", "test"))
        for c in ("wikitext-103-raw-v1", "wikitext-2-raw-v1")
    ))  # fmt: skip
    for config in ("wikitext-103-raw-v1", "wikitext-2-raw-v1"):
        assert _tokpipe(root, config) == _datasets(root, tmp_path, config)
    assert _tokpipe(root, "wikitext-2-raw-v1")["test"] == Counter(["test: small"])


def test_the_default_config_leaves_out_a_sample_that_repeats_its_documents(tmp_path):
    # HuggingFaceFW/fineweb: the default config is data/*/*; sample/10BT/ repeats some of its documents.
    root = tmp_path / "fineweb"
    _write(root / "data" / "CC-MAIN-2024-10" / "000_00000.jsonl", ["one", "two"])
    _write(root / "data" / "CC-MAIN-2024-18" / "000_00000.jsonl", ["three"])
    _write(root / "sample" / "10BT" / "000_00000.jsonl", ["one", "three"])
    _card(root, "- config_name: default\n  data_files: data/*/*\n- config_name: sample\n  data_files: sample/10BT/*\n")
    assert _tokpipe(root) == _datasets(root, tmp_path, None) == {"train": Counter(["one", "two", "three"])}
    assert _tokpipe(root, "sample") == _datasets(root, tmp_path, "sample")


def test_a_card_s_own_split_folders_go_to_the_splits_it_names(tmp_path):
    # A card that declares validation = heldout/* and test = final_eval/*, whose names no split keyword matches.
    root = tmp_path / "repo"
    _write(root / "data" / "part-0.jsonl", ["trained on"])
    _write(root / "heldout" / "part-0.jsonl", ["validated on"])
    _write(root / "final_eval" / "part-0.jsonl", ["tested on"])
    _card(root, (
        "- config_name: default\n  data_files:\n  - split: train\n    path: data/*\n"
        "  - split: validation\n    path: heldout/*\n  - split: test\n    path: final_eval/*\n"
    ))  # fmt: skip
    assert _tokpipe(root) == _datasets(root, tmp_path, None)
    assert _tokpipe(root)["validation"] == Counter(["validated on"])


def test_a_lone_config_is_the_default_and_a_parquet_conversion_beside_raw_files_is_read_once(tmp_path):
    # A repo whose card points at data/*.parquet (the hub's conversion) beside raw/*.jsonl of the same documents.
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["first", "second"]}), root / "data" / "train-00000-of-00001.parquet")
    _write(root / "raw" / "train.jsonl", ["first", "second"])
    _card(root, "- config_name: plain\n  data_files:\n  - split: train\n    path: data/*.parquet\n")
    assert _tokpipe(root) == _datasets(root, tmp_path, None) == {"train": Counter(["first", "second"])}


def test_configs_with_no_default_are_read_one_or_several_each_file_once(tmp_path):
    # wikimedia/wikipedia: a config per dump and language, none the default.
    root = tmp_path / "wikipedia"
    _write(root / "20231101.en" / "train-00000-of-00001.jsonl", ["Paris is a city"])
    _write(root / "20231101.fr" / "train-00000-of-00001.jsonl", ["Paris est une ville"])
    _card(root, "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n" for c in (
        "20231101.en", "20231101.fr"
    )))  # fmt: skip
    both = _datasets(root, tmp_path, "20231101.en", "20231101.fr")
    assert _tokpipe(root, "20231101.en", "20231101.fr") == both
    assert sum(both["train"].values()) == 2
    run = cli("manifest", "--dataset-dir", root, "-o", tmp_path / "m.json", "--config", "20231101.fr")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[1] == "  config 20231101.fr: the files its README.md's data_files name, in its splits"
    passed = "passed over 20231101.en/train-00000-of-00001.jsonl: not in the data_files of config 20231101.fr"
    assert any(line.startswith(passed) for line in lines)
    assert json.loads((tmp_path / "m.json").read_text())["config"] == "20231101.fr"
    wrong = cli("manifest", "--dataset-dir", root, "-o", tmp_path / "m.json", "--config", "20231101.de")
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (
        f"tokpipe manifest: error: --config 20231101.de: {root}'s README.md lists configs 20231101.en, 20231101.fr;"
        " name one of them"
    )


def test_a_config_with_a_data_dir_alone_splits_its_files_by_their_names(tmp_path):
    root = tmp_path / "repo"
    _write(root / "v2" / "train.jsonl", ["new train"])
    _write(root / "v2" / "test.jsonl", ["new test"])
    _write(root / "v1" / "train.jsonl", ["old train"])
    _card(root, "- config_name: v2\n  data_dir: v2\n  default: true\n- config_name: v1\n  data_dir: v1\n")
    assert (
        _tokpipe(root)
        == _datasets(root, tmp_path, None)
        == {
            "train": Counter(["new train"]),
            "test": Counter(["new test"]),
        }
    )


# Repos with no configs in their card: which files datasets reads, and into which split, by the first rule any file
# fits (the hub's data/{split}-NNNNN-of-NNNNN.* files alone; else a split named in folders; in file names; all train).
WITHOUT_CONFIGS = {
    "split folders": {"train/part-0.jsonl": ["a"], "validation/part-0.jsonl": ["b"]},
    "split folders and a file beside them": {"train/a.jsonl": ["a"], "test/b.jsonl": ["b"], "raw/a.jsonl": ["a", "b"]},
    "a split folder outranks split file names": {"train/a.jsonl": ["a"], "c4-validation.0.json": ["b"]},
    "split file names and one that names none": {"x-train.jsonl": ["a"], "x-test.jsonl": ["b"], "notes.jsonl": ["c"]},
    "the hub's sharded files beside others": {
        "data/train-00000-of-00001.jsonl": ["a"],
        "data/test-00000-of-00001.jsonl": ["b"],
        "raw/train.jsonl": ["a"],
        "extra/more.jsonl": ["c"],
    },
    "nothing named": {"cc/en/part-0001.jsonl": ["a"], "cc/fr/part-0001.jsonl": ["b"]},
}


@pytest.mark.parametrize("layout", WITHOUT_CONFIGS)
def test_without_configs_the_files_and_splits_are_those_datasets_infers(tmp_path, layout):
    root = tmp_path / "repo"
    for relpath, texts in WITHOUT_CONFIGS[layout].items():
        _write(root / relpath, texts)
    (root / "README.md").write_text("# no YAML header\n")
    assert _tokpipe(root) == _datasets(root, tmp_path, None)


def test_files_of_two_formats_are_read_in_the_one_most_are_as_datasets_reads_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "repo"
    for n in range(2):
        (root / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": [f"parquet {n}"]}), root / "data" / f"part-{n}.parquet")
    _write(root / "raw" / "all.jsonl", ["parquet 0", "parquet 1"])  # the same documents, as JSON Lines
    assert _tokpipe(root) == _datasets(root, tmp_path, None) == {"train": Counter(["parquet 0", "parquet 1"])}
    why = "not Parquet, the format of most of its split's files: Hugging Face datasets reads those alone"
    assert build_manifest(root).files_passed_over == (("raw/all.jsonl", why),)
    _write(root / "test" / "a.jsonl", ["test"])
    (root / "train").mkdir()
    (root / "data").rename(root / "train" / "data")
    with pytest.raises(UserError, match=r"^the splits' files are of different formats \(test JSON, train Parquet\)"):
        build_manifest(root)


def test_a_sharded_file_of_a_split_tokpipe_does_not_write_is_refused(tmp_path):
    root = tmp_path / "repo"
    _write(root / "data" / "train-00000-of-00001.jsonl", ["a"])
    _write(root / "data" / "dev-00000-of-00001.jsonl", ["b"])
    assert set(_datasets(root, tmp_path, None)) == {"train", "dev"}  # a split of its own, not validation
    with pytest.raises(UserError) as refused:
        build_manifest(root)
    assert str(refused.value) == (
        "data/dev-00000-of-00001.jsonl is of a split named 'dev', which Hugging Face datasets reads as a split of that"
        " name; tokpipe writes train, validation and test: name its files one of those in a card's configs"
    )


def test_a_file_datasets_would_not_read_is_named_with_why(tmp_path):
    root = tmp_path / "repo"
    for relpath, texts in WITHOUT_CONFIGS["split folders and a file beside them"].items():
        _write(root / relpath, texts)
    why = "names no split in a folder's name, where other files do: Hugging Face datasets reads none of it"
    assert build_manifest(root).files_passed_over == (("raw/a.jsonl", why),)


def test_ndjson_a_json_of_long_lines_and_metadata_files_are_read_as_datasets_reads_them(tmp_path):
    root = tmp_path / "repo"
    _write(root / "data" / "train-0.ndjson", ["ndjson text"])
    long = "x" * (3 << 20)  # a first line past the 1 MiB read at a time
    _write(root / "data" / "train-1.json", [long, "after it"])
    (root / "dataset_infos.json").write_text('{"default": {"description": ""}}\n')  # one line, a JSON object
    assert _tokpipe(root) == _datasets(root, tmp_path, None) == {"train": Counter(["ndjson text", long, "after it"])}
    manifest = build_manifest(root)
    assert manifest.files_passed_over == (("dataset_infos.json", "Hugging Face datasets' metadata, never data"),)


HIDDEN_FILES = [
    "data/a.jsonl",
    "data/.x.jsonl",
    "data/__y.jsonl",
    "__cache/b.jsonl",
    "data/__sub/c.jsonl",
    "data/_z.jsonl",
]


@pytest.mark.parametrize(
    "glob, read",
    [
        (None, ["data/__y.jsonl", "data/_z.jsonl", "data/a.jsonl"]),  # no card: datasets' own patterns
        ("data/*", ["data/__y.jsonl", "data/_z.jsonl", "data/a.jsonl"]),  # `__` passes over folders, not files
        ("**", ["data/__y.jsonl", "data/_z.jsonl", "data/a.jsonl"]),
        ("__cache/*", ["__cache/b.jsonl"]),  # named by the glob; a hidden file in it still is not
        (".hidden/*", [".hidden/d.jsonl"]),  # a hidden folder is walked where a glob names one
    ],
)
def test_hidden_files_and_special_folders_are_passed_over_as_datasets_passes_them(tmp_path, glob, read):
    root = tmp_path / "repo"
    for relpath in HIDDEN_FILES + ["__cache/.h.jsonl", ".hidden/d.jsonl", ".hidden/.e.jsonl"]:
        _write(root / relpath, [relpath])
    if glob is not None:
        _card(root, f"- config_name: default\n  data_files: {json.dumps(glob)}\n")
    assert _tokpipe(root) == _datasets(root, tmp_path, None) == {"train": Counter(read)}
    if glob is None:
        why = "hidden (a name in its path begins with `.`), or in a folder named `__*`: Hugging Face datasets reads"
        why += " neither"
        passed_over = ["__cache/.h.jsonl", "__cache/b.jsonl", "data/.x.jsonl", "data/__sub/c.jsonl"]
        assert build_manifest(root).files_passed_over == tuple((relpath, why) for relpath in passed_over)


def test_json_lines_in_each_compression_datasets_reads_are_read_as_it_reads_them(tmp_path):
    root = tmp_path / "repo"
    for compression, suffix in (("gzip", "jsonl.gz"), ("bz2", "jsonl.bz2"), ("xz", "jsonl.xz"), ("xz", "json.xz")):
        write_jsonl(
            root / "data" / f"{suffix.replace('.', '-')}.{suffix}",
            [json.dumps({"text": f"{suffix} {i}"}) for i in range(3)],
            compression,
        )
    write_jsonl(root / "data" / "zstd.jsonl.zst", ['{"text": "zstd"}'], "zstd")
    expected = Counter(
        ["zstd", *(f"{suffix} {i}" for suffix in ("jsonl.gz", "jsonl.bz2", "jsonl.xz", "json.xz") for i in range(3))]
    )
    assert _tokpipe(root) == _datasets(root, tmp_path, None) == {"train": expected}
    assert build_manifest(root).files_passed_over == ()


def test_a_zip_archive_is_named_never_left_out_without_a_word(tmp_path):
    # Of a split of archives alone, datasets reads the files inside; tokpipe reads none, and says so.
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    with zipfile.ZipFile(root / "data" / "more.zip", "w") as archive:
        archive.writestr("inside.jsonl", json.dumps({"text": "inside it"}) + "\n")
    assert _datasets(root, tmp_path / "zip", None) == {"train": Counter(["inside it"])}
    why = "an archive, whose files Hugging Face datasets reads: tokpipe reads none; extract it to tokenize them"
    with pytest.raises(UserError, match=f"; passed over data/more.zip: {why};"):
        build_manifest(root)
    # Beside files of a format, datasets reads those and the archive's.
    _write(root / "data" / "more.jsonl", ["beside it"])
    assert _datasets(root, tmp_path / "both", None) == {"train": Counter(["beside it", "inside it"])}
    assert _tokpipe(root) == {"train": Counter(["beside it"])}
    assert build_manifest(root).files_passed_over == (("data/more.zip", why),)


def test_no_shards_is_refused_naming_each_file_passed_over(tmp_path):
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    (root / "data" / "train.csv").write_text("text\na\n")
    (root / "data" / "train-all.json").write_text('{\n  "text": "a"\n}\n')  # one JSON document
    (root / "data" / "train.txt.gz").write_bytes(b"")
    (root / "data" / "train-0.tar").write_bytes(b"")
    with pytest.raises(UserError) as refused:
        build_manifest(root)
    said = str(refused.value)
    assert "; passed over data/train-all.json: neither JSON Lines nor a JSON array (its first line is no JSON" in said
    for name in ("train.csv", "train.txt.gz", "train-0.tar"):  # HF datasets would read the JSON file alone (a draw)
        assert f"; passed over data/{name}: not JSON, the format of most of its split's files" in said


def test_a_config_that_reads_a_list_inside_each_json_object_is_refused_in_one_line(tmp_path):
    """SQuAD's layout: each file one JSON object, its documents the list under `data`, which the card's `field` names
    to the json builder. load_dataset reads it; tokpipe says what to do (before, it took the file for JSON Lines of one
    line without a text field, and a run refused the split much later)."""
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    (root / "data" / "train.json").write_text(json.dumps({"version": 2, "data": [{"text": "a"}, {"text": "b"}]}))
    _card(root, "- config_name: default\n  data_files: data/*.json\n  field: data\n")
    assert _load(root, cache_dir=tmp_path / "hf")["train"]["text"] == ["a", "b"]
    with pytest.raises(UserError) as refused:
        build_manifest(root)
    assert str(refused.value) == (
        "config default reads each JSON file's documents from its 'data' list (field: in its README.md): tokpipe reads"
        " JSON Lines and JSON arrays, not a list inside an object: write the items as JSON Lines"
        " (jq -c '.data[]' FILE > FILE.jsonl) and read those"
    )


def test_on_a_store_hidden_folders_and_files_are_read_as_on_disk(tmp_path, s3_server, s3_prefix):
    root = tmp_path / "repo"
    for relpath in HIDDEN_FILES + [".hidden/d.jsonl", ".hidden/.e.jsonl"]:
        _write(root / relpath, [relpath])
    for glob in (None, ".hidden/*", "**"):
        if glob is not None:
            _card(root, f"- config_name: default\n  data_files: {json.dumps(glob)}\n")
        prefix = f"{s3_prefix}/{glob and glob.replace('*', 'x')}"
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            s3_server.put(f"{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
        on_disk, on_store = build_manifest(root), tokpipe.build_manifest(s3_server.url(prefix))
        assert [s.relpath for s in on_store.shards()] == [s.relpath for s in on_disk.shards()], glob
        assert on_store.files_passed_over == on_disk.files_passed_over, glob


def test_a_snapshot_on_a_store_is_read_by_the_same_card(tmp_path, s3_server, s3_prefix):
    root = tmp_path / "c4"
    _write(root / "en" / "c4-train.00000-of-00001.json", ["a page"])
    _write(root / "en.noblocklist" / "c4-train.00000-of-00001.json", ["a page", "blocked page"])
    _card(root, "- config_name: en\n  data_files: en/*.json\n- config_name: en.noblocklist\n  data_files: en.no*/*\n")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3_server.put(f"{s3_prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
    url = s3_server.url(s3_prefix)
    on_store = tokpipe.build_manifest(url, configs=("en.noblocklist",))  # the API's: a URL's objects listed
    shard = "en.noblocklist/c4-train.00000-of-00001.json"
    assert [(s.split, s.relpath) for s in on_store.shards()] == [("train", shard)]
    assert on_store.config == "en.noblocklist"
    with pytest.raises(UserError, match=r"lists configs en, en.noblocklist and none is the default"):
        tokpipe.build_manifest(url)


# Folder and file names of real repos, combined at random (seeded): whatever the layout, tokpipe reads what datasets
# reads, or refuses in one line (a split named in other letter case, a path that names two).
FOLDERS = ["", "data/", "train/", "test/", "validation/", "raw/", "en/", "data/train/", "data/dev/", "sample/10BT/"]
FOLDERS += ["eval/", "Validation/", "train-v2/", "my_test/", "data/train_x/", ".hidden/", "__pycache__/", "data/__x/"]
FILES = ["part-0.jsonl", "train.jsonl", "test.jsonl", "c4-validation.00000.json", "x-train-1.jsonl", "notes.jsonl"]
FILES += ["train-00000-of-00001.jsonl", "test-00000-of-00001.jsonl", "validation-00000-of-00002.jsonl", "dev.jsonl"]
FILES += ["a.ndjson", "training_data.jsonl", ".x.jsonl", "__y.jsonl", "part-1.jsonl.gz", "part-2.jsonl.bz2"]
FILES += ["part-3.jsonl.xz", "part-4.jsonl.zst", "p.parquet"]
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}


@pytest.mark.parametrize("seed", range(40))
def test_a_random_layout_is_read_as_datasets_reads_it_or_refused(tmp_path, seed):
    rnd = random.Random(seed)
    root = tmp_path / "repo"
    for relpath in {rnd.choice(FOLDERS) + rnd.choice(FILES) for _ in range(rnd.randint(1, 5))}:
        texts = [f"{relpath}#{n}" for n in range(2)]
        if relpath.endswith(".parquet"):
            (root / relpath).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"text": texts}), root / relpath)
        else:
            compression = COMPRESSIONS.get(Path(relpath).suffix, "none")
            write_jsonl(root / relpath, [json.dumps({"text": t}) for t in texts], compression)
    try:
        found = _tokpipe(root)
    except UserError:
        return  # one line, which the tests above check
    assert found == _datasets(root, tmp_path, None)


def test_a_card_load_dataset_refuses_is_refused_in_one_line_saying_why(tmp_path):
    root = tmp_path / "repo"
    _write(root / "data" / "a.jsonl", ["a"])
    refusals = {
        "- config_name: one\n  default: true\n  data_files: data/*\n- config_name: two\n  default: true\n"
        "  data_files: data/*\n": f"{root}'s README.md marks several configs the default (one, two): fix the card",
        "- config_name: default\n  data_files:\n  - split: train\n    path: data/*\n"
        "  - split: test\n    path: held/*\n": (
            "config default's test data_files (held/*) name no file of data (README.md): load_dataset"
            " refuses such a config too; fix the card, or pick another with --config NAME"
        ),
        "- config_name: default\n  data_files:\n  - data/*\n  - data/a.*\n": (
            "data/a.jsonl is named by two of config default's data_files (data/*, data/a.*), and Hugging Face datasets"
            " would read it twice (README.md): fix the card's data_files"
        ),
        # fsspec's glob, as datasets resolves it: `**` only as a whole path component
        "- config_name: default\n  data_files: data/**.jsonl\n": (
            "data_files glob 'data/**.jsonl' (README.md) is not a glob (Invalid pattern: '**' can only be an entire"
            " path component): fix the card"
        ),
        # Splits as a mapping: `datasets.load_dataset(data_files=...)` takes one, a card's YAML not.
        "- config_name: default\n  data_files:\n    train: data/*\n": (
            "config default's data_files is neither a glob nor a list (README.md), and load_dataset refuses it: write"
            " its splits as a list of `- split: NAME` / `path: GLOB`"
        ),
        # The first of a split's two entries was left out without a word.
        "- config_name: default\n  data_files:\n  - split: train\n    path: data/a*\n  - split: train\n"
        "    path: data/*\n": (
            "config default's data_files names split train twice (README.md), and load_dataset refuses it: give it"
            " one entry, its path a list of globs"
        ),
        "- config_name: default\n  data_files:\n  - split: train\n    path: data/*\n  - held/*\n": (
            "config default's data_files item 'held/*' is not a split and its path (README.md), and load_dataset"
            " refuses it: in a list of splits' paths, each item is `- split: NAME` / `path: GLOB`, nothing else"
        ),
        "- config_name: default\n  data_files:\n  - split: train\n    path: data/*\n    field: x\n": (
            "config default's data_files item {'split': 'train', 'path': 'data/*', 'field': 'x'} is not a split and"
            " its path (README.md), and load_dataset refuses it: in a list of splits' paths, each item is `- split:"
            " NAME` / `path: GLOB`, nothing else"
        ),
    }
    for n, (configs, said) in enumerate(refusals.items()):
        _card(root, configs)
        with pytest.raises(UserError) as refused:
            build_manifest(root)
        assert str(refused.value) == said
        if n != 2:  # datasets refuses these cards; the third it reads, the file's documents twice
            with pytest.raises(ValueError):
                _load(root, cache_dir=tmp_path / f"hf-cache-{n}")
        else:
            assert _datasets(root, tmp_path, None) == {"train": Counter({"a": 2})}
