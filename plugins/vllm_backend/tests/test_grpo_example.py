"""examples/grpo.py on vLLM, unchanged but for its backend options: weights pushed after
every step reach the engine (versions and logprobs match the trainer), and the reward rises."""

import json

import pytest
from conftest import ENGINE

from rollout.testing.grpo import run_grpo, sampler_options


def test_reward_rises_and_logprobs_match(tiny_model):
    # float32 on CPU: vLLM's default there is bfloat16, whose logprobs are ~0.2 away.
    run = run_grpo("vllm", ENGINE, tiny_model, "--steps", 20, "--seed", 0, "--check")
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary


def test_asynchronous_on_the_trainers_cores_the_engine_yields_them():
    """--async with a CPU trainer: vLLM's processes at the lowest priority unless told
    otherwise (the option's effect on the engine: test_cpu_defaults)."""
    assert sampler_options("--backend", "vllm", "--async", "1") == {"nice": 19}
    assert sampler_options("--backend", "vllm") == {}  # synchronous: the phases take turns
    assert sampler_options("--backend", "vllm", "--async", "1", "--device", "cuda") == {}
    assert sampler_options("--backend", "vllm", "--async", "1",
                           "--backend-option", "nice=0") == {"nice": 0}


def test_kept_kv_pushes_check_the_exact_tokens_and_log_the_others_apart(tiny_model,
                                                                         tmp_path):
    """--pause keep_kv on vLLM's own pause (async mode): running samples keep their KV cache
    across a push, and vLLM's spans label their tokens. Those their own weights' cache made
    pass the check; the largest gap of those made over an older cache is logged apart."""
    log = tmp_path / "steps.jsonl"
    # At the trainer's priority: a niced engine would wait on whatever else runs here.
    run = run_grpo("vllm", {**ENGINE, "mode": "async", "nice": 0}, tiny_model, "--async", 1,
                   "--pause", "keep_kv", "--steps", 12, "--prompts", 4, "--group-size", 8,
                   "--max-tokens", 32, "--seed", 0, "--log", log)
    assert run.summary["pause"] == "keep_kv" and len(run.steps) == 12
    assert run.summary["max_logprob_diff"] <= 1e-3
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "reward" in r]
    assert len(steps) == 12 and all(s["kept_kv_max_logprob_diff"] >= 0 for s in steps)


@pytest.mark.parametrize("backend, options", [
    ("hf", {}),
    ("vllm", {**ENGINE, "mode": "async",
              "engine_args": {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}}),
])
def test_a_lora_adapter_learns_and_its_logprobs_match(tiny_model, backend, options):
    """--lora: the trainer trains an adapter (peft) and pushes only it each step; every
    token is of the adapter version just pushed, its logprob the trainer's, and the reward
    rises. (Here, where peft is installed: the vLLM environment has the HF backend too.)"""
    run = run_grpo(backend, options, tiny_model, "--lora", 8, "--steps", 20, "--seed", 0,
                   "--check")
    assert run.summary["lora"] == 8 and len(run.steps) == 20
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary


def test_a_lora_adapter_through_two_replica_processes(tiny_model):
    """The adapter reaches both replicas every step (each token's logprob is checked)."""
    run = run_grpo("hf", {}, tiny_model, "--lora", 8, "--replicas", 2, "--steps", 5,
                   "--prompts", 4, "--group-size", 4, "--seed", 0, timeout=300)
    assert run.summary["max_logprob_diff"] <= 1e-3 and len(run.summary["rewards"]) == 5
