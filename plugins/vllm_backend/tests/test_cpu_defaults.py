"""vLLM's CPU build beside other work: the KV cache sized from the memory free now, no
chunked prefill (a seeded one kills the engine), on a machine of two cores the model's
threads not bound to one of them, a small model on one thread, and with `nice` the engine's
processes yielding the cores to this one's."""

import os
import time

import psutil
import pytest
from conftest import ENGINE

import rollout
from rollout.kit.process import descendants, niceness
from rollout_vllm import cpu


def test_the_kv_cache_is_sized_from_free_memory_and_a_niced_engine_yields_its_cores(
        tiny_model, monkeypatch):
    """Two ways of living beside other work, on one engine (a start costs half a minute):
    vLLM's own default cache asks for 0.92 of all memory and fails when other work holds
    some; and with `nice`, every thread of the engine's processes runs at that niceness
    (this process's do not), and this process does not spin waiting for the worker."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu, "KV_CAP_BYTES", 256 * 2**20)  # below half of what is free
    others = set(descendants(os.getpid()))  # engines other modules lent, say
    ours = niceness([os.getpid()])
    # Not 19: on a machine busy with other work a niced engine still gets some of it.
    with rollout.load_backend("vllm", model=str(tiny_model), mode="engine", nice=5,
                              **ENGINE) as ro:
        size = ro._backend.engine.engine.vllm_config.cache_config.kv_cache_memory_bytes
        assert size == 256 * 2**20
        [result] = ro.generate([{"prompt": "the ka lo", "sampling": {
            "temperature": 0.0, "max_tokens": 4, "ignore_eos": True}}])[0].unwrap()
        assert result.completion_tokens == 4
        engine = set(descendants(os.getpid())) - others
        assert engine and niceness(engine) == {max(5, *ours)}  # (never above ours)
        assert niceness([os.getpid()]) == ours
        # vLLM's reader would spin for a second after the last output: a core's worth.
        idle = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - idle < 0.3


def test_below_the_cap_the_cache_takes_a_share_of_free_memory(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu, "KV_CAP_BYTES", 2**50)
    before = psutil.virtual_memory().available
    size = cpu.kv_cache_args({})["kv_cache_memory_bytes"]
    after = psutil.virtual_memory().available
    assert cpu.KV_SHARE * min(before, after) - 1 <= size <= cpu.KV_SHARE * max(before, after)


def test_a_size_the_caller_chose_is_kept(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for chosen in ({"kv_cache_memory_bytes": 2**30}, {"gpu_memory_utilization": 0.3}):
        assert cpu.kv_cache_args(chosen) == chosen
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu.kv_cache_args({}) == {}


@pytest.mark.parametrize("mode", ["engine", "server"])
def test_seeded_prompts_too_long_for_one_step_together_leave_the_engine_up(tiny_model, mode,
                                                                          shared_vllm):
    """vLLM's CPU build dies when a seeded request's prompt is prefilled in chunks; the
    backend turns chunked prefill off there, so long seeded prompts that cannot share one
    step's token budget are each prefilled whole."""
    batch = [{"prompt_token_ids": [5 + (i * 7 + j) % 400 for j in range(1500)],
              "sampling": {"temperature": 1.0, "seed": i, "max_tokens": 4}} for i in range(4)]
    with (shared_vllm(mode) if mode == "engine" else
          rollout.load_backend("vllm", model=str(tiny_model), mode=mode, **ENGINE)) as ro:
        for completion in ro.generate(batch):
            assert completion.unwrap()[0].completion_tokens == 4
        [again] = ro.generate([{"prompt": "the ka lo", "sampling": {"max_tokens": 2}}])
        assert again.ok


on_a_small_machine = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) > cpu.SMALL_MACHINE_CORES,
    reason="vLLM's own binding is kept on a machine of more cores")


def engine_threads_affinities() -> dict[str, set]:
    """Each thread of this process's children (vLLM's engine core and worker): its cores."""
    seen = {}
    for child in psutil.Process().children(recursive=True):
        for thread in child.threads():
            try:
                seen[f"{child.name()} {thread.id}"] = os.sched_getaffinity(thread.id)
            except OSError:  # ended meanwhile
                pass
    return seen


@on_a_small_machine
def test_on_a_small_machine_no_thread_of_the_engine_is_kept_to_one_core(shared_vllm):
    """vLLM's `auto` binding would keep the model's threads to one core of two, and the
    other for its engine core's loop: half the compute, and stalls (docs/serve-profile.md)."""
    with shared_vllm("engine") as ro:
        assert ro.generate([{"prompt": "the ka lo", "sampling": {"max_tokens": 2}}])[0].ok
        usable = os.sched_getaffinity(0)
        affinities = engine_threads_affinities()
        assert any("Worker" in name for name in affinities), affinities.keys()
        assert {name: cores for name, cores in affinities.items() if cores != usable} == {}


def test_a_binding_the_user_chose_is_kept_and_more_cores_keep_vllms(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    cpu.cpu_thread_binding()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    cpu.cpu_thread_binding()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cpu.cpu_thread_binding()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@on_a_small_machine
def test_a_small_model_gets_one_thread_in_the_engine_and_nowhere_else(shared_vllm):
    """The tiny model (139,840 parameters) runs faster on one OpenMP thread than on two; the
    setting goes to the engine's processes, and this process's environment keeps none."""
    chosen = os.environ.get("OMP_NUM_THREADS")  # a user's choice is the engine's
    with shared_vllm("engine") as ro:
        assert ro.generate([{"prompt": "the ka lo", "sampling": {"max_tokens": 2}}])[0].ok
        threads = ro._backend.engine.engine.collective_rpc(worker_threads)
    assert threads == [int(chosen or 1)]
    assert os.environ.get("OMP_NUM_THREADS") == chosen


def worker_threads(worker) -> int:
    """Run in vLLM's worker process: the threads its model computes on."""
    import torch

    return torch.get_num_threads()


def test_one_thread_only_for_a_small_model_with_unbound_threads_and_no_choice(monkeypatch):
    def threads_inside(parameters):
        with cpu.engine_threads(parameters):
            return os.environ.get("OMP_NUM_THREADS")

    tiny, wider, smollm2 = 139_840, 5_977_152, 134_515_008  # parameters

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_inside(tiny) == "1" and threads_inside(wider) == "1"
    assert "OMP_NUM_THREADS" not in os.environ
    assert threads_inside(smollm2) is None and threads_inside(None) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads_inside(tiny) == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert threads_inside(tiny) is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert threads_inside(tiny) is None
