"""runner/driver.py, the story of a run: a kill -9 at any moment (start-up, mid-shard, while the split files
are assembled, during finalize), a full disk, a Ray node lost mid-run and a Ctrl-C never change the bytes;
the rerun of the same command resumes and ends at the reference, tokenizing again only what it must (a split
file damaged after its shards' own files were removed).

Every test here really does the thing: kill -9, a full tmpfs, a Ray node removed. A kill at a point of the
run (mid-shard, while the split files are assembled) is a SIGKILL at the n-th call of a function of tokpipe's
(helpers.killed_run), the driver alone with the fast backend and the 600-id tokenizer (Qwen3 is not their
subject): it lands there however loaded the machine.
Where Ray's own start is part of what is tested (the kills at random moments, the first during start-up;
Ctrl-C; a cluster of two nodes) the run is stopped at a moment, on the slow reference encoder, with a Ray of
its own. Reruns and small runs go as a user's do: the example is tokenized by the driver before a Ray of its
own would be up, and joining one would make them slower (2.8 s alone, 8.2 s joined).
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zstandard
from helpers import (
    EMBEDDED_RAY_2_WORKERS,
    EXAMPLE_HOLDOUT_FILES,
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    QWEN3_EOS,
    TRAIN_DOCUMENTS,
    VAL_DOCUMENTS,
    assert_out_is,
    checkpoints,
    checkpoints_by_key,
    cli,
    gathered_run,
    held_out,
    kill_9,
    killed_run,
    out_files,
    reference_by_group,
    reference_ids,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    run_args,
    start,
    stopped_as_status_says,
    tokpipe,
    wait_for,
    write_jsonl,
)

from tokpipe.commands.inspect import open_source
from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.runner import driver

HF = ("--backend", "hf")  # the slow reference encoder: runs last long enough to be hit mid-way


def test_kill_9_of_the_whole_run_at_random_moments_with_changing_workers(
    dataset, tmp_path, small_tokenizer, small_reference
):
    # Three copies of the example (chunk1..3): enough work that no attempt finishes before its kill,
    # however quiet the machine. Each split's reference is then its example reference three times.
    for split in ("train", "validation"):
        for copy in ("chunk2", "chunk3"):
            shutil.copytree(dataset / split / "chunk1", dataset / split / copy)
    manifest = tmp_path / "m3.json"
    write_manifest(build_manifest(dataset), manifest)
    expected = {stem: np.concatenate([tokens] * 3) for stem, tokens in small_reference.items()}
    out = tmp_path / "out"
    rng = random.Random(7)
    # The moments: during start-up (before Ray is up), just after a checkpoint, and with a shard
    # finished and others partial; each plus a random delay. --workers changes on every resume.
    moments = [
        lambda: True,
        lambda: len(checkpoints(out)) >= 1,
        lambda: any(c["done"] for c in checkpoints(out)) and len(checkpoints(out)) >= 2,
    ]
    for workers, ready in zip((8, 2, 5), moments):
        proc = start(
            manifest, out, "--workers", workers, "--checkpoint-interval", "0.2", *HF, tokenizer=small_tokenizer
        )
        wait_for(lambda: ready() or proc.poll() is not None)  # noqa: B023 (called at once)
        time.sleep(rng.uniform(0.1, 1.5))
        kill_9(proc)
    assert not (out / "meta.json").exists()
    # The resume encodes with the fast backend: a shard begun by another backend continues to the same bytes.
    final = tokpipe(
        *run_args(manifest, out, "--workers", "2", "--checkpoint-interval", "0.2", tokenizer=small_tokenizer)
    )
    assert final.returncode == 0, final.stdout + final.stderr
    done, partial = map(
        int, re.search(r": 9 shards, .*; (\d+) done, (\d+) partial, \d+ to start$", final.stdout, re.M).groups()
    )
    assert done + partial > 0  # it resumed from what the killed runs left
    assert re.search(f"^{EMBEDDED_RAY_2_WORKERS}$", final.stdout, re.M), final.stdout
    assert_out_is(out, expected)
    assert cli("verify", out).returncode == 0


def test_kill_9_while_split_files_are_assembled_then_rerun_gives_the_same_bytes(
    manifest, tmp_path, small_tokenizer, small_reference
):
    out = tmp_path / "out"
    # Killed as the second train shard is to be listed: the first is in train.bin.tmp and listed in
    # train.parts.tmp, the second placed after it.
    killed_run("tokpipe.write.assembly.Assembler.placed", 2, manifest, out, "--workers", "1", tokenizer=small_tokenizer)
    assert (out / "train.parts.tmp").stat().st_size > 0
    assert not (out / "meta.json").exists() and (out / "train.bin.tmp").stat().st_size > 0
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2", tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)
    assert cli("verify", out).returncode == 0


def test_val_fraction_gives_the_same_val_bin_at_any_workers_with_a_kill_9_between(manifest, tmp_path, small_tokenizer):
    out, options = tmp_path / "out", ("--val-fraction", "0.05")
    # Killed as the second shard's checkpoint is to be written: the first train shard's is (its documents
    # placed in train and val), the second's tokens are in place.
    killed_run(
        "tokpipe.write.place.write_placed",
        2,
        manifest,
        out,
        "--workers",
        "1",
        *options,
        tokenizer=small_tokenizer,
    )
    assert any(c["documents"] for c in checkpoints(out))
    assert not (out / "meta.json").exists()
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2", *options, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    train, holdout, tokenizer = EXAMPLE_TRAIN_FILES, EXAMPLE_HOLDOUT_FILES, small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    val = np.concatenate(
        [
            reference_tokens(train, tokenizer, eos, np.uint16, keep=held_out(0.05, True)),
            reference_tokens(holdout, tokenizer, eos, np.uint16),
        ]
    )
    assert np.array_equal(np.fromfile(out / "val.bin", dtype=np.uint16), val)
    assert np.array_equal(
        np.fromfile(out / "train.bin", dtype=np.uint16),
        reference_tokens(train, tokenizer, eos, np.uint16, keep=held_out(0.05, False)),
    )
    splits = json.loads((out / "meta.json").read_text())["splits"]
    assert (
        splits["train"]["documents"] + splits["validation"]["documents"] == TRAIN_DOCUMENTS + VAL_DOCUMENTS
    )  # every document read, once
    assert cli("verify", out).returncode == 0


def test_killed_finalize_is_redone_from_the_shards(small_out, small_tokenizer, small_reference):
    out = small_out
    # What a kill -9 during finalize can leave: no meta, and a split's files halfway through their
    # renames (train.parts renamed, train.bin and train.idx not yet).
    (out / "meta.json").unlink()
    (out / "meta.pkl").unlink()
    for name in ("train.bin", "train.idx"):
        os.replace(out / name, out / f"{name}.tmp")
    result = tokpipe(*run_args(out / "manifest.json", out, tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    assert "ray:" not in result.stdout  # every shard was done: finalize only, nothing tokenized again
    assert_out_is(out, small_reference)
    assert not (out / "train.bin.tmp").exists()
    assert cli("verify", out).returncode == 0


def test_a_split_file_damaged_after_its_shards_were_removed_is_tokenized_again(
    small_out, small_tokenizer, small_reference
):
    out = small_out
    (out / "meta.json").unlink()
    (out / "meta.pkl").unlink()
    with open(out / "train.bin", "r+b") as f:
        f.truncate(4000)  # cut by something outside tokpipe: the shards' own files are gone since placed
    result = tokpipe(*run_args(out / "manifest.json", out, tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    assert (
        "tokenizing again 2 shards (e.g. train/chunk1/example_train_0.jsonl.zst): their tokens are in no file a"
        " rerun can keep (placed but not yet listed when the last run stopped, or in a split file that changed"
        " since)" in result.stdout.splitlines()
    )
    assert_out_is(out, small_reference)
    assert not (out / "train.bin.tmp").exists()
    assert cli("verify", out).returncode == 0


def _unlist_all_but_the_first_train_part(out: Path) -> None:
    """What a kill between the placing of train's later parts and their lines in .parts leaves: the shards
    buffered their tokens, so those are nowhere but in the split file, and no line lists them."""
    (out / "meta.json").unlink()
    (out / "meta.pkl").unlink()
    for name in ("train.bin", "train.idx"):
        os.replace(out / name, out / f"{name}.tmp")
    (out / "train.parts.tmp").write_bytes((out / "train.parts").read_bytes().splitlines(keepends=True)[0])
    (out / "train.parts").unlink()


def test_parts_placed_but_not_listed_when_the_run_stopped_are_kept_by_their_checksums(
    small_out, small_tokenizer, small_reference
):
    out = small_out
    _unlist_all_but_the_first_train_part(out)
    result = tokpipe(*run_args(out / "manifest.json", out, tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    assert "tokenizing again" not in result.stdout and "ray:" not in result.stdout  # nothing tokenized again
    assert_out_is(out, small_reference)
    assert cli("verify", out).returncode == 0


def test_an_unlisted_part_whose_bytes_do_not_match_its_checksum_is_tokenized_again(
    small_out, small_tokenizer, small_reference
):
    out = small_out
    _unlist_all_but_the_first_train_part(out)
    first = json.loads((out / "train.parts.tmp").read_text())
    with open(out / "train.bin.tmp", "r+b") as f:  # a byte of the second part changed under tokpipe
        f.seek(first["tokens"] * 2 + 8)  # uint16 ids
        f.write(b"\xff")
    result = tokpipe(*run_args(out / "manifest.json", out, tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    assert "tokenizing again 1 shard (e.g. train/chunk1/example_train_1.jsonl.zst)" in result.stdout
    assert_out_is(out, small_reference)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.parametrize(
    "where, size",
    [("in the driver", "3m"), ("on Ray's workers", "3m"), ("in the driver, a first shard larger than the disk", "1m")],
)
def test_disk_full_stops_the_shard_clearly_and_the_rerun_completes(
    manifest, tmp_path, small_tokenizer, small_reference, where, size, request
):
    # The disk's projection is saved before the first shard's parts are written: they may fill it (they did: the
    # projection was said, its save failed, and status had none).
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, size):
        pytest.skip("cannot mount a tmpfs here (needs root); the write-error path is also covered in test_write_shard")
    # On Ray's workers, the Placer that writes their parts into train.bin.tmp meets the full disk: its OSError was
    # printed as Ray's str of it, the Placer's traceback. There the shards finish together, as on a loaded machine.
    ray = request.getfixturevalue("ray_address") if where == "on Ray's workers" else None
    on_ray = ("--ray-only", "--workers", "2") if ray else ()
    try:
        out = disk / "out"
        args = run_args(manifest, out, "--checkpoint-interval", "0.2", *on_ray, tokenizer=small_tokenizer)
        full = gathered_run(*args, ray=ray) if ray else tokpipe(*args)
        assert full.returncode == 1
        assert "No space left on device" in full.stderr and "Traceback" not in full.stderr
        assert full.stderr.splitlines()[-1].startswith("tokpipe run: error: [Errno 28] No space left on device")
        assert not (out / "meta.json").exists()
        # Said when the first shard was done, counting what OUT did not hold yet (not only the input unread),
        # and by status with the space as it is now.
        said = re.search(r"disk: output projected at .*: (fits|WILL NOT FIT)", full.stdout)
        assert said and said[1] == "WILL NOT FIT", full.stdout
        assert re.search(r"\ndisk: .* 0\.0 kB free on OUT's file system: WILL NOT FIT", cli("status", out).stdout)
        projection = json.loads(cli("status", out, "--json").stdout)["disk"]
        assert projection["to_write_bytes"] == projection["projected_bytes"] - projection["held_bytes"] > 0
        assert projection["free_bytes"] == 0
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # space freed
        assert re.search(r"\ndisk: .* free on OUT's file system: fits\n", cli("status", out).stdout)
        rerun = tokpipe(*run_args(manifest, out, *on_ray, tokenizer=small_tokenizer), ray=ray)
        assert rerun.returncode == 0, rerun.stderr
        assert_out_is(out, small_reference)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_ctrl_c_stops_the_run_with_exit_130_and_the_same_command_resumes(
    manifest, tmp_path, small_tokenizer, small_reference
):
    # Ctrl-C in a terminal: SIGINT to the run's whole process group, the embedded Ray's processes included.
    out = tmp_path / "out"
    proc = start(manifest, out, "--workers", "1", "--checkpoint-interval", "0.2", *HF, tokenizer=small_tokenizer)
    wait_for(lambda: any(c["lines"] for c in checkpoints(out)) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert proc.log.read_text().splitlines()[-1] == "tokpipe run: interrupted; rerun the same command to resume"
    assert not (out / "meta.json").exists()
    said = stopped_as_status_says(out)
    assert said == f"{out}: stopped before finishing: no run holds it; the last one stopped: interrupted (Ctrl-C)"
    rerun = tokpipe(
        *run_args(manifest, out, "--workers", "1", "--checkpoint-interval", "0.2", tokenizer=small_tokenizer)
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)


def test_the_rerun_of_a_killed_run_says_what_checkpoints_kept_and_redid(killed_example, tmp_path, example_reference):
    out = tmp_path / "out"
    shutil.copytree(killed_example, out)
    kept = checkpoints_by_key(out)["train__chunk1__example_train_1"]["tokens"]
    written = (out / "shards" / "train" / "train__chunk1__example_train_1.bin").stat().st_size // 4
    assert 0 < kept < written  # the kill left tokens past the last checkpoint: cut, then written again
    rerun = tokpipe(*run_args(out / "manifest.json", out, "--workers", "2", "--checkpoint-interval", "1"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert (
        f"resumed 1 shard from checkpoints: {kept:,} tokens kept, {written - kept:,} tokens written after the last "
        "checkpoints redone"
    ) in rerun.stdout.splitlines()
    assert_out_is(out, example_reference)


def test_a_run_the_driver_finishes_alone_never_imports_ray(tmp_path, small_tokenizer):
    # Importing Ray costs ~0.7 CPU-s here: a run with nothing for Ray to do does not pay it.
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", ['{"text": "one document"}', '{"text": "and another"}'])
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    code = (
        "import sys, tokpipe\n"
        f"summary = tokpipe.run({str(tmp_path / 'm.json')!r}, {str(small_tokenizer)!r}, {str(tmp_path / 'out')!r})\n"
        "print(summary.finished, 'ray' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == "True False", result.stdout + result.stderr


def test_group_by_kill_9_mid_shard_then_rerun_gives_each_groups_reference_files(manifest, tmp_path, small_tokenizer):
    """--group-by: a kill -9 while a shard has written parts of some groups (one begun after its last
    checkpoint, maybe) and a rerun leave each group's file equal to the reference, and nothing else."""
    out = tmp_path / "out"
    extra = ("--group-by", GROUP_FIELD, "--checkpoint-interval", "0.2")  # the rerun's
    # --shard-buffer 0: a shard's parts go to its own files as it goes, checkpointed (as one past its buffer).
    # Batches of 64 KiB and a checkpoint after each (the interval a microsecond): killed as the first shard's
    # third checkpoint is to be written, its second written, the third batch's tokens beyond it.
    mid_shard = ("--checkpoint-interval", "0.000001", "--shard-buffer", "0")
    killed_run(
        "tokpipe.write.shard.write_atomic",
        3,
        manifest,
        out,
        "--workers",
        "1",
        "--group-by",
        GROUP_FIELD,
        *mid_shard,
        batch_bytes=64 << 10,
        tokenizer=small_tokenizer,
    )
    assert any(c["parts"] and not c["done"] for c in checkpoints(out))  # parts: its groups'
    assert not (out / "meta.json").exists()
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2", *extra, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    expected = set()
    for stem, files in (("train", EXAMPLE_TRAIN_FILES), ("val", EXAMPLE_HOLDOUT_FILES)):
        for group, (tokens, _, _) in reference_by_group(files, tokenizer, GROUP_FIELD, eos).items():
            assert np.array_equal(np.fromfile(out / stem / f"{group}.bin", dtype=np.uint16), tokens), group
            expected |= {f"{stem}/{group}.bin", f"{stem}/{group}.idx"}
    token_files = {str(p.relative_to(out)) for p in out.rglob("*") if p.suffix in (".bin", ".idx", ".tmp")}
    assert token_files == expected  # no shard's part left, no file of an earlier attempt
    assert cli("verify", out).returncode == 0


