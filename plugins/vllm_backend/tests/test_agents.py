"""Multi-turn tool trajectories on the real vLLM engine: the agent contract in process, and
two replicas whose prefix caches hold each trajectory's history when sessions pin it."""

import asyncio

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.agents import GREEDY, ROWS, AgentContract, ToolTask


class TestVLLMAgents(AgentContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls, shared_vllm):
        return lambda model_dir: shared_vllm("engine")


def test_two_replicas_with_sessions_serve_later_turns_from_the_prefix_cache(tiny_model):
    from rollout.apps.agents import AgentConfig, AgentRunner

    with rollout.ServedRollout.start("vllm", str(tiny_model), 2, ENGINE) as sampler:
        runner = AgentRunner(sampler, ToolTask(calls=2), AgentConfig(sampling=GREEDY),
                             tokenizer=str(tiny_model))
        done = asyncio.run(runner.run_many(ROWS * 2))
    later = [(t.turns[i - 1], t.turns[i]) for t in done for i in range(1, t.num_turns)]
    assert all(t.end_reason == "done" and t.num_turns == 3 for t in done)
    for before, turn in later:
        # The previous turn's prompt is in this replica's cache, up to its last block.
        assert before.prompt_tokens - 64 <= turn.cached_tokens <= turn.prompt_tokens, (
            before, turn)
