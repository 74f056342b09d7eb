"""The Python API (tokpipe/__init__.py) mirrors the commands: build_manifest, run, verify, open_output (whose
own behaviour is documented in test_read_output.py), with run's options by the names RunOptions gives them."""

import json
import subprocess
import sys

import pytest
from helpers import EXAMPLE_CACHE, assert_out_is

import tokpipe
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import load_manifest


def test_api_mirrors_the_commands(out, tmp_path, capsys, monkeypatch):
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
    # A manifest is written on this machine: a URL was a folder `s3:` in the current one (the CLI refuses it too).
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^s3://tok/m.json is on an object store: write the manifest on this machine$"):
        tokpipe.build_manifest(EXAMPLE_CACHE, "s3://tok/m.json")
    assert not (tmp_path / "s3:").exists()


def test_a_caller_connected_to_ray_runs_on_its_ray_and_keeps_it(
    manifest, tmp_path, small_tokenizer, small_reference, ray_address
):
    # A notebook or a Ray job that called ray.init: tokpipe.run refused ("Maybe you called ray.init twice by
    # accident?"). Its Ray is used as it is, and left up for the caller's next call.
    out = tmp_path / "out"
    code = (
        "import ray, sys, tokpipe\n"
        f"ray.init(address={ray_address!r}, logging_level='ERROR')\n"
        "heard = []\n"
        f"summary = tokpipe.run({str(manifest)!r}, {str(small_tokenizer)!r}, {str(out)!r}, workers=2, ray_only=True,"
        " tell=heard.append)\n"
        "print(summary.finished, ray.get(ray.remote(lambda: 'up').remote()))\n"
        "print(*[said for said in map(str, heard) if said.startswith('ray:')])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-2:] == [
        "True up",
        f"ray: cluster {ray_address} (this process's ray.init), 2 workers",
    ], result.stdout + result.stderr
    assert_out_is(out, small_reference)
