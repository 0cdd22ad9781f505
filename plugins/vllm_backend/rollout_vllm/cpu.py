"""Engine settings for vLLM's CPU build (0.32) that keep it up beside other work.

- The KV cache: vLLM on CPU asks for `gpu_memory_utilization` (0.92) of the node's whole
  memory and fails at start-up when other processes hold part of it. Unless the caller
  sized the cache (`kv_cache_memory_bytes`, `gpu_memory_utilization`, or
  VLLM_CPU_KVCACHE_SPACE), it is sized here from the memory free now, with a cap.
- Chunked prefill is off unless the caller sets it: on CPU, a seeded request whose prompt
  is prefilled in chunks kills the engine ("CPU Generator does not use offset"), and with
  it every request in flight.
- Threads: vLLM's `auto` binding keeps one core for its engine core's busy loop and binds
  the model's OpenMP threads to the others. On a machine of two cores that halves the
  model's compute, and the worker's threads, all on one core, stall each other for seconds
  at a time (docs/serve-profile.md). There the threads are left unbound (`nobind`): on
  SmolLM2, 192-206 against 155-157 tokens/s and a TTFT p50 of 3.0-3.2 against 5.2 s
  (`bench/serve_runs.py`). On more cores, or where the user chose
  (VLLM_CPU_OMP_THREADS_BIND), vLLM's binding stays. Either way the threads keep to the
  cores this process may use, so a replica started on a share of them keeps to it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from rollout.kit.process import usable_cores

log = logging.getLogger("rollout.vllm")

KV_SHARE = 0.5  # of the memory available when the engine starts
KV_CAP_BYTES = 4 * 2**30
SIZED_BY = ("kv_cache_memory_bytes", "gpu_memory_utilization")


def cpu_engine_args(engine_args: dict) -> dict:
    """`engine_args` with the settings above, on CPU, where the caller set none."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return engine_args
    return kv_cache_args({"enable_chunked_prefill": False, **engine_args})


SMALL_MACHINE_CORES = 2  # or fewer: vLLM's OpenMP threads left unbound


def cpu_thread_binding() -> None:
    """On a CPU machine of SMALL_MACHINE_CORES usable cores or fewer, unless the user chose
    a binding, vLLM's OpenMP threads are left unbound (the module's docstring says why).
    Set in this process's environment, which vLLM's engine processes inherit."""
    from vllm.platforms import current_platform

    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not current_platform.is_cpu():
        return
    if usable_cores() <= SMALL_MACHINE_CORES:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"


# Fewer parameters: one OpenMP thread, where threads are unbound. Measured with the tiny
# model's shape widened (docs/serve-profile.md): one thread gave 0.95-1.8x the tokens/s of two
# up to 6.0M parameters, two gave 1.09x at 10.3M and 1.2-1.3x on SmolLM2 (134.5M).
SMALL_MODEL_PARAMETERS = 8_000_000


@contextmanager
def engine_threads(parameters: int | None):
    """While vLLM starts its engine's processes, which inherit this environment: one OpenMP
    thread for a model of fewer than SMALL_MODEL_PARAMETERS `parameters` (None: not known,
    as without safetensors files), too little work a step to share between threads while
    the engine core's loop takes a core, where `cpu_thread_binding` left the threads unbound
    and the user set no OMP_NUM_THREADS. Only for the start: it would otherwise reach every
    process this one starts later."""
    one_thread = (os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind"
                  and "OMP_NUM_THREADS" not in os.environ
                  and usable_cores() <= SMALL_MACHINE_CORES
                  and parameters is not None and parameters < SMALL_MODEL_PARAMETERS)
    if not one_thread:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def kv_cache_args(engine_args: dict) -> dict:
    """`engine_args` with a KV cache size from the free memory where the caller set none."""
    if any(k in engine_args for k in SIZED_BY) or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return engine_args
    import psutil

    available = psutil.virtual_memory().available
    size = min(KV_CAP_BYTES, int(available * KV_SHARE))
    log.info("vLLM on CPU: a KV cache of %.1f GiB (%d%% of the %.1f GiB free, at most "
             "%d GiB); set kv_cache_memory_bytes to choose", size / 2**30, KV_SHARE * 100,
             available / 2**30, KV_CAP_BYTES // 2**30)
    return {**engine_args, "kv_cache_memory_bytes": size}
