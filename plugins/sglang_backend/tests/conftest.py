"""SGLang tests run in their own environment (scripts/test.sh builds it) on the PyPI wheel,
which is a CUDA build, on a machine without a GPU. Test-only CPU scaffolding, set up here
before any engine starts:

- `cpu/libcuda_stub.c`, built with gcc into the cache: SGLang's kernel library links against
  libcuda.so.1 and does not load without one. Its folder goes on LD_LIBRARY_PATH for the
  engine's processes (server and scheduler processes are started after this, so they see
  it). This pytest process started before that, and the dynamic loader reads
  LD_LIBRARY_PATH only at start-up, so for the in-process engine the stub is also loaded
  here by path: a later dlopen of libcuda.so.1 then finds it loaded (same soname). No
  re-exec of pytest is needed.
- `cpu/sitecustomize.py`: makes torch.get_device_module() return torch.cpu without CUDA
  (SGLang's memory release otherwise fails). On PYTHONPATH for child processes, and loaded
  here for this one.
- OMP_NUM_THREADS=1: with two cores, one busy process and OpenMP's default spinning threads
  slow decoding down twentyfold.
"""

import ctypes
import importlib.util
pytest_plugins = ["rollout.testing.fixtures"]

import os
import subprocess
from pathlib import Path

import pytest

from rollout.testing.contract import (
    check_it_kept_what_was_held_back,
    on_engine_loop,
    stopped_beside_a_stream,
)

pytest.importorskip("sglang", reason="SGLang is not installed in this environment")

HERE = Path(__file__).parent / "cpu"
CACHE = Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout")) / "sglang"


def _build_stub() -> Path:
    out = CACHE / "libcuda" / "libcuda.so.1"
    source = HERE / "libcuda_stub.c"
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1",
                        "-o", str(tmp), str(source)], check=True, timeout=120)
        tmp.replace(out)
    return out


def _prepend(key: str, path: Path) -> None:
    old = os.environ.get(key)
    os.environ[key] = str(path) + (os.pathsep + old if old else "")


STUB = _build_stub()
_prepend("LD_LIBRARY_PATH", STUB.parent)
_prepend("PYTHONPATH", HERE)
for key, value in {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ[key] = value
ctypes.CDLL(str(STUB), mode=ctypes.RTLD_GLOBAL)
_spec = importlib.util.spec_from_file_location("_rollout_sglang_cpu_site", HERE / "sitecustomize.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

# float32: the tiny model's outputs then match the HF backend's. KV room for the contract's
# 64 long sequences (70 MB for the tiny model): with less, SGLang queues a short request
# behind them, and the test of concurrent calls would measure the pool, not the backend.
ENGINE = {"dtype": "float32", "max_total_tokens": 64 * 2048 + 4096}


class KeepsWhatSGLangHeldBack:
    """A contract test class's test, in both modes."""

    def test_an_aborted_request_keeps_what_sglang_held_back(self, harness):
        """A caller that does not stream gets its tokens 16 at a time (`stream_interval`);
        an abort (and a "keep" update, which stops requests the same way) still gets every
        token SGLang made, not only those handed over, so none is lost or made again; each
        of `n` samples too (read on a task each). Measured against a stream of the same
        greedy request beside it, aborted at once."""
        greedy = {"prompt": "the ka lo", "sampling": {
            "max_tokens": harness.max_model_len - 16, "ignore_eos": True, "top_k": 1,
            "logprobs": 0, "n": 2}}
        quiet, streamed = on_engine_loop(stopped_beside_a_stream(harness.rollout, greedy))
        check_it_kept_what_was_held_back(quiet, streamed)
