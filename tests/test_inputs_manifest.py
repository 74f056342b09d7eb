"""manifest: any accepted dataset-dir layout -> the same ordered shard list; splits named as Hugging Face datasets
names them, and printed per split; each folder walked once, symlinks or not, a run's OUT never taken for input;
wrong folders, paths and files get a message."""

import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    assert_out_is,
    cli,
    plain_copy_of_example,
    reference_tokenizer,
    reference_tokens,
    run_args,
    tokpipe,
    write_jsonl,
)

import tokpipe as api
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest, load_manifest, write_manifest
from tokpipe.inputs.names import splits_of
from tokpipe.store import Url

REPO_DIR = EXAMPLE_CACHE / "datasets--tokpipe-realdata--slimpajama-mini"
REVISION = (REPO_DIR / "refs" / "main").read_text().strip()


def test_cache_root_repo_folder_and_snapshot_give_the_same_shards():
    manifests = [build_manifest(d) for d in (EXAMPLE_CACHE, REPO_DIR, REPO_DIR / "snapshots" / REVISION)]
    assert {m.fingerprint for m in manifests} == {manifests[0].fingerprint}
    m = manifests[0]
    assert m.repo_id == "tokpipe-realdata/slimpajama-mini" and m.revision == REVISION
    assert [(s.split, s.relpath) for s in m.shards()] == [
        ("train", "train/chunk1/example_train_0.jsonl.zst"),
        ("train", "train/chunk1/example_train_1.jsonl.zst"),
        ("validation", "validation/chunk1/example_holdout_0.jsonl.zst"),
    ]
    # The bytes read are the blobs the snapshot links to.
    assert all(os.path.dirname(s.path) == str((REPO_DIR / "blobs").resolve()) for s in m.shards())
    assert all(s.size == os.path.getsize(s.path) for s in m.shards())


def test_a_hub_name_is_read_from_the_hugging_face_cache_and_a_folder_of_that_name_wins(tmp_path, monkeypatch):
    """`--dataset-dir ORG/NAME`, as load_dataset(ORG/NAME) reads it offline and as --tokenizer takes one: the repo in
    huggingface_hub's cache (HF_HUB_CACHE, or HF_HOME's hub/)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(EXAMPLE_CACHE))
    monkeypatch.chdir(tmp_path)
    by_name = build_manifest("tokpipe-realdata/slimpajama-mini")
    assert (by_name.repo_id, by_name.revision) == ("tokpipe-realdata/slimpajama-mini", REVISION)
    assert by_name.fingerprint == build_manifest(EXAMPLE_CACHE).fingerprint
    with pytest.raises(UserError) as missing:
        build_manifest("tokpipe-realdata/other")
    assert str(missing.value) == (
        f"no folder tokpipe-realdata/other here, and no dataset tokpipe-realdata/other in the Hugging Face cache"
        f" {EXAMPLE_CACHE} (set by HF_HUB_CACHE or HF_HOME): fetch it (huggingface-cli download"
        " tokpipe-realdata/other --repo-type dataset), or pass its folder"
    )
    write_jsonl(tmp_path / "tokpipe-realdata" / "slimpajama-mini" / "train.jsonl", ['{"text": "a folder here"}'])
    local = build_manifest("tokpipe-realdata/slimpajama-mini")
    assert (local.repo_id, [s.relpath for s in local.shards()]) == (None, ["train.jsonl"])


def test_a_shard_s_key_is_a_file_name_however_deep_or_wide_its_path(tmp_path, small_tokenizer):
    # A shard's files in OUT are named by its key: a path of 255 bytes or more (deep Hive-style folders, 85 CJK
    # characters) failed every run with ENAMETOOLONG. Its key is now its end after 16 hex digits of the path's sha256.
    deep = "/".join(["lang=en", "dump=CC-MAIN-2023-50", "q" * 120, "r" * 90])
    wide = f"{'語' * 80}/{'文' * 20}"  # 300 bytes of UTF-8
    relpaths = [f"train/{deep}/part-0.jsonl", f"train/{deep}/part-1.jsonl", f"train/{wide}.jsonl", "train/s.jsonl"]
    for n, relpath in enumerate(relpaths):
        write_jsonl(tmp_path / "data" / relpath, [json.dumps({"text": f"document {n} of {relpath[-12:]}"})])
    manifest = build_manifest(tmp_path / "data")
    keys = {shard.relpath: shard.key for shard in manifest.shards()}
    assert keys["train/s.jsonl"] == "train__s" and len(set(keys.values())) == 4
    assert [len(keys[r].encode()) for r in relpaths[:3]] == [200, 200, 199]  # 199: a character is not cut in two
    assert keys[relpaths[0]].endswith("r" * 90 + "__part-0")
    assert keys[relpaths[2]].endswith("-" + "語" * 40 + "__" + "文" * 20)
    write_manifest(manifest, tmp_path / "m.json")
    run = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out", "--shard-buffer", "0", tokenizer=small_tokenizer))
    assert run.returncode == 0, run.stdout + run.stderr
    tokenizer = small_tokenizer / "tokenizer.json"
    files = [tmp_path / "data" / shard.relpath for shard in manifest.shards()]
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    assert_out_is(tmp_path / "out", {"train": reference_tokens(files, tokenizer, eos, np.uint16)})


@pytest.mark.parametrize(
    "relpath, split",
    [
        ("train/chunk1/a.jsonl.zst", "train"),
        ("validation/chunk1/a.jsonl.zst", "validation"),
        ("data/valid/a.jsonl", "validation"),
        ("test/x.jsonl.gz", "test"),
        ("data/train-00000-of-00002.jsonl.zst", "train"),
        ("data/validation-00000-of-00001.jsonl.zst", "validation"),
        ("data/test-00000-of-00001.jsonl", "test"),
        ("cc/en/part-0001.jsonl.zst", "train"),
        ("trainer_notes/a.jsonl", "train"),
        # The hub's Parquet names: its conversion of every dataset, and FineWeb's (all train).
        ("data/train-00000-of-00003.parquet", "train"),
        ("data/validation-00000-of-00001.parquet", "validation"),
        ("data/test-00000-of-00001.parquet", "test"),
        ("default/validation/0000.parquet", "validation"),
        ("data/CC-MAIN-2024-10/000_00000.parquet", "train"),
    ],
)
def test_split_comes_from_the_path_as_hf_datasets_name_it(relpath, split):
    assert splits_of([relpath]) == ({relpath: split}, {})  # a repo of one file


def test_a_split_is_named_anywhere_in_a_folder_or_file_name_by_hugging_face_datasets_keywords():
    """HF datasets' rule (src/datasets/data_files.py): its keywords and aliases, delimited by the name's ends or by
    `-`, `_`, `.`, a space or a digit; a folder's split outranks the file name's. Each case below was checked
    against datasets 5.2.0's own resolution of a one-file repository."""
    cases = {
        "en/c4-validation.00000-of-00008.json.gz": "validation",  # allenai/c4
        "en/c4-train.00000-of-01024.json.gz": "train",
        "wiki_test_0.jsonl": "test",
        "x.test.jsonl": "test",
        "validation1.jsonl": "validation",  # a digit delimits
        "data/training/x.jsonl": "train",
        "data/my-dev/x.jsonl": "validation",
        "data/dev2/x.jsonl": "validation",
        "a/eval_3.jsonl": "test",
        "my test/a.jsonl": "test",
        "test_evaluation.jsonl": "test",  # two keywords of one split
        "train/wiki_test_0.jsonl": "train",  # the folder outranks the file name
        "trainer_notes/a.jsonl": "train",  # not delimited: no keyword, so train
        "contest/a.jsonl": "train",
        "interval_3.jsonl": "train",
        "developer.jsonl": "train",
    }
    assert {relpath: splits_of([relpath])[0][relpath] for relpath in cases} == cases


