"""tokenizer: vocab/eos/dtype resolved as a trainer needs them, from a folder, a file or a hub name in the cache."""

import hashlib
import json
import os
import shutil

import huggingface_hub.constants
import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_TRAIN_FILES,
    QWEN3,
    QWEN3_EOS,
    assert_out_is,
    cli,
    reference_texts,
    run_args,
    tokpipe,
)

from tokpipe.errors import UserError
from tokpipe.inputs.tokenizer import dtype_for, load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.runner.identity import check_options

GIGATOKEN_REORDERS = "\U00010d27\U00010f46"  # the hard case gigatoken 0.10 gets wrong
TOKENIZER_JSON = str(QWEN3 / "tokenizer.json")


def test_qwen3_info_matches_transformers():
    from transformers import AutoTokenizer  # 1.7 s to import: paid by the test that uses it, not by collection

    info = load_tokenizer_info(QWEN3)
    hf = AutoTokenizer.from_pretrained(str(QWEN3), local_files_only=True, trust_remote_code=False)
    assert info.vocab_size == len(hf) == 151669  # base vocabulary plus added tokens, not 151,643 nor 50,304
    assert info.eos_token == hf.eos_token == "<|endoftext|>"
    assert info.eos_id == hf.eos_token_id == QWEN3_EOS
    assert info.bos_id is None
    assert info.dtype == "uint32"  # "Phantom Zero": uint16 would wrap every id >= 65536
    assert info.id.startswith("qwen3@sha256:") and len(info.sha256) == 64


@pytest.mark.parametrize(
    "vocab, dtype", [(256, "uint16"), (65535, "uint16"), (65536, "uint16"), (65537, "uint32"), (151669, "uint32")]
)
def test_dtype_is_the_smallest_that_holds_every_id(vocab, dtype):
    assert dtype_for(vocab) == dtype


def test_missing_tokenizer_and_unknown_eos_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no tokenizer at"):
        load_tokenizer_info(tmp_path)
    with pytest.raises(UserError, match="not in the tokenizer's vocabulary"):
        load_tokenizer_info(QWEN3, eos_token="<|nope|>")
    assert load_tokenizer_info(QWEN3 / "tokenizer.json", eos_token="<|im_end|>").eos_id == 151645
    # What a user may mean: a SentencePiece model (Llama 2's original checkpoint), nanoGPT's tiktoken name.
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0e")
    with pytest.raises(UserError, match=r"\(.* holds tokenizer.model, a SentencePiece model: transformers writes its"):
        load_tokenizer_info(tmp_path)
    with pytest.raises(UserError, match=r"\(tiktoken's gpt2, as nanoGPT's prepare.py encodes, is the hub's openai-"):
        load_tokenizer_info("gpt2")


# -- hub tokenizer --------------------------------------------------------------------------------------------
# --tokenizer ORG/NAME: found offline in the local Hugging Face cache (huggingface_hub's own resolution of
# HF_HUB_CACHE, refs/ and snapshots/), recorded in meta; a name not in the cache is one line, exit 2.


MAIN = "a" * 40  # commits of the fake repository: refs/main, and refs/v1 (an older tokenizer_config)
OLD = "b" * 40
QWEN3_SHA256 = hashlib.sha256((QWEN3 / "tokenizer.json").read_bytes()).hexdigest()


def fake_hub_cache(root, repo_id="Qwen/Qwen3-0.6B"):
    """A Hugging Face cache as `hf download` leaves it: blobs named by their sha256, snapshots/<commit>/
    symlinks into them, refs/<branch or tag> holding a commit (no newline, as huggingface_hub writes it)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for commit, ref in ((MAIN, "main"), (OLD, "v1")):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            data = (QWEN3 / name).read_bytes()
            if commit == OLD and name == "tokenizer_config.json":
                data = json.dumps({**json.loads(data), "eos_token": "<|im_end|>"}).encode()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The fake cache, where huggingface_hub looks: HF_HUB_CACHE for the CLI's processes, its constant here."""
    cache = fake_hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_name_resolves_to_its_snapshot_in_the_cache(hub_cache):
    info = load_tokenizer_info("Qwen/Qwen3-0.6B")
    snapshot = hub_cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / MAIN
    assert (info.repo_id, info.revision, info.sha256) == ("Qwen/Qwen3-0.6B", MAIN, QWEN3_SHA256)
    assert info.path == str(snapshot / "tokenizer.json")  # the snapshot's path (its config is beside it)
    assert info.id.startswith("Qwen/Qwen3-0.6B@sha256:") and info.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("revision", ["v1", OLD])
