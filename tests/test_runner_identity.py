"""runner/identity.py: what a run is. run.json records the inputs OUT's bytes depend on; a rerun with other
inputs (text field, tokenizer, EOS, delimiters) is refused saying what differs, and so are delimiters no
trainer could split documents by; a manifest that only gained shards resumes as an append, keeping the
finished shards; an earlier tokpipe's run.json is the same run. An OUT that holds no token yet (every
refusal comes before the first) is no run: the corrected command starts it over, and status names it."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    QWEN3,
    add_shards,
    assert_out_is,
    bind_mount,
    checkpoints_by_key,
    cli,
    held_out,
    out_files,
    reference_by_group,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    run_args,
    snapshot_files,
    tokpipe,
    write_jsonl,
)

from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.runner.identity import run_identity


def test_delimiters_nobody_could_split_or_a_bos_the_tokenizer_lacks_are_refused(tmp_path):
    manifest = tmp_path / "m.json"
    assert cli("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", manifest).returncode == 0
    run = run_args(manifest, tmp_path / "out")
    no_bos = cli(*run, "--bos")
    assert no_bos.returncode == 2
    assert no_bos.stderr == (
        f"tokpipe run: error: {QWEN3} names no bos_token (tokenizer_config.json): pass --bos-token TOKEN "
        "(e.g. --bos-token '<|endoftext|>')\n"
    )
    nothing = cli(*run, "--no-eos")
    assert nothing.returncode == 2
    assert nothing.stderr == (
        "tokpipe run: error: --no-eos without --bos would write documents back to back with nothing between "
        "them: add --bos, or drop --no-eos\n"
    )
    unknown = cli(*run, "--bos", "--bos-token", "<|no such token|>")
    assert unknown.returncode == 2 and "not in the tokenizer's vocabulary" in unknown.stderr
    assert unknown.stderr.count("\n") == 1 and unknown.stderr.startswith("tokpipe run: error: ")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_resume_with_other_delimiters_is_refused_and_an_earlier_run_json_is_the_same_run(
    finished_bos, finished_example, tmp_path
):
    out = tmp_path / "bos"
    shutil.copytree(finished_bos, out)
    other = cli(*run_args(out / "manifest.json", out))
    assert other.returncode == 2
    assert other.stderr == (
        f"tokpipe run: error: {out} holds a run with other inputs (bos_token_id: was 151644, now None; delimiters: "
        "was {'bos': True, 'eos': True}, now {'bos': False, 'eos': True}); use a new --out, or the original inputs "
        "to resume\n"
    )
    # An OUT of tokpipe 0.1, unfinished: its run.json has no delimiters or val_fraction, meaning EOS only.
    old = tmp_path / "old"
    shutil.copytree(finished_example, old)
    run = json.loads((old / "run.json").read_text())
    del run["delimiters"], run["val_fraction"]
    (old / "run.json").write_text(json.dumps(run))
    (old / "meta.json").unlink()
    again = tokpipe(*run_args(old / "manifest.json", old))
    assert again.returncode == 0, again.stderr
    assert json.loads((old / "meta.json").read_text())["delimiters"] == {"bos": False, "eos": True}


def test_a_rerun_with_other_inputs_is_refused_saying_what_differs(out, tmp_path, small_tokenizer, dataset):
    manifest = build_manifest(dataset)
    write_manifest(manifest, tmp_path / "m.json")
    (out / "run.json").write_text(json.dumps(run_identity(manifest, load_tokenizer_info(QWEN3), RunOptions())))
    other_field = cli(*run_args(tmp_path / "m.json", out, "--text-field", "body"))
    assert other_field.returncode == 2
    assert other_field.stderr == (
        f"tokpipe run: error: {out} holds a run with other inputs (text_field: was 'text', now 'body'); "
        "use a new --out, or the original inputs to resume\n"
    )
    other_tok = cli("run", "--manifest", tmp_path / "m.json", "--tokenizer", small_tokenizer, "--out", out)
    assert other_tok.returncode == 2
    assert "tokenizer_sha256" in other_tok.stderr and "dtype: was 'uint32', now 'uint16'" in other_tok.stderr
    other_eos = cli(*run_args(tmp_path / "m.json", out, "--eos", "<|im_end|>"))
    assert other_eos.returncode == 2
    assert other_eos.stderr == (
        f"tokpipe run: error: {out} holds a run with other inputs (eos_token: was '<|endoftext|>', now "
        "'<|im_end|>'; eos_token_id: was 151643, now 151645); use a new --out, or the original inputs to resume\n"
    )


def test_a_manifest_that_only_gained_shards_resumes_as_an_append(dataset, tmp_path, small_tokenizer, small_reference):
    held_back = dataset / "validation" / "chunk1" / "example_holdout_0.jsonl.zst"
    data = held_back.read_bytes()
    held_back.unlink()
    out = tmp_path / "out"
    write_manifest(build_manifest(dataset), tmp_path / "small.json")
    assert tokpipe(*run_args(tmp_path / "small.json", out, tokenizer=small_tokenizer)).returncode == 0
    train_done_at = {path: path.stat().st_mtime_ns for path in (out / "shards" / "train").rglob("*.json")}

    held_back.write_bytes(data)
    write_manifest(build_manifest(dataset), tmp_path / "full.json")
    result = tokpipe(*run_args(tmp_path / "full.json", out, tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        lines[0] == f"the manifest gained 1 shard since {out} was started: appending them (finished shards are kept)"
    )
    assert re.fullmatch(
        rf"manifest {re.escape(str(dataset))}: 3 shards, 1\.1 MiB; 2 done, 0 partial, 1 to start", lines[2]
    )
    assert {path: path.stat().st_mtime_ns for path in (out / "shards" / "train").rglob("*.json")} == train_done_at
    assert_out_is(out, small_reference)

    # A shard that changed is not an append: refused.
    write_jsonl_path = dataset / "train" / "chunk1" / "example_train_1.jsonl.zst"
    write_jsonl_path.write_bytes(write_jsonl_path.read_bytes()[:-10])
    write_manifest(build_manifest(dataset), tmp_path / "changed.json")
    refused = cli(*run_args(tmp_path / "changed.json", out, tokenizer=small_tokenizer))
    assert refused.returncode == 2
    assert refused.stderr == (
        f"tokpipe run: error: {out} was started from another manifest: 1 of the shards it finished is changed or gone"
        " in this one (e.g. train/chunk1/example_train_1.jsonl.zst); use a new --out, or the original manifest to"
        " resume\n"
    )


# What an append is tested with: the options of the runs, by name, and the finished shards it moves in each split
# file, in a folder and on a store (--no-concat: none, a split is its parts' own files). On a store every split file
# is made anew from its segments: each split's finished shards are taken from the files as they were.
APPEND_MODES = {
    "plain": ((), "2 in train", "2 in train, 1 in val"),
    "--group-by": (("--group-by", GROUP_FIELD), "2 in train", "2 in train, 1 in val"),
    "--val-fraction": (("--val-fraction", "0.3"), "2 in train, 3 in val", "2 in train, 3 in val"),
    "--no-concat": (("--no-concat",), None, None),
}
# The shards an append adds: one that sorts before every finished shard of train (and so before val.bin's held-out
# parts), one between train's two.
ADDED_FIRST, ADDED_BETWEEN = "train/chunk0/example_train_a.jsonl.zst", "train/chunk1/example_train_0a.jsonl.zst"


def _split_tokens(files: dict[str, bytes], meta: dict, split: str, group: str | None = None) -> np.ndarray:
    """A finished split's tokens (or one group's), read from the files meta names."""
    entry = meta["splits"][split] if group is None else meta["splits"][split]["groups"][group]
    names = [entry["file"]] if "file" in entry else [f["bin"] for f in entry["files"]]
    return np.concatenate([np.frombuffer(files[name], dtype=np.uint16) for name in names])


@pytest.mark.parametrize("out_on", ["a folder", "a store"])
@pytest.mark.parametrize("mode", APPEND_MODES)
def test_shards_added_before_finished_ones_move_them_and_tokenize_only_the_new(
    dataset, tmp_path, small_tokenizer, mode, out_on, request
):
    """An append of shards that sort first and in the middle of a split: the finished shards' parts move to
    their new offsets in the split files (each group's, val.bin's held-out parts too), none is tokenized
    again, and the output is a fresh run's of the whole dataset, by the reference."""
    options, moved_in_folder, moved_on_store = APPEND_MODES[mode]
    if out_on == "a folder":
        out, moved, server = tmp_path / "out", moved_in_folder, None
        said = f"moving finished shards to their new offsets, after the shards added before them ({moved}): copied"
        said += " from the split files as they were, none tokenized again"

        def checkpoints() -> dict[str, int]:
            return {p.as_posix(): p.stat().st_mtime_ns for p in (out / "shards").rglob("*.json")}
    else:
        server, prefix = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_prefix")
        out, moved = server.url(prefix), moved_on_store
        said = f"taking finished shards from the split files as they were ({moved}), copied on the server to"
        said += f" {out}/sources/: none tokenized again"

        def checkpoints() -> dict[str, str]:
            listed = server.client().list_objects_v2(Bucket=server.bucket, Prefix=f"{prefix}/shards/")["Contents"]
            return {o["Key"]: o["ETag"] for o in listed if o["Key"].endswith(".json")}

    write_manifest(build_manifest(dataset), tmp_path / "before.json")
    first = tokpipe(*run_args(tmp_path / "before.json", out, *options, tokenizer=small_tokenizer))
    assert first.returncode == 0, first.stderr
    done_at = checkpoints()

    add_shards(dataset, ADDED_FIRST, ADDED_BETWEEN)
    write_manifest(build_manifest(dataset), tmp_path / "after.json")
    rerun = tokpipe(*run_args(tmp_path / "after.json", out, *options, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stderr
    lines = rerun.stdout.splitlines()
    assert (
        lines[0] == f"the manifest gained 2 shards since {out} was started: appending them (finished shards are kept)"
    )
    assert [line for line in lines if line.startswith(("moving", "taking"))] == ([said] if moved else [])
    assert re.search(r": 5 shards, .*; 3 done, 0 partial, 2 to start$", rerun.stdout, re.M), rerun.stdout
    assert "tokenizing again" not in rerun.stdout and "starting it over" not in rerun.stdout
    assert {key: stamp for key, stamp in checkpoints().items() if key in done_at} == done_at  # none done again

    found = out_files(out, server)
    meta = json.loads(found["meta.json"])
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    train, holdout = snapshot_files(dataset, "train"), snapshot_files(dataset, "validation")
    assert [p.relative_to(dataset).as_posix() for p in train] == [
        ADDED_FIRST,
        "train/chunk1/example_train_0.jsonl.zst",
        ADDED_BETWEEN,
        "train/chunk1/example_train_1.jsonl.zst",
    ]
    if mode == "--group-by":
        for split, shards in (("train", train), ("validation", holdout)):
            groups = reference_by_group(shards, tokenizer, GROUP_FIELD, eos)
            assert list(meta["splits"][split]["groups"]) == list(groups)
            for group, (tokens, _, _) in groups.items():
                assert np.array_equal(_split_tokens(found, meta, split, group), tokens), (split, group)
    else:
        keep = held_out(0.3, False) if mode == "--val-fraction" else None
        expected = {"train": reference_tokens(train, tokenizer, eos, np.uint16, keep=keep)}
        expected["validation"] = reference_tokens(holdout, tokenizer, eos, np.uint16)
        if mode == "--val-fraction":  # val.bin: the train shards' held-out documents, then validation's
            held = reference_tokens(train, tokenizer, eos, np.uint16, keep=held_out(0.3, True))
            expected["validation"] = np.concatenate([held, expected["validation"]])
        for split, tokens in expected.items():
            assert np.array_equal(_split_tokens(found, meta, split), tokens), split
    assert not [name for name in found if name.startswith(("moving/", "sources/"))]
    if mode != "--no-concat":
        assert not [name for name in found if name.startswith("segments/")]
    assert cli("verify", out).returncode == 0


@pytest.mark.parametrize("manifest", ["the same", "rebuilt", "rebuilt without it"])
@pytest.mark.parametrize("out_on", ["a folder", "a store"])
def test_a_shard_that_failed_and_was_fetched_again_is_tokenized_anew(
    tmp_path, small_tokenizer, out_on, manifest, request
):
    """A cut download fails its shard; fetched again (here compressed anew: its first bytes differ too) it is other
    input. With the same manifest, a folder's checkpoint of it, a place in the cut file, is forgotten; with the manifest
    rebuilt, the run takes it as an append does, OUT holding nothing finished of it. Either way the rerun tokenizes it
    from its start and keeps every finished shard. Before, the same command read the new file from the old place
    ("corrupt zstd data"), and a rebuilt manifest was refused (on a store: an unfinished OUT's append)."""
    server = request.getfixturevalue("s3_server") if out_on == "a store" else None
    out = tmp_path / "out" if server is None else server.url(request.getfixturevalue("s3_prefix"))
    texts = [json.dumps({"text": text}) for path in EXAMPLE_TRAIN_FILES for text in reference_texts(path)]
    data, whole = tmp_path / "data", zstandard.ZstdCompressor().compress("".join(f"{t}\n" for t in texts).encode())
    cut, after = data / "train" / "a.jsonl.zst", write_jsonl(data / "train" / "b.jsonl", texts[:20])
    cut.write_bytes(whole[: len(whole) // 2])  # 3.9 MB of JSON Lines whole: batches of 1 MiB read before the cut
    write_manifest(build_manifest(data), tmp_path / "before.json")
    mid_shard = ("--checkpoint-interval", "0.000001", "--shard-buffer", "0")  # a checkpoint after each batch
    failed = tokpipe(*run_args(tmp_path / "before.json", out, *mid_shard, tokenizer=small_tokenizer))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    if server is None:  # tokens kept at a place in the cut file that is no place in the new one
        assert checkpoints_by_key(out)["train__a"]["tokens"] > 0
    else:
        assert failed.stderr.splitlines()[-2].startswith("FAILED train/a.jsonl.zst: SourceError: ")

    cut.write_bytes(zstandard.ZstdCompressor(level=1).compress("".join(f"{t}\n" for t in texts).encode()))
    if manifest == "rebuilt without it":  # a shard broken at its source, taken out of the dataset
        cut.unlink()
        write_manifest(build_manifest(data), tmp_path / "after.json")
        said = f"the manifest left out 1 shard that {out} holds no finished work of (e.g. train/a.jsonl.zst): not in"
        said += " OUT"
    elif manifest == "rebuilt":
        write_manifest(build_manifest(data), tmp_path / "after.json")
        said = f"the manifest changed 1 shard that {out} holds no finished work of (e.g. train/a.jsonl.zst): tokenized"
        said += " anew as it lists them now"
    elif server is None:
        said = f"train/a.jsonl.zst is {cut.stat().st_size:,} bytes, not the manifest's {len(whole) // 2:,}, since its"
        said += " checkpoint: tokenizing it from its start"
    else:  # a store keeps no checkpoint of a shard not done
        said = "tokenizer small_tokenizer0@"
    rerun = tokpipe(*run_args(tmp_path / ("before.json" if manifest == "the same" else "after.json"), out,
                              tokenizer=small_tokenizer))  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert rerun.stdout.startswith(said), rerun.stdout
    left = [] if manifest == "rebuilt without it" else [cut]  # the same texts: cut, fetched again
    assert re.search(rf": {len(left) + 1} shards?, .*; 1 done, 0 partial, {len(left)} to start$", rerun.stdout, re.M)
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    expected = reference_tokens([*left, after], tokenizer, eos, np.uint16)
    assert np.array_equal(np.frombuffer(out_files(out, server)["train.bin"], dtype=np.uint16), expected)
    assert cli("verify", out).returncode == 0


def _files(out: Path) -> dict[str, bytes | None]:
    """OUT's files, and the bytes of those that say what, not when (not the logs, the lock and the shard
    checkpoints, which time their shard)."""
    paths = (p.relative_to(out) for p in sorted(out.rglob("*")) if p.is_file())
    return {str(p): None if p.parts[0] in ("logs", ".lock", "shards") else (out / p).read_bytes() for p in paths}


def test_a_refused_run_leaves_out_to_the_corrected_command(tmp_path, monkeypatch, small_tokenizer):
    """A newcomer's first tries on one OUT, each refused before the first token, then the command that works:
    it runs on that OUT, and gives the bytes of a fresh run. Once OUT holds tokens, other inputs are refused."""
    # The 600-id tokenizer with Qwen3's normalizer (NFC), under which gigatoken's ids differ from tokenizers' on
    # the first document (a hard case): Qwen3 itself would cost each run ~1.8 CPU-s more, and is not the subject.
    tok = tmp_path / "nfc"
    shutil.copytree(small_tokenizer, tok)
    spec = json.loads((tok / "tokenizer.json").read_text())
    (tok / "tokenizer.json").write_text(json.dumps({**spec, "normalizer": {"type": "NFC"}}))
    first = "Sogdian \U00010d27\U00010f46 marks"
    lines = [json.dumps({"id": i, "text": first if i == 0 else f"document number {i}"}) for i in range(4200)]
    shard = write_jsonl(tmp_path / "data" / "train" / "a.jsonl", lines)
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", tmp_path / "data", "-o", manifest).returncode == 0
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # a hub name that is in no cache
    command = f"tokpipe run --manifest {out}/manifest.json --tokenizer {tok}/tokenizer.json --out {out}"

    workers = cli(*run_args(manifest, out, "--workers", "0", tokenizer=tok))
    assert (workers.returncode, workers.stderr.splitlines()[-1]) == (
        2,
        "tokpipe run: error: argument --workers: must be > 0, got 0",
    )
    hub = tokpipe(*run_args(manifest, out, tokenizer="nobody/nothing"))
    assert (hub.returncode, hub.stderr) == (
        2,
        f"tokpipe run: error: no tokenizer nobody/nothing (revision main) in the Hugging Face cache {tmp_path / 'hub'}"
        " (set by HF_HUB_CACHE or HF_HOME), and no local folder of that name: fetch it with `hf download"
        " nobody/nothing --include 'tokenizer*'`; tokpipe never downloads\n",
    )
    assert not out.exists()
    refusals = [
        (
            ["--text-field", "body"],
            "",
            "no document has a 'body' field in the first lines of each split's first shard; their fields: id, text:"
            " pass --text-field NAME (e.g. --text-field text)",
            f"{command} --text-field text",
        ),
        (
            ["--backend", "gigatoken"],
            f"{out} holds no token yet: starting it over with these inputs (text_field: was 'body', now 'text')\n",
            "--backend gigatoken does not reproduce tokenizers' ids on this tokenizer and data: use --backend auto",
            f"{command} --backend auto",
        ),
        (
            ["--group-by", "id"],
            f"{out} holds no token yet: starting it over with these inputs (group_by: was None, now 'id')\n",
            "--group-by id: split train has more than 4,096 distinct values in its first shard alone (e.g. '0', '1',"
            " '10'), and a split may have at most 4,096 groups: group by a field with a few values (a source, a"
            " language), not one per document (an id, a url)",
            command,
        ),
    ]
    for extra, replaced, error, works in refusals:
        refused = cli(*run_args(manifest, out, *extra, tokenizer=tok))
        assert (refused.returncode, refused.stderr) == (2, f"tokpipe run: error: {error}\n")
        assert refused.stdout.startswith(replaced + "tokenizer nfc@sha256:")
        status = cli("status", out).stdout.splitlines()
        assert status[0] == f"{out}: holds no token yet; the last run was refused: {error}"
        assert status[-1] == f"next: {works}"

    corrected = tokpipe(*run_args(manifest, out, tokenizer=tok))
    assert corrected.returncode == 0, corrected.stderr
    assert corrected.stdout.splitlines()[0] == (
        f"{out} holds no token yet: starting it over with these inputs (group_by: was 'id', now None)"
    )
    eos = reference_tokenizer(tok / "tokenizer.json").token_to_id("<|endoftext|>")
    assert_out_is(out, {"train": reference_tokens([shard], tok / "tokenizer.json", eos, np.uint16)})
    assert tokpipe(*run_args(manifest, tmp_path / "fresh", tokenizer=tok)).returncode == 0
    assert _files(out) == _files(tmp_path / "fresh")

    # Tokens committed: from here on OUT is a run, and other inputs are refused.
    again = cli(*run_args(manifest, out, "--text-field", "body", tokenizer=tok))
    assert (again.returncode, again.stderr) == (
        2,
        f"tokpipe run: error: {out} holds a run with other inputs (text_field: was 'text', now 'body'); use a new"
        " --out, or the original inputs to resume\n",
    )
    assert cli("status", out).stdout.splitlines()[0] == f"{out}: finished"


@pytest.mark.parametrize("out_on", ["a folder", "a store"])
def test_an_out_that_holds_what_no_run_wrote_is_refused_and_left_as_it_was(out_on, manifest, small_tokenizer, request):
    """A nanoGPT data folder (its prepare.py and train.bin) given as --out: a run would write among its files and
    replace its train.bin. Refused in one line before any work, its files as they were."""
    nanogpt = {"prepare.py": b"# tokenize openwebtext\n", "train.bin": bytes(range(256)) * 4}
    if out_on == "a folder":
        out, server = manifest.parent / "openwebtext", None
        out.mkdir()
        for name, data in nanogpt.items():
            (out / name).write_bytes(data)
    else:
        server, prefix = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_prefix")
        out = server.url(prefix)
        for name, data in nanogpt.items():
            server.put(f"{prefix}/{name}", data)
    refused = cli(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"tokpipe run: error: {out} holds what no tokpipe run wrote (prepare.py, train.bin) and no run.json: --out"
        " takes a new or empty folder, or a tokpipe run's OUT\n",
    )
    assert out_files(out, server) == nanogpt


@pytest.mark.parametrize("out_on", ["a folder", "a store"])
def test_an_out_inside_another_is_refused_before_anything_is_written(
    out_on, finished_small, manifest, small_tokenizer, tmp_path, request
):
    """A run's OUT inside another's (`--out s3://b/tok/v2` where s3://b/tok is one): an append to the outer one, which
    resumed, removed the inner one's train.bin, taken for a split file of its own killed finalize (on disk: inside
    its shards/ folder). Refused in one line; the outer OUT as it was, and nothing of the inner one made."""
    if out_on == "a folder":
        outer, server = tmp_path / "tok", None
        shutil.copytree(finished_small, outer)
        inner = [outer / "v2", outer / "shards" / "x", outer / "v2" / "a"]
    else:
        server, prefix = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_prefix")
        outer = server.url(prefix)
        for name in ("run.json", "manifest.json"):  # what makes a prefix an OUT
            server.put(f"{prefix}/{name}", (finished_small / name).read_bytes())
        inner = [f"{outer}/v2", f"{outer}/v2/a"]
    before = out_files(outer, server)
    for out in inner:
        refused = cli(*run_args(manifest, out, tokenizer=small_tokenizer))
        assert (refused.returncode, refused.stderr) == (
            2,
            f"tokpipe run: error: {out} is inside the tokpipe OUT {outer}, whose runs would take its files for their"
            " own: --out takes a folder outside every OUT\n",
        )
    assert out_files(outer, server) == before


def test_a_finished_out_on_a_read_only_mount_is_nothing_to_do_and_anything_else_is_refused(
    finished_small, killed_example, small_tokenizer, tmp_path
):
    """A finished OUT shared read-only (an archive, a trainer's mount): rerunning its command is the documented
    no-op (it exited 1, opening OUT/.lock for writing). Whatever would write there is refused in one line, before
    any work: other inputs, a run that is not finished."""
    for name, made in (("finished", finished_small), ("killed", killed_example)):
        shutil.copytree(made, tmp_path / name)
    with bind_mount(tmp_path / "finished", tmp_path / "ro", read_only=True) as ro:
        same = cli(*run_args(ro / "manifest.json", ro, tokenizer=small_tokenizer))
        assert (same.returncode, same.stdout, same.stderr) == (
            0,
            f"{ro} is already finished ({ro}/meta.json); nothing to do. Check it with: tokpipe verify {ro}\n",
            "",
        )
        other = cli(*run_args(ro / "manifest.json", ro, "--text-field", "content", tokenizer=small_tokenizer))
        assert (other.returncode, other.stderr) == (
            2,
            f"tokpipe run: error: {ro} is not writable here (a read-only mount, or another user's), and holds a run"
            " with other inputs (text_field: was 'text', now 'content'): use a new --out\n",
        )
    with bind_mount(tmp_path / "killed", tmp_path / "ro-killed", read_only=True) as ro:
        unfinished = cli(*run_args(ro / "manifest.json", ro))
        assert (unfinished.returncode, unfinished.stderr) == (
            2,
            f"tokpipe run: error: {ro} is not writable here (a read-only mount, or another user's), and its run is"
            " not finished: rerun where it can be written\n",
        )