def test_a_split_named_in_other_letter_case_is_refused_in_one_line():
    with pytest.raises(UserError) as refused:
        splits_of(["train/a.jsonl", "Validation/b.jsonl"])
    assert str(refused.value) == (
        "Validation/b.jsonl names the validation split in other letter case, which Hugging Face datasets does not take"
        " for a split (it would train on it, or leave it out): rename it in lower case, or name it in a card's configs"
    )


def test_a_path_that_names_two_splits_is_refused_in_one_line(tmp_path):
    for relpath in ("train_test_0.jsonl", "train/dev/x.jsonl"):
        data = tmp_path / relpath.replace("/", "_")
        write_jsonl(data / relpath, ['{"text": "x"}'])
        result = cli("manifest", "--dataset-dir", data, "-o", tmp_path / "m.json")
        assert (result.returncode, result.stdout) == (2, "")
        words = "test and train" if relpath == "train_test_0.jsonl" else "train and validation"
        assert result.stderr == (
            f"tokpipe manifest: error: {relpath} names more than one split ({words}), and Hugging Face datasets would "
            "read it into each: give it a path that names one (a folder of symlinks to the shards, with "
            "--allow-outside)\n"
        )
    assert not (tmp_path / "m.json").exists()


def test_the_manifest_command_prints_a_few_files_of_each_split(tmp_path):
    # C4's layout: its validation files were read into train before the split came from anywhere in the name.
    names = [f"en/c4-train.{i:05d}-of-01024.json.gz" for i in range(6)]
    names += [f"en/c4-validation.{i:05d}-of-00008.json.gz" for i in range(2)] + ["en/wiki_test_0.jsonl"]
    for name in names:
        write_jsonl(tmp_path / "c4" / name, ['{"text": "x"}'])
    result = cli("manifest", "--dataset-dir", tmp_path / "c4", "-o", tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "  train: 6 shards, 0.0 MiB: en/c4-train.00000-of-01024.json.gz, en/c4-train.00001-of-01024.json.gz, "
        "... (3 more) ..., en/c4-train.00005-of-01024.json.gz",
        "  validation: 2 shards, 0.0 MiB: en/c4-validation.00000-of-00008.json.gz, "
        "en/c4-validation.00001-of-00008.json.gz",
        "  test: 1 shard, 0.0 MiB: en/wiki_test_0.jsonl",
    ]
    assert load_manifest(tmp_path / "m.json").counts == {"test": 1, "train": 6, "validation": 2}


