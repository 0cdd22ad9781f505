"""vLLM tests run in their own environment (scripts/test.sh builds it) on the CPU build."""

pytest_plugins = ["rollout.testing.fixtures"]

import importlib.util
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

CACHE = Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout")) / "vllm"
# A small KV cache on CPU; compiled kernels kept between runs; nothing from a hub.
for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
                   "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "inductor")}.items():
    os.environ.setdefault(key, value)

# Test-only: vLLM's Qwen2-VL module imports torchvision, absent from the CPU build
# (cpu/sitecustomize.py says how it stands in). Here, and on PYTHONPATH for vLLM's child
# processes (its engine core, its server).
CPU = Path(__file__).parent / "cpu"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU),
                                                        os.environ.get("PYTHONPATH")]))
_spec = importlib.util.spec_from_file_location("_rollout_vllm_cpu_site", CPU / "sitecustomize.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

# float32 and eager mode: the tiny model's outputs then match the HF backend's.
ENGINE = {"dtype": "float32", "enforce_eager": True}


class Lent:
    """A backend lent to a module: everything is the backend's, but closing it leaves it
    running for the next module; the session closes it at its end."""

    def __init__(self, ro):
        self._ro = ro

    def __getattr__(self, name):
        return getattr(self._ro, name)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture(scope="session")
def shared_vllm(tiny_model):
    """`shared_vllm(mode)`: one tiny-model engine per mode (ENGINE's settings, nothing
    else) for the modules that only sample from it and leave its weights alone. An engine
    start costs 15-40 s of CI's two cores."""
    import rollout

    started = {}

    def lend(mode: str) -> Lent:
        if mode not in started:
            started[mode] = rollout.load_backend("vllm", model=str(tiny_model), mode=mode,
                                                 **ENGINE)
        return Lent(started[mode])

    yield lend
    for ro in started.values():
        ro.close()
