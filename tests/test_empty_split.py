"""A split whose lines were read but none became a document is an error, not a run of 0 tokens: one
line naming the split, its lines, its skip reasons and --text-field; exit 2; no meta (OUT unfinished)."""

import json

import pytest
from helpers import QWEN3, cli, tokpipe, unguarded, write_jsonl

from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.runner.identity import encode_spec
from tokpipe.write.finalize import finalize
from tokpipe.write.shard import tokenize_shard

INFO = load_tokenizer_info(QWEN3)
CODE = [json.dumps({"content": f"def f{i}():\n    return {i}\n", "lang": "python"}) for i in range(3)]
PROSE = [json.dumps({"text": f"Document number {i} is plain prose."}) for i in range(4)]


def tokenized(tmp_path, shards: dict[str, list[str]], options=RunOptions(), skip=()):
    """OUT with the dataset's shards tokenized (those named in `skip` never ran), nothing assembled."""
    for relpath, lines in shards.items():
        write_jsonl(tmp_path / "data" / relpath, lines)
    manifest = build_manifest(tmp_path / "data")
    out = tmp_path / "out"
    spec = unguarded(encode_spec(options, INFO, "hf"))
    for shard in manifest.shards():
        if shard.relpath not in skip:
            tokenize_shard(shard, out, spec)
    return out, manifest


def test_a_split_of_lines_without_documents_is_refused_and_meta_not_written(tmp_path):
    out, manifest = tokenized(tmp_path, {"train/code.jsonl": CODE, "validation/prose.jsonl": PROSE})
    with pytest.raises(UserError) as e:
        finalize(out, manifest, INFO, RunOptions().output)
    assert str(e.value) == (
        "split train: 3 lines read, none became a document (skipped: no_text 3): is the text in another field "
        f"than 'text'? Rerun with --text-field FIELD and a new --out; the first skipped lines are in "
        f"{out / 'logs' / 'skipped.json'}"
    )
    assert not (out / "meta.json").exists() and not (out / "meta.pkl").exists()
    # Finalizing again (a rerun of the same command) says the same, and still writes no meta.
    with pytest.raises(UserError, match="split train: 3 lines read, none became a document"):
        finalize(out, manifest, INFO, RunOptions().output)
    assert not (out / "meta.json").exists()


def test_every_empty_split_is_named_in_the_one_line(tmp_path):
    out, manifest = tokenized(tmp_path, {"train/code.jsonl": CODE, "validation/code.jsonl": CODE[:1] + ["", "{"]})
    with pytest.raises(UserError) as e:
        finalize(out, manifest, INFO, RunOptions().output)
    assert str(e.value).startswith(
        "split train: 3 lines read, none became a document (skipped: no_text 3); split validation: 3 lines read, "
        "none became a document (skipped: blank 1, invalid_json 1, no_text 1): is the text in another field "
    )


def test_a_split_left_empty_by_skip_failed_still_finishes(tmp_path):
    # Its only shard failed and was excluded: no line of it was read (lines 0), so nothing is refused.
    out, manifest = tokenized(
        tmp_path, {"train/prose.jsonl": PROSE, "validation/prose.jsonl": PROSE}, skip={"validation/prose.jsonl"}
    )
    excluded = {"validation/prose.jsonl": "SourceError: truncated"}
    meta = finalize(out, manifest, INFO, RunOptions().output, excluded=excluded)
    assert meta["splits"]["validation"]["lines"] == 0 and meta["splits"]["validation"]["documents"] == 0
    assert meta["splits"]["train"]["documents"] == 4 and (out / "meta.json").exists()


def test_a_train_split_whose_documents_all_went_to_val_is_not_empty(tmp_path):
    # --val-fraction near 1: every train document is held out for val.bin; they are documents all the same.
    options = RunOptions(val_fraction=0.999999)
    out, manifest = tokenized(tmp_path, {"train/prose.jsonl": PROSE}, options)
    meta = finalize(out, manifest, INFO, options.output)
    train, val = meta["splits"]["train"], meta["splits"]["validation"]
    assert (train["lines"], train["documents"], train["held_out"], val["documents"]) == (4, 0, 4, 4)


def test_run_says_it_in_one_line_and_exits_2(tmp_path, small_tokenizer):
    # The validation split holds lines whose text is empty: read, counted, and none a document.
    write_jsonl(tmp_path / "data" / "train" / "prose.jsonl", PROSE)
    write_jsonl(tmp_path / "data" / "validation" / "empty.jsonl", [json.dumps({"text": ""})] * 2)
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", tmp_path / "data", "-o", manifest).returncode == 0
    # A process of its own, as every run that tokenizes: on a loaded machine the driver may start Ray, whose
    # stop takes over stderr and would end an in-process caller's Ray under it (an xdist worker crashed so).
    # The 600-id tokenizer: Qwen3's load would be most of the run's CPU.
    run = tokpipe("run", "--manifest", manifest, "--tokenizer", small_tokenizer, "--out", out, "--workers", "1")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.splitlines()[-1] == (
        "tokpipe run: error: split validation: 2 lines read, none became a document (skipped: empty_text 2): is the "
        "text in another field than 'text'? Rerun with --text-field FIELD and a new --out; the first skipped lines "
        f"are in {out / 'logs' / 'skipped.json'}"
    )
    assert "Traceback" not in run.stderr and not (out / "meta.json").exists()
    assert cli("status", out).stdout.startswith(f"{out}: stopped before finishing")  # not finished