def test_parquet_shards_in_every_layout(tmp_path):
    cache = EXAMPLE_CACHE.parent / "hf-cache-parquet"
    repo = cache / "datasets--tokpipe-realdata--slimpajama-mini-parquet"
    snapshot = next(repo.glob("snapshots/*"))
    plain = tmp_path / "plain"
    shutil.copytree(snapshot, plain, symlinks=False)
    manifests = [build_manifest(d) for d in (cache, repo, snapshot, plain)]
    assert {m.fingerprint for m in manifests} == {manifests[0].fingerprint}
    assert manifests[0].repo_id == "tokpipe-realdata/slimpajama-mini-parquet"
    assert [(s.split, s.relpath, s.key) for s in manifests[0].shards()] == [
        ("train", "data/train-00000-of-00002.parquet", "data__train-00000-of-00002"),
        ("train", "data/train-00001-of-00002.parquet", "data__train-00001-of-00002"),
        ("validation", "data/validation-00000-of-00001.parquet", "data__validation-00000-of-00001"),
    ]
    assert all(os.path.dirname(s.path) == str((repo / "blobs").resolve()) for s in manifests[0].shards())


def test_plain_folder_sorted_by_path_and_unrelated_files_ignored(tmp_path):
    for rel in [
        "train/b.jsonl",
        "train/a/z.jsonl.zst",
        "train/a/y.jsonl.gz",
        "validation/v.jsonl",
        "README.md",
        "train/.hidden/x.jsonl",
    ]:
        write_jsonl(tmp_path / rel, ['{"text": "x"}'])
    m = build_manifest(tmp_path)
    assert m.repo_id is None
    assert [s.relpath for s in m.shards()] == [
        "train/a/y.jsonl.gz",
        "train/a/z.jsonl.zst",
        "train/b.jsonl",
        "validation/v.jsonl",
    ]
    assert [s.key for s in m.shards()] == ["train__a__y", "train__a__z", "train__b", "validation__v"]


def test_symlinks_stored_as_text_files_are_followed_to_their_blob(tmp_path):
    # What a copy that drops symlinks leaves of a cache (the shared data here looks like this).
    cache = tmp_path / "cache"
    shutil.copytree(EXAMPLE_CACHE, cache, symlinks=True)
    for link in (cache / "datasets--tokpipe-realdata--slimpajama-mini" / "snapshots").rglob("*.zst"):
        target = os.readlink(link)
        link.unlink()
        link.write_text(target)
    assert build_manifest(cache).fingerprint == build_manifest(EXAMPLE_CACHE).fingerprint


