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