def test_a_tag_or_a_commit_picks_that_snapshot(hub_cache, revision):
    info = load_tokenizer_info("Qwen/Qwen3-0.6B", revision=revision)
    assert info.revision == OLD and info.eos_token == "<|im_end|>"  # read from that snapshot's config


def test_a_local_folder_wins_over_a_hub_name(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "work"
    shutil.copytree(QWEN3, local / "Qwen" / "Qwen3-0.6B")
    monkeypatch.chdir(local)
    info = load_tokenizer_info("Qwen/Qwen3-0.6B")
    assert (info.repo_id, info.revision) == (None, None)
    assert info.path == str((local / "Qwen" / "Qwen3-0.6B" / "tokenizer.json").resolve())
    with pytest.raises(UserError, match="--tokenizer-revision picks a revision of a hub name ORG/NAME"):
        load_tokenizer_info("Qwen/Qwen3-0.6B", revision="v1")


def test_a_snapshot_folder_is_that_hub_tokenizer(hub_cache):
    # What `tokpipe status` prints to resume a hub run (run.json's tokenizer_path) is the same tokenizer.
    snapshot = hub_cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / MAIN
    assert load_tokenizer_info(snapshot / "tokenizer.json") == load_tokenizer_info("Qwen/Qwen3-0.6B")
    # ... also with the --tokenizer-revision that run.json recorded (the path wins: its commit is recorded).
    assert load_tokenizer_info(snapshot, revision="v1").revision == MAIN


def test_a_name_not_in_the_cache_says_where_it_looked_and_how_to_fetch_it(hub_cache):
    with pytest.raises(UserError) as e:
        load_tokenizer_info("meta-llama/Llama-3.2-1B", revision="v2")
    assert str(e.value) == (
        f"no tokenizer meta-llama/Llama-3.2-1B (revision v2) in the Hugging Face cache {hub_cache} (set by "
        "HF_HUB_CACHE or HF_HOME), and no local folder of that name: fetch it with `hf download "
        "meta-llama/Llama-3.2-1B --revision v2 --include 'tokenizer*'`; tokpipe never downloads"
    )
    with pytest.raises(UserError, match=r"revision nope\) in the Hugging Face cache"):
        load_tokenizer_info("Qwen/Qwen3-0.6B", revision="nope")


def test_run_refuses_a_name_not_in_the_cache_in_one_line(hub_cache, tmp_path):
    manifest = tmp_path / "m.json"
    assert cli("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", manifest).returncode == 0
    result = tokpipe("run", "--manifest", manifest, "--tokenizer", "Qwen/Qwen2.5-7B", "--out", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr == (
        f"tokpipe run: error: no tokenizer Qwen/Qwen2.5-7B (revision main) in the Hugging Face cache {hub_cache} "
        "(set by HF_HUB_CACHE or HF_HOME), and no local folder of that name: fetch it with `hf download "
        "Qwen/Qwen2.5-7B --include 'tokenizer*'`; tokpipe never downloads\n"
    )


def test_a_chat_model_s_turn_end_is_no_document_end_unless_asked(hub_cache, tmp_path):
    # Revision v1's tokenizer_config.json is a chat model's, as Qwen3-0.6B's (eos <|im_end|>); Qwen3-0.6B-Base's
    # names <|endoftext|>. Pretraining documents ended with a turn's end would be a chat format the model never had.
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", manifest).returncode == 0
    chat = ("--tokenizer", "Qwen/Qwen3-0.6B", "--tokenizer-revision", "v1")
    refused = cli("run", "--manifest", manifest, *chat, "--out", out)
    assert (refused.returncode, refused.stderr) == (
        2,
        "tokpipe run: error: Qwen/Qwen3-0.6B is a chat model's tokenizer: its eos '<|im_end|>' ends a chat turn, and"
        " its base model's texts end with '<|endoftext|>': pass --eos '<|endoftext|>' to end documents so, or --eos"
        " '<|im_end|>' to end them with the turn's end\n",
    )
    assert not out.exists()
    # Either, asked for, is taken as it is.
    for eos in ("<|endoftext|>", "<|im_end|>"):
        info = load_tokenizer_info("Qwen/Qwen3-0.6B", eos_token=eos, revision="v1")
        assert (info.eos_token, info.text_end) == (eos, None)
    assert load_tokenizer_info("Qwen/Qwen3-0.6B", revision="v1").text_end == "<|endoftext|>"
    assert load_tokenizer_info("Qwen/Qwen3-0.6B").text_end is None  # main: a base model's config


def test_a_bos_the_tokenizer_places_before_every_text_is_placed_or_left_out_only_when_asked(
    small_tokenizer, manifest, tmp_path
):
    # Llama's, Mistral's and Gemma's tokenizer.json place a BOS before every text, as their model reads text:
    # documents written without it, unasked, would train a model on texts unlike any it is given.
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import AutoTokenizer

    llama, out = tmp_path / "llama-style", tmp_path / "out"
    tok = Tokenizer.from_file(str(small_tokenizer / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 600)])
    llama.mkdir()
    tok.save(str(llama / "tokenizer.json"))
    (llama / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))  # names no bos_token
    info = load_tokenizer_info(llama)
    assert (info.text_start, info.bos_token, info.bos_id) == ("<s>", "<s>", 600)
    refused = cli(*run_args(manifest, out, tokenizer=llama))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"tokpipe run: error: {llama} places '<s>' before every text it encodes, as its model will read text: pass"
        " --bos to place it before each document, or --no-bos to leave it out\n",
    )
    both = cli(*run_args(manifest, out, "--bos", "--no-bos", tokenizer=llama))
    assert both.stderr.endswith("--bos places a BOS before every document and --no-bos none: pass one of them\n")
    assert not out.exists()
    check_options(RunOptions(no_bos=True), info, llama)  # taken as asked
    assert load_tokenizer_info(small_tokenizer).text_start is None  # a GPT-2- or Qwen-style tokenizer places none

    # With --bos, each document is what transformers' `tokenizer(text)` gives, then EOS.
    ran = tokpipe(*run_args(manifest, out, "--bos", tokenizer=llama))
    assert ran.returncode == 0, ran.stderr
    assert "bos '<s>' = 600 before each document, eos '<|endoftext|>' = 0 after it" in ran.stdout
    hf = AutoTokenizer.from_pretrained(str(llama))
    texts = [text for path in EXAMPLE_TRAIN_FILES for text in reference_texts(path)]
    expected = [id for ids in hf(texts)["input_ids"] for id in ids + [hf.convert_tokens_to_ids("<|endoftext|>")]]
    assert np.fromfile(out / "train.bin", dtype=np.uint16).tolist() == expected


def test_run_with_a_hub_name_records_repo_and_commit_in_meta(hub_cache, tmp_path, example_reference):
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", manifest).returncode == 0
    run = tokpipe(
        "run", "--manifest", manifest, "--tokenizer", "Qwen/Qwen3-0.6B", "--tokenizer-revision", "main", "--out", out
    )
    assert run.returncode == 0, run.stderr
    assert "tokenizer Qwen/Qwen3-0.6B@sha256:" in run.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["tokenizer_repo_id"], meta["tokenizer_revision"], meta["tokenizer_sha256"]) == (
        "Qwen/Qwen3-0.6B",
        MAIN,
        QWEN3_SHA256,
    )
    snapshot_json = hub_cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / MAIN / "tokenizer.json"
    assert json.loads((out / "run.json").read_text())["tokenizer_path"] == str(snapshot_json)
    assert_out_is(out, example_reference)
    assert cli("verify", out).returncode == 0