def test_pointer_to_a_missing_blob_is_a_clear_error(tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(EXAMPLE_CACHE, cache, symlinks=True)
    link = next(
        (cache / "datasets--tokpipe-realdata--slimpajama-mini" / "snapshots").rglob("example_train_0.jsonl.zst")
    )
    (link.parent / os.readlink(link)).resolve().unlink()
    target = os.readlink(link)
    link.unlink()
    link.write_text(target)
    with pytest.raises(UserError, match="missing from"):
        build_manifest(cache)


@pytest.mark.parametrize("dataset_dir", ["cache", "repo folder", "snapshot"])
def test_a_link_to_a_blob_not_there_names_the_repo_damaged_and_how_to_mend_it(tmp_path, dataset_dir):
    # A blob removed by hand, or a copy of snapshots/ without all of blobs/: scan_cache_dir leaves the repo out.
    cache = tmp_path / "cache"
    shutil.copytree(EXAMPLE_CACHE, cache, symlinks=True)
    repo = cache / REPO_DIR.name
    blob = (repo / "snapshots" / REVISION / "train" / "chunk1" / "example_train_1.jsonl.zst").resolve()
    blob.unlink()
    given = {"cache": cache, "repo folder": repo, "snapshot": repo / "snapshots" / REVISION}[dataset_dir]
    with pytest.raises(UserError) as refused:
        build_manifest(given)
    assert str(refused.value) == (
        f"tokpipe-realdata/slimpajama-mini in the cache at {cache} is damaged (Blob missing (broken symlink): {blob}):"
        " a download cut short or a blob removed; download it again (huggingface-cli download"
        " tokpipe-realdata/slimpajama-mini --repo-type dataset), then run the manifest"
    )
    # Beside a whole repo, it is still one of the cache's datasets: never the other read in its place.
    shutil.copytree(EXAMPLE_CACHE / REPO_DIR.name, cache / "datasets--other--set", symlinks=True)
    with pytest.raises(UserError, match="several datasets .*other/set, tokpipe-realdata/slimpajama-mini"):
        build_manifest(cache)


def test_a_download_not_finished_is_refused_never_left_out(tmp_path):
    # huggingface_hub downloads to blobs/<etag>.incomplete and links the snapshot's file to the blob once it is whole
    # (file_download.py); with --local-dir, to .cache/huggingface/download/<folder>/<hash>.<etag>.incomplete
    # (_local_folder.py). Until then the file is not in the dataset, and the manifest would have one shard less.
    cache = tmp_path / "cache"
    shutil.copytree(EXAMPLE_CACHE, cache, symlinks=True)
    link = cache / REPO_DIR.name / "snapshots" / REVISION / "train" / "chunk1" / "example_train_1.jsonl.zst"
    blob = link.resolve()
    link.unlink()
    blob.rename(f"{blob}.incomplete")
    with pytest.raises(UserError) as refused:
        build_manifest(cache)
    assert str(refused.value) == (
        f"{blob.parent} holds 1 download(s) not finished (blobs/{blob.name}.incomplete, 0.5 MB so far): their files"
        " are not in the dataset yet. Let the download end, or run it again (huggingface-cli download"
        " tokpipe-realdata/slimpajama-mini --repo-type dataset), then run the manifest; a download given up for good:"
        " remove its .incomplete file"
    )
    local = plain_copy_of_example(tmp_path / "local")
    downloading = local / ".cache" / "huggingface" / "download" / "train" / "chunk1"
    downloading.mkdir(parents=True)
    (downloading / "Yx3b.1926265470074e43.incomplete").write_bytes(b"\0" * 1500)
    with pytest.raises(UserError, match=r"holds 1 download\(s\) not finished \(download/train/chunk1/Yx3b\."):
        build_manifest(local)
    (downloading / "Yx3b.1926265470074e43.incomplete").unlink()  # given up
    assert build_manifest(local).counts == {"train": 2, "validation": 1}


def test_a_manifest_that_is_a_folder_or_no_manifest_at_all_is_one_line(tmp_path):
    # A dataset folder passed as --manifest, and a JSONL shard, whose parse error ijson gives over four lines.
    (tmp_path / "shard.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    for given, said in (
        (EXAMPLE_CACHE, f"tokpipe manifest --dataset-dir {EXAMPLE_CACHE} -o M.json` writes of a dataset folder"),
        (tmp_path / "shard.jsonl", "(IncompleteJSONError: parse error: trailing garbage): rebuild it with"),
    ):
        refused = cli(*run_args(given, tmp_path / "out"))
        assert refused.returncode == 2 and said in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr


def test_several_datasets_need_a_repo_id(tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(EXAMPLE_CACHE, cache, symlinks=True)
    shutil.copytree(
        cache / "datasets--tokpipe-realdata--slimpajama-mini", cache / "datasets--other--set", symlinks=True
    )
    with pytest.raises(UserError, match="several datasets.*--repo-id"):
        build_manifest(cache)
    assert build_manifest(cache, repo_id="other/set").repo_id == "other/set"
    with pytest.raises(UserError, match="no dataset 'nope/nope'"):
        build_manifest(cache, repo_id="nope/nope")


@pytest.mark.parametrize("where", ["a folder", "a store"])
def test_a_folder_above_a_cache_is_refused_naming_the_cache(tmp_path, where, request):
    # HF_HOME (~/.cache/huggingface: the cache is its hub/), and a folder above it. Walked as a folder of shards, it
    # gave one dataset of every repo's snapshots (and of a copy whose links became text files, their text as shards).
    home = tmp_path / "huggingface"
    shutil.copytree(EXAMPLE_CACHE, home / "hub", symlinks=True)
    shutil.copytree(home / "hub" / REPO_DIR.name, home / "hub" / "datasets--other--set", symlinks=True)
    top, slash = str(tmp_path), ""  # a prefix is named as a folder: with its slash
    if where == "a store":
        s3_server, prefix = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_prefix")
        top, slash = s3_server.upload(tmp_path, prefix), "/"
    cache = f"{top}/huggingface/hub"
    for folder in (f"{top}/huggingface", top):
        with pytest.raises(UserError) as refused:
            api.build_manifest(folder)
        assert str(refused.value) == (
            f"{folder}{slash} holds a Hugging Face cache at {cache}: pass --dataset-dir {cache} (with --repo-id"
            " ORG/NAME where it holds several datasets)"
        )
    # As it says: the cache, and which of its datasets.
    assert api.build_manifest(cache, repo_id="other/set").counts == {"train": 2, "validation": 1}


# What stands where a shard's bytes should, which every run of it failed ("not JSON Lines"): a clone without git-lfs
# (each shard a ~130-byte pointer), and a snapshot copied out of a cache whose links are files (shared/data's).
POINTERS = {
    "a Git LFS pointer": (
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "4d" * 32 + "\nsize 1494179\n",
        "is a Git LFS pointer, not its data (a clone without git-lfs): fetch the data (`git lfs pull`, or `hf download"
        " ORG/NAME --repo-type dataset`), then run the manifest",
    ),
    "a cache's link as a file": (
        "../../../../blobs/" + "ac" * 32,
        f"is a Hugging Face cache's link written as a file (../../../../blobs/{'ac' * 32}), not its data: give"
        " --dataset-dir the cache it was copied from, whose blobs/ holds the data",
    ),
}


@pytest.mark.parametrize("pointer", POINTERS)
@pytest.mark.parametrize("where", ["a folder", "a store"])
def test_a_pointer_where_a_shard_should_be_is_refused(tmp_path, where, pointer, request):
    data = plain_copy_of_example(tmp_path / "data")
    (data / "train" / "chunk1" / "example_train_1.jsonl.zst").write_text(POINTERS[pointer][0])
    (data / "train" / "chunk1" / "a_tiny.jsonl").write_text('{"text": "small, read first, no pointer"}\n')
    folder = str(data)
    if where == "a store":
        s3_server, prefix = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_prefix")
        folder = s3_server.upload(data, prefix)
    with pytest.raises(UserError) as refused:
        api.build_manifest(folder)
    assert str(refused.value) == f"train/chunk1/example_train_1.jsonl.zst {POINTERS[pointer][1]}"


def test_manifest_round_trips_and_hand_edits_are_caught(tmp_path):
    m = build_manifest(EXAMPLE_CACHE)
    write_manifest(m, tmp_path / "m.json")
    loaded = load_manifest(tmp_path / "m.json")
    assert loaded.source == tmp_path / "m.json"  # a loaded manifest holds no shards: each pass streams them
    assert replace(loaded, source=m.source) == m and list(loaded.shards()) == list(m.shards())
    assert [s.relpath for s in loaded.shards("validation")] == ["validation/chunk1/example_holdout_0.jsonl.zst"]
    data = json.loads((tmp_path / "m.json").read_text())
    (tmp_path / "indented.json").write_text(json.dumps(data, indent=1))  # how earlier versions wrote it
    assert list(load_manifest(tmp_path / "indented.json").shards()) == list(m.shards())
    data["shards"].reverse()
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="edited by hand"):
        load_manifest(tmp_path / "m.json")


@pytest.mark.parametrize("make", ["missing", "empty", "wrong_files"])
def test_cli_wrong_dataset_dir_says_what_it_found_and_expected(tmp_path, make):
    target = tmp_path / "data"
    if make != "missing":
        target.mkdir()
    if make == "wrong_files":
        (target / "notes.txt").write_text("hi")
        (target / "data.csv").write_text("text\nhi\n")
    result = cli("manifest", "--dataset-dir", target, "-o", tmp_path / "m.json")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "expected a Hugging Face cache root" in message
    if make == "wrong_files":
        assert "data.csv" in message and "notes.txt" in message


def test_cli_writes_the_manifest_and_reports_it(tmp_path):
    result = cli("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"tokpipe-realdata/slimpajama-mini@{REVISION[:12]}: 3 shards (train 2, validation 1), 1.1 MiB -> "
        f"{tmp_path / 'm.json'}\n"
        "  train: 2 shards, 0.8 MiB: train/chunk1/example_train_0.jsonl.zst, train/chunk1/example_train_1.jsonl.zst\n"
        "  validation: 1 shard, 0.3 MiB: validation/chunk1/example_holdout_0.jsonl.zst\n"
    )
    assert load_manifest(tmp_path / "m.json").repo_id == "tokpipe-realdata/slimpajama-mini"


def test_shards_that_resolve_outside_the_dataset_are_refused_unless_allowed(tmp_path):
    outside = write_jsonl(tmp_path / "elsewhere" / "secret.jsonl", ['{"text": "x"}'])
    data = tmp_path / "data"
    write_jsonl(data / "train" / "a.jsonl", ['{"text": "y"}'])
    # A link outside to nothing is said to be a link to nothing: --allow-outside would not help.
    (data / "train" / "b.jsonl").symlink_to(tmp_path / "elsewhere" / "gone.jsonl")
    with pytest.raises(UserError, match=r"^train/b.jsonl is a link to .*/gone.jsonl, which does not exist: re"):
        build_manifest(data)
    (data / "train" / "b.jsonl").unlink()
    (data / "train" / "b.jsonl").symlink_to(outside)
    with pytest.raises(UserError, match="outside the dataset folder.*--allow-outside"):
        build_manifest(data)
    m = build_manifest(data, allow_outside=True)
    assert [s.path for s in m.shards()][1] == str(outside)

    # A manifest edited to point elsewhere is refused when loaded, too.
    (data / "train" / "b.jsonl").unlink()
    write_manifest(build_manifest(data), tmp_path / "m.json")
    edited = json.loads((tmp_path / "m.json").read_text())
    for path in (str(outside), f"{data}/../elsewhere/secret.jsonl"):
        edited["shards"][0]["path"] = path
        (tmp_path / "m.json").write_text(json.dumps(edited))
        with pytest.raises(UserError, match="outside the dataset folder"):
            load_manifest(tmp_path / "m.json")


def test_each_folder_is_walked_once_and_the_links_passed_over_are_said(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "texts" / "a.jsonl", ['{"text": "a"}'])
    write_jsonl(data / ".store" / "s.jsonl", ['{"text": "s"}'])  # hidden: walked only through the link below
    (data / "extra").mkdir()
    (data / "extra" / "mirror").symlink_to("../texts")  # a folder listed already
    (data / "loop").symlink_to(".")  # the dataset folder itself: walked through it, no end
    (data / "stored").symlink_to(".store")  # a folder not listed otherwise: walked
    # Files are not deduplicated: in a cache two snapshot files may link to one blob (two identical files).
    (data / "texts" / "b.jsonl").symlink_to("a.jsonl")
    result = cli("manifest", "--dataset-dir", data, "-o", tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "  train: 3 shards, 0.0 MiB: stored/s.jsonl, texts/a.jsonl, texts/b.jsonl",
        "passed over extra/mirror/: a link to texts/, listed already",
        "passed over loop/: a link to the dataset folder, above it (a loop)",
    ]
    shards = list(load_manifest(tmp_path / "m.json").shards())
    assert [s.path for s in shards] == [str(data / ".store" / "s.jsonl"), *[str(data / "texts" / "a.jsonl")] * 2]


def test_a_runs_out_inside_the_dataset_is_passed_over(tmp_path, small_tokenizer):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "a.jsonl", ['{"text": "one small document: a run that needs no Ray"}'])
    write_manifest(build_manifest(data), tmp_path / "m.json")
    run = tokpipe(*run_args(tmp_path / "m.json", data / "out", tokenizer=small_tokenizer))
    assert run.returncode == 0, run.stderr
    assert f"manifest {data}: 1 shard, 0.0 MiB; 0 done, 0 partial, 1 to start" in run.stdout.splitlines()
    assert (data / "out" / "logs" / "series.jsonl").exists()  # JSON Lines, as a shard's name says
    result = cli("manifest", "--dataset-dir", data, "-o", tmp_path / "again.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"{data}: 1 shard (train 1), 0.0 MiB -> {tmp_path / 'again.json'}"
    assert result.stdout.splitlines()[-1] == "passed over out/: a tokpipe OUT, never input"
    assert list(load_manifest(tmp_path / "again.json").shards()) == list(load_manifest(tmp_path / "m.json").shards())


# Files of data beside the shards, as datasets hold them: JSON Lines and a JSON array named .json (C4's uncompressed
# files, alpaca_data.json; Hugging Face's json builder reads them), metadata, one JSON object, a compression tokpipe
# does not read, a README.
DATA_FILES = {
    "en/c4-train.00000-of-00001.json": b'{"text": "one"}\n{"text": "two"}\n',
    "en/c4-validation.00000-of-00001.json": b'{"text": "three"}\n',
    "en/dataset_info.json": b'{\n  "description": "C4"\n}\n',
    "en/c4-train.alpaca.json": b'[\n    {\n        "text": "four"\n    },\n    "five"\n]',
    "en/c4-train.stats.json": b'{\n  "documents": 5\n}\n',
    "en/c4-train.more.jsonl.lz4": b"\x04\x22\x4d\x18",  # (datasets reads it only with the lz4 package)
    "README.md": b"# C4\n",
}
NOT_JSON_LINES = (
    "neither JSON Lines nor a JSON array (its first line is no JSON object: metadata, or one JSON document);"
    " convert it to JSONL to tokenize it"
)
NOT_READ = (
    "a format tokpipe does not read (it reads JSON Lines, plain or compressed with zstd, gzip, bz2 or xz, Parquet and"
    " Arrow): convert it to one of those to tokenize it"
)
PASSED_OVER_FILES = (
    ("en/c4-train.more.jsonl.lz4", NOT_READ),
    ("en/c4-train.stats.json", NOT_JSON_LINES),
    ("en/dataset_info.json", "Hugging Face datasets' metadata, never data"),
)


def test_a_json_file_of_json_lines_is_a_shard_and_every_other_file_of_data_is_named(tmp_path, small_tokenizer):
    """A .json file is a shard when its first line is a JSON object or it is a JSON array, as Hugging Face datasets
    reads it (an array of objects, or of texts); a file of data that is no shard is named with why, never left out
    without a word. (Before, every .json file was left out silently: C4's uncompressed validation files were not in
    the manifest, and nothing said so.)"""
    data = tmp_path / "data"
    for relpath, content in DATA_FILES.items():
        (data / relpath).parent.mkdir(parents=True, exist_ok=True)
        (data / relpath).write_bytes(content)
    m = build_manifest(data)
    assert [(s.split, s.relpath, s.key) for s in m.shards()] == [
        ("train", "en/c4-train.00000-of-00001.json", "en__c4-train.00000-of-00001"),
        ("train", "en/c4-train.alpaca.json", "en__c4-train.alpaca"),
        ("validation", "en/c4-validation.00000-of-00001.json", "en__c4-validation.00000-of-00001"),
    ]
    assert m.files_passed_over == PASSED_OVER_FILES
    result = cli("manifest", "--dataset-dir", data, "-o", tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[3:] == [f"passed over {relpath}: {why}" for relpath, why in PASSED_OVER_FILES]
    run = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert run.returncode == 0, run.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert {name: split["documents"] for name, split in meta["splits"].items()} == {"train": 4, "validation": 1}


def test_a_shard_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "a.jsonl", ['{"text": "a"}'])
    os.mkfifo(data / "train" / "b.jsonl")  # a run reading it would wait forever for a writer
    result = cli("manifest", "--dataset-dir", data, "-o", tmp_path / "m.json")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "tokpipe manifest: error: train/b.jsonl is not a regular file (a named pipe, a socket or a device): put the "
        "shard there, or remove it\n"
    )
    assert not (tmp_path / "m.json").exists()