def test_a_document_too_long_for_the_backend_sample_is_passed_over_in_one_line_and_written_exactly(tmp_path):
    # The backend check reads no line over SAMPLE_LINE_BYTES (4 MiB) whole; the run still writes it, in pieces.
    words = (4 << 20) // len("word ") + 1
    lines = [{"text": "first"}, {"text": "word " * words}, {"text": "third"}]
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", [json.dumps(line) for line in lines])
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    result = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    backend = next(line for line in result.stdout.splitlines() if line.startswith("backend "))
    assert backend.endswith(
        "; the sample passed over 1 line(s) over 4 MiB (verify --sample re-encodes such documents with tokenizers)"
    )
    # "word word ... word " is "word", then " word" each, then the last space alone (tokenizers, on 3 words)
    first, again, space = reference_ids(["word word "])[0]
    expected = [*reference_ids(["first"])[0], QWEN3_EOS, first, *[again] * (words - 1), space, QWEN3_EOS]
    expected += [*reference_ids(["third"])[0], QWEN3_EOS]
    assert np.array_equal(np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32), expected)


@pytest.mark.parametrize("where", ["on Ray's workers", "in the driver"])
@pytest.mark.parametrize("out_on", ["a folder", "a store"])
def test_a_failed_shard_keeps_the_shards_done_after_it_and_the_rerun_reads_only_it(
    tmp_path, small_tokenizer, where, out_on, request, s3_server  # up before the session's Ray, whose nodes read it
):
    # Fourteen shards of the example's documents, the third a zstd download cut in half. The shards after it are
    # done but have no place in train.bin before it is fixed: they are kept in their own files (on a store, their
    # objects), so the rerun, after the fix, reads the fixed shard alone. On Ray (the session's, a cluster: its nodes
    # see the fixed shard as the driver does, not with the manifest's size, which their check once refused) they go
    # in packs of two, the failed pack's shards again one by one.
    texts = [json.dumps({"text": text}) for path in EXAMPLE_TRAIN_FILES for text in reference_texts(path)]
    data = tmp_path / "data"
    files = [write_jsonl(data / "train" / f"s{k:02d}.jsonl", texts[20 * k : 20 * k + 20]) for k in range(14) if k != 2]
    whole = zstandard.ZstdCompressor().compress("".join(f"{t}\n" for t in texts[40:60] * 3).encode())
    cut = data / "train" / "s02.jsonl.zst"
    cut.write_bytes(whole[: len(whole) // 2])
    write_manifest(build_manifest(data), tmp_path / "m.json")
    server = None if out_on == "a folder" else s3_server
    out = tmp_path / "out" if server is None else server.url(request.getfixturevalue("s3_prefix"))
    ray = ("--ray-only",) if where == "on Ray's workers" else ()
    address = request.getfixturevalue("ray_address") if ray else None
    args = run_args(tmp_path / "m.json", out, "--workers", "2", *ray, tokenizer=small_tokenizer)
    failed = tokpipe(*args, ray=address)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert failed.stderr.splitlines()[-1] == (
        "1 shard failed; the rest are kept. Fix the cause and rerun the same command to retry them."
    )
    said = cli("status", out).stdout.splitlines()
    assert "shards: 13 done, 0 partial, 0 pending, 1 failed (of 14)" in said
    assert said[-1].startswith(f"next: fix the cause of the failures above (details in {out}/logs/run.log), then: ")
    # What is kept is what `inspect` reads of the failed run: the 13 shards' tokens, in order (on a store, in their
    # segments and their kept objects).
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    kept = np.concatenate([np.asarray(f.tokens) for f in open_source(out, "train").files])
    assert np.array_equal(kept, reference_tokens(files, tokenizer, eos, np.uint16))
    if ray:
        logs = out_files(out, server)
        assert "train/s02.jsonl.zst) failed (SourceError: " in logs["logs/run.log"].decode()  # its pack
        # The failed task's second return (its shards' buffered parts) read too: Ray logged it unhandled once dropped.
        assert "Unhandled error" not in failed.stderr + logs["logs/ray.log"].decode()

    found = out_files(out, server)
    assert json.loads(found["logs/failed.json"]).keys() == {"train/s02.jsonl.zst"}
    assert not [name for name in found if name.startswith("logs/stall-")]  # none stalled: no stack dump, empty or not
    listed = cut.stat().st_size  # the shard's size in the manifest, which the progress counts it by
    cut.write_bytes(whole)
    rerun = tokpipe(*args, ray=address)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(r": 14 shards, .*; 13 done, 0 partial, 1 to start$", rerun.stdout, re.M), rerun.stdout
    phases = next(line for line in rerun.stdout.splitlines() if line.startswith("phases: "))
    assert f", {listed / 1e6:,.1f} MB of input read" in phases  # the fixed shard's bytes (each other's: 0.1 MB)
    files.insert(2, cut)
    left = out_files(out, server)
    assert np.array_equal(
        np.frombuffer(left["train.bin"], dtype=np.uint16), reference_tokens(files, tokenizer, eos, np.uint16)
    )
    assert not [name for name in left if name.startswith(("shards/", "segments/")) and name.endswith((".bin", ".idx"))]
    assert "logs/failed.json" not in left  # the last attempt's verdict: none failed
    assert cli("verify", out).returncode == 0


class _Cluster:
    """What the handover asks of runner/cluster.Cluster, on a machine of 4 cores."""

    address, fit, started = None, (4, ""), False

    def start(self):
        self.started = True

    def working(self):
        return False


@pytest.mark.parametrize(
    "core_seconds, cores, pays", [(21.4, 2, False), (25.1, 2, True), (128, 16, False), (129, 16, True)]
)
def test_ray_pays_for_work_past_its_start_and_five_times_what_its_start_costs(core_seconds, cores, pays):
    """800 MB of text on 2 cores (21.4 core-seconds at CORE_BYTES) is over 8 s a core, but Ray's start would add a
    fifth to it: no Ray. On 16 cores the 8 s a core is the bound."""
    assert driver._ray_pays(core_seconds, cores) == pays


@pytest.mark.parametrize("read_at_3s, starts", [(30 << 20, False), (10 << 20, True)])
def test_ray_starts_only_for_a_run_that_its_rate_here_says_outlasts_ray_s_start(monkeypatch, read_at_3s, starts):
    """100 MiB over 3 s: 30 MiB read leaves 7 s at that rate, under RAY_PAYS, and the run ends here with a helper a
    core but the driver's; 10 MiB leaves 27 s, and Ray starts, its start given a helper's core. Not before MEASURED
    seconds, the helpers' start still in the rate."""
    clock = [0.0]
    monkeypatch.setattr(driver, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    cluster = _Cluster()
    progress = SimpleNamespace(total=100 << 20, start_bytes=0, read_this_run=0, shards=1, done=0, done_before=0)
    handover = driver._Handover(cluster, False, 6.25, 600.0, progress, since=0.0)
    assert handover.helpers() == 3
    clock[0], progress.read_this_run = 2.9, 1 << 20
    assert handover.driver_goes_on() and not cluster.started
    clock[0], progress.read_this_run = 3.01, read_at_3s
    assert handover.driver_goes_on() and cluster.started == starts
    assert handover.helpers() == (2 if starts else 3)
    assert driver._Handover(cluster, False, 2.5, 600.0).helpers() == 2  # a second of work each at most
    assert driver._Handover(cluster, False, driver.LOCAL_SECONDS, 600.0).helpers() == 0  # the driver alone


def test_a_run_here_that_reads_and_finishes_nothing_for_the_stall_timeout_starts_ray(monkeypatch):
    """A helper stuck in a shard, the rest done: the run's rate says it is short, but nothing has moved for
    --stall-timeout (60 s here), so Ray starts, to take the shard from the helper and watch it."""
    clock = [0.0]
    monkeypatch.setattr(driver, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    cluster = _Cluster()
    progress = SimpleNamespace(total=100 << 20, start_bytes=0, read_this_run=99 << 20, shards=4, done=3, done_before=0)
    handover = driver._Handover(cluster, False, 6.25, 60.0, progress, since=0.0)
    for clock[0] in (3.5, 30.0, 63.0):
        assert handover.driver_goes_on() and not cluster.started  # 60 s since it last moved, at 3.5 s: not yet
    clock[0] = 63.6
    assert handover.driver_goes_on() and cluster.started


def test_a_rerun_of_a_finished_out_starts_neither_ray_nor_helpers(monkeypatch, small_out, small_tokenizer):
    """Its manifest made to look like hours of work (CORE_BYTES of 1 byte): the run it finished would start Ray and
    a helper a core; its rerun, finding it finished, starts none, and says so."""
    started = []
    monkeypatch.setattr(driver, "CORE_BYTES", 1)
    monkeypatch.setattr(driver.Cluster, "start", lambda cluster: started.append("ray"))
    monkeypatch.setattr(driver, "Helpers", lambda *args: started.append("helpers"))
    assert driver._ray_pays(driver._core_seconds(100, 1), 16)  # what the manifest's 100s of KB would say
    said = []
    summary = driver.run(small_out / "manifest.json", small_tokenizer, small_out, tell=said.append)
    assert summary.finished and started == []
    assert said[-1].text.startswith(f"{small_out} is already finished (")
