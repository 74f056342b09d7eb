"""output: open_output reads a finished OUT as a trainer does (meta, read-only memmaps of each split and its
document ends), and refuses an OUT that is unfinished or does not match its meta."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import QWEN3_EOS, QWEN3_VOCAB, cli, hand_made_out

import tokpipe
from tokpipe.commands.inspect import inspect
from tokpipe.data import Sequences
from tokpipe.errors import UserError


def test_open_output_gives_meta_and_read_only_memmaps(finished_example):
    data = tokpipe.open_output(finished_example)
    assert data.meta == json.loads((finished_example / "meta.json").read_text())
    assert data.vocab_size == QWEN3_VOCAB and data.eos_id == QWEN3_EOS and data.dtype == np.uint32
    assert set(data.splits) == {"train", "validation"}
    train = data.splits["train"]
    assert isinstance(train.tokens, np.memmap) and train.tokens.dtype == np.uint32 and not train.tokens.flags.writeable
    assert np.array_equal(train.tokens, np.fromfile(finished_example / "train.bin", dtype=np.uint32))
    assert np.array_equal(train.ends, np.fromfile(finished_example / "train.idx", dtype="<i8"))
    assert len(train.ends) == data.meta["splits"]["train"]["documents"]
    first, last = train.document(0), train.document(len(train.ends) - 1)
    assert first[-1] == last[-1] == QWEN3_EOS and QWEN3_EOS not in first[:-1]
    with pytest.raises(ValueError):
        train.tokens[0] = 1


def test_open_output_refuses_unfinished_and_mismatched_outputs(killed_example, out):
    with pytest.raises(UserError, match="tokpipe status"):
        tokpipe.open_output(killed_example)
    with open(out / "val.bin", "ab") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(UserError, match="val.bin holds .* meta says"):
        tokpipe.open_output(out)


def test_a_grouped_split_is_its_groups_one_after_the_other_in_the_order_of_their_values(
    finished_grouped, grouped_reference
):
    """--group-by: open_output gives each split as its groups in meta's order (sorted by value), and each
    group alone in `groups`."""
    data = tokpipe.open_output(finished_grouped)
    for name, stem in (("train", "train"), ("validation", "val")):
        split, reference = data.splits[name], grouped_reference[stem]
        assert list(split.groups) == sorted(reference) == list(data.meta["splits"][name]["groups"])
        whole = np.concatenate([tokens for tokens, _, _ in reference.values()])
        assert np.array_equal(split.tokens[:], whole)
        assert len(split.ends) == sum(documents for _, documents, _ in reference.values())
        for group, (tokens, documents, _) in reference.items():
            alone = split.groups[group]
            assert np.array_equal(alone.tokens[:], tokens) and len(alone.ends) == documents
            assert np.array_equal(alone.document(documents - 1)[-1:], [QWEN3_EOS])


@pytest.fixture(params=["in a folder", "on a store"])
def unfinished(request, out) -> tuple[str, str]:
    """An unfinished OUT, and the meta it lacks first: in a folder, one killed between its two metas (meta.json is the
    last file a run writes); on the session's S3 server, one killed as its finish began (unfinished_stored)."""
    if request.param == "on a store":
        return request.getfixturevalue("unfinished_stored"), "meta.pkl"
    (out / "meta.json").unlink()
    return str(out), "meta.json"


def test_an_unfinished_out_is_unfinished_to_every_reader_named_as_the_user_names_it(unfinished, tmp_path):
    """Without meta.json OUT is not finished, to open_output (which read meta.pkl alone, and opened it), export,
    verify, the loader, inspect and status alike. An OUT on a store is named by its URL, never by the temporary
    folder its records are copied into."""
    out, lacking = unfinished
    message = f"{out} is not a finished tokpipe output (no meta.json): see where it stands with tokpipe status {out}"
    with pytest.raises(UserError) as refused:
        tokpipe.open_output(out)
    assert str(refused.value) == message
    exported = cli("export", out, "--format", "llmc", "--dest", tmp_path / "llmc")
    assert (exported.returncode, exported.stderr) == (2, f"tokpipe export: error: {message}\n")
    verified = cli("verify", out)
    assert (verified.returncode, verified.stdout.splitlines()[-2]) == (
        1,
        f"FAIL  {lacking} present  ({out}/{lacking} is missing: the run has not finished (tokpipe status {out}))",
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Sequences(out, "train", 8, cache_dir=tmp_path / "cache")
    assert not inspect(out, n=0).source.finished
    assert cli("status", out).stdout.startswith(f"{out}: stopped before finishing")


def test_a_file_unlike_its_meta_is_refused_in_one_message_by_every_reader(out):
    """open_output (a UserError: one line, exit 2) and the loader (a ValueError) say the same thing of it."""
    with open(out / "val.bin", "ab") as f:
        f.write(b"\0\0\0\0")
    said = (
        f"{out}/val.bin holds 1,215,860 bytes, meta says 303,964 tokens of 4 bytes: the file is not the one meta "
        f"describes (tokpipe verify {out})"
    )
    for reader in (tokpipe.open_output, lambda out: Sequences(out, "validation")):
        with pytest.raises(UserError) as refused:
            reader(out)
        assert isinstance(refused.value, ValueError) and str(refused.value) == said


UNDER_ULIMIT = """
import json, resource, sys
import numpy as np
import tokpipe
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
train = tokpipe.open_output(sys.argv[1]).splits["train"]
documents = [train.document(i).tolist() for i in range(len(train.ends))]
checks = tokpipe.verify(sys.argv[1], jobs=2)
print(json.dumps({"documents": documents, "failed": [c.name for c in checks if not c.ok], "checks": len(checks)}))
"""


def test_a_split_of_300_files_opens_and_verifies_under_ulimit_64(tmp_path):
    """open_output held a memmap per file and per index, each with a descriptor: 600 for a --no-concat split of
    300 files, which `ulimit -n 64` refused (EMFILE). Through the one reader it holds none."""
    rng = np.random.default_rng(8)
    lengths = [rng.integers(1, 30, 3) for _ in range(300)]
    out, tokens, ends = hand_made_out(tmp_path / "out", lengths, concat=False)
    read = subprocess.run([sys.executable, "-c", UNDER_ULIMIT, str(out)], capture_output=True, text=True)
    assert read.returncode == 0, read.stderr
    found = json.loads(read.stdout)
    assert found["documents"] == [tokens[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends)]
    assert found["failed"] == [] and found["checks"] == 17