def test_a_manifest_path_that_is_a_folder_is_refused_and_nothing_is_left(tmp_path):
    (tmp_path / "manifests").mkdir()
    result = cli("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", tmp_path / "manifests")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"tokpipe manifest: error: -o {tmp_path / 'manifests'} is a folder: name the manifest's file "
        f"(e.g. -o {tmp_path / 'manifests' / 'NAME.json'})\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifests"] and not any((tmp_path / "manifests").iterdir())


# -- a dataset on an object store (s3://BUCKET/PREFIX), against a real S3 server ----------------------------


def test_a_dataset_on_a_store_gives_the_shards_of_its_local_copy_in_every_layout(s3_server, s3_prefix, tmp_path):
    """An HF cache copied up as `aws s3 sync` copies it (the snapshots' links followed), and a plain folder: the
    same splits, order, sizes and keys as on disk; each shard an s3:// URL with the ETag the store lists."""
    cache = s3_server.upload(EXAMPLE_CACHE, f"{s3_prefix}/hf-cache")
    repo = f"{cache}/datasets--tokpipe-realdata--slimpajama-mini"
    plain = s3_server.upload(plain_copy_of_example(tmp_path / "plain"), f"{s3_prefix}/plain")
    local = [(s.split, s.relpath, s.size, s.key) for s in build_manifest(EXAMPLE_CACHE).shards()]
    found = {o["Key"]: o["ETag"] for o in s3_server.client().list_objects_v2(Bucket=s3_server.bucket)["Contents"]}
    manifests = [api.build_manifest(d) for d in (cache, repo, f"{repo}/snapshots/{REVISION}/", plain + "/")]
    for m in manifests:
        assert [(s.split, s.relpath, s.size, s.key) for s in m.shards()] == local
        assert all(s.etag == found[Url.parse(s.path).key] for s in m.shards())
    assert {m.fingerprint for m in manifests[:3]} == {manifests[0].fingerprint}  # the same objects
    assert [s.path for s in manifests[0].shards()] == [
        f"{repo}/snapshots/{REVISION}/{relpath}" for _, relpath, *_ in local
    ]
    assert [s.path for s in manifests[3].shards()] == [f"{plain}/{relpath}" for _, relpath, *_ in local]
    assert (manifests[0].repo_id, manifests[0].revision, manifests[0].root, manifests[0].base) == (
        "tokpipe-realdata/slimpajama-mini",
        REVISION,
        f"{repo}/snapshots/{REVISION}/",
        f"{repo}/",
    )
    assert (manifests[3].repo_id, manifests[3].root) == (None, f"{plain}/")
    # The fingerprint holds each ETag: a store's manifest is never taken for its local copy's, nor the reverse.
    assert manifests[3].fingerprint != build_manifest(tmp_path / "plain").fingerprint


