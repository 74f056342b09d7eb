"""The Python API (tokpipe/__init__.py) mirrors the commands: build_manifest, run, verify, open_output (whose
own behaviour is documented in test_read_output.py), with run's options by the names RunOptions gives them."""

import json

import pytest
from helpers import EXAMPLE_CACHE

import tokpipe
from tokpipe.inputs.manifest import load_manifest


def test_api_mirrors_the_commands(out, tmp_path, capsys):
    manifest = tokpipe.build_manifest(EXAMPLE_CACHE, tmp_path / "m.json")
    assert load_manifest(tmp_path / "m.json").fingerprint == manifest.fingerprint and manifest.counts == {
        "train": 2,
        "validation": 1,
    }
    assert all(check.ok for check in tokpipe.verify(out))
    # A finished OUT: run returns at once (no Ray), and options reach RunOptions by name.
    summary = tokpipe.run(
        tmp_path / "m.json", json.loads((out / "run.json").read_text())["tokenizer_path"], out, workers=1
    )
    assert summary.finished and summary.meta == tokpipe.open_output(out).meta
    assert capsys.readouterr() == ("", "")  # a library caller hears nothing it did not ask for
    heard, tokenizer = [], json.loads((out / "run.json").read_text())["tokenizer_path"]
    tokpipe.run(tmp_path / "m.json", tokenizer, out, workers=1, tell=heard.append)
    assert [str(said) for said in heard] == [
        f"{out} is already finished ({out / 'meta.json'}); nothing to do. Check it with: tokpipe verify {out}"
    ]
    assert json.loads((out / "run.json").read_text())["options"] == {"workers": 1}
    with pytest.raises(TypeError):
        tokpipe.run(tmp_path / "m.json", "t", tmp_path / "o", no_such_option=1)
