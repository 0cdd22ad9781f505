"""vLLM's CPU build beside other work: the KV cache is sized from the memory free now."""

import psutil
from conftest import ENGINE

import rollout
from rollout_vllm import cpu


def test_the_kv_cache_is_sized_from_free_memory_with_a_cap(tiny_model, monkeypatch):
    # vLLM's own default asks for 0.92 of all memory and fails when other work holds some.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu, "KV_CAP_BYTES", 256 * 2**20)  # below half of what is free
    with rollout.load_backend("vllm", model=str(tiny_model), mode="engine", **ENGINE) as ro:
        size = ro._backend.engine.engine.vllm_config.cache_config.kv_cache_memory_bytes
        assert size == 256 * 2**20
        [result] = ro.generate([{"prompt": "the ka lo", "sampling": {
            "temperature": 0.0, "max_tokens": 4, "ignore_eos": True}}])[0].unwrap()
        assert result.completion_tokens == 4


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