def test_the_manifest_command_on_a_store_writes_and_reports_it(s3_server, s3_prefix, tmp_path):
    cache = s3_server.upload(EXAMPLE_CACHE, f"{s3_prefix}/hf-cache")
    result = cli("manifest", "--dataset-dir", cache, "-o", tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"tokpipe-realdata/slimpajama-mini@{REVISION[:12]}: 3 shards (train 2, validation 1), 1.1 MiB -> "
        f"{tmp_path / 'm.json'}\n"
        "  train: 2 shards, 0.8 MiB: train/chunk1/example_train_0.jsonl.zst, train/chunk1/example_train_1.jsonl.zst\n"
        "  validation: 1 shard, 0.3 MiB: validation/chunk1/example_holdout_0.jsonl.zst\n"
    )
    loaded = load_manifest(tmp_path / "m.json")  # the ETags round-trip, and the fingerprint with them
    assert list(loaded.shards()) == list(api.build_manifest(cache).shards())


def test_on_a_store_a_json_file_of_json_lines_is_a_shard_and_every_other_file_of_data_is_named(s3_server, s3_prefix):
    for relpath, content in DATA_FILES.items():
        s3_server.put(f"{s3_prefix}/json/{relpath}", content)
    m = api.build_manifest(s3_server.url(f"{s3_prefix}/json"))
    assert [(s.split, s.relpath) for s in m.shards()] == [
        ("train", "en/c4-train.00000-of-00001.json"),
        ("train", "en/c4-train.alpaca.json"),
        ("validation", "en/c4-validation.00000-of-00001.json"),
    ]
    assert m.files_passed_over == PASSED_OVER_FILES


def test_a_dataset_on_a_store_is_refused_and_passed_over_as_on_disk(s3_server, s3_prefix):
    data = s3_prefix + "/data"
    for key in ("train/a.jsonl", ".cache/hidden.jsonl", "out/run.json", "out/manifest.json", "out/shards/x.jsonl"):
        s3_server.put(f"{data}/{key}", b'{"text": "a"}\n')
    m = api.build_manifest(s3_server.url(data))
    assert [s.relpath for s in m.shards()] == ["train/a.jsonl"]
    assert m.passed_over == (("out", "a tokpipe OUT, never input"),)

    s3_server.put(f"{data}/train/dev/x.jsonl", b'{"text": "a"}\n')
    with pytest.raises(UserError, match=r"^train/dev/x.jsonl names more than one split \(train and validation\)"):
        api.build_manifest(s3_server.url(data))

    s3_server.put(f"{s3_prefix}/notes/readme.txt", b"hi")
    with pytest.raises(UserError) as none:
        api.build_manifest(s3_server.url(f"{s3_prefix}/notes"))
    assert str(none.value) == (
        "no shards (*.jsonl, *.jsonl.zst, *.jsonl.zstd, *.jsonl.gz, *.jsonl.bz2, *.jsonl.xz, *.json.gz, *.json.zst,"
        f" *.json.bz2, *.json.xz, *.ndjson, *.parquet, *.arrow) under {s3_server.url(s3_prefix)}/notes/; passed over"
        f" readme.txt: {NOT_READ}; found readme.txt in {s3_server.url(s3_prefix)}/notes/; expected a Hugging Face cache"
        " root (holding datasets--ORG--NAME/), one datasets--ORG--NAME folder, a snapshots/REV folder, or a folder of"
        " *.jsonl[.zst|.gz|.bz2|.xz], *.parquet or *.arrow shards"
    )
    with pytest.raises(UserError) as nothing:
        api.build_manifest(s3_server.url(f"{s3_prefix}/not"))  # a prefix of notes/, but no folder
    assert str(nothing.value) == (
        f"--dataset-dir {s3_server.url(s3_prefix)}/not/ holds no object: is the bucket or the prefix misspelt?"
    )


def test_a_cache_on_a_store_picks_its_snapshot_by_refs_as_on_disk(s3_server, s3_prefix):
    cache = s3_server.upload(EXAMPLE_CACHE, f"{s3_prefix}/hf-cache")
    repo = f"{s3_prefix}/hf-cache/datasets--tokpipe-realdata--slimpajama-mini"
    for key in ("train/chunk1/example_train_0.jsonl.zst", "validation/chunk1/example_holdout_0.jsonl.zst"):
        s3_server.put(f"{repo}/snapshots/{'0' * 40}/{key}", b'{"text": "an older revision"}\n')
    s3_server.put(f"{s3_prefix}/hf-cache/datasets--other--set/snapshots/{'1' * 40}/a.jsonl", b'{"text": "a"}\n')
    with pytest.raises(UserError, match=r"holds several datasets \(other/set, tokpipe-realdata/slimpajama-mini\)"):
        api.build_manifest(cache)
    assert api.build_manifest(cache, repo_id="tokpipe-realdata/slimpajama-mini").revision == REVISION  # refs/main
    older = api.build_manifest(cache, repo_id="tokpipe-realdata/slimpajama-mini", revision="0" * 40)
    assert [s.size for s in older.shards()] == [30, 30]
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=f"{repo}/refs/main")
    with pytest.raises(UserError, match="has 2 snapshots and no refs/main: pick one with --revision"):
        api.build_manifest(cache, repo_id="tokpipe-realdata/slimpajama-mini")


def test_a_wrong_key_a_missing_bucket_or_no_store_is_refused_in_one_line(s3_server, s3_prefix, tmp_path):
    url = s3_server.upload(EXAMPLE_CACHE, f"{s3_prefix}/hf-cache")
    where = f"{url}/: the store at {s3_server.endpoint}"
    cases = [
        (
            {"AWS_ACCESS_KEY_ID": "nobody"},
            url,
            f"{where} answered InvalidAccessKeyId: the access key is not the store's (AWS_ACCESS_KEY_ID) (The access"
            " key ID you provided does not exist in our records.)",
        ),
        (
            {"AWS_SECRET_ACCESS_KEY": "wrong"},
            url,
            f"{where} answered SignatureDoesNotMatch: the secret key does not match the access key "
            "(AWS_SECRET_ACCESS_KEY) (The request signature we calculated does not match the signature you provided."
            " Check your key and signing method.)",
        ),
        (
            {},
            "s3://no-such-bucket/data",
            f"s3://no-such-bucket/data/: the store at {s3_server.endpoint} answered NoSuchBucket: there is no such "
            "bucket (The specified bucket does not exist)",
        ),
        (
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
            url,
            f"{url}/: cannot reach the store at http://127.0.0.1:9 after 2 tries (Could not connect to the endpoint "
            f'URL: "http://127.0.0.1:9/{s3_server.bucket}?list-type=2&prefix={s3_prefix}%2Fhf-cache%2F&max-keys=1'
            '&encoding-type=url")',
        ),
    ]
    for env, dataset, message in cases:
        result = tokpipe("manifest", "--dataset-dir", dataset, "-o", tmp_path / "m.json", env=env)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"tokpipe manifest: error: {message}\n")
    assert not (tmp_path / "m.json").exists()
