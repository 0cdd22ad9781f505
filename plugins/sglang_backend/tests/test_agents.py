"""Multi-turn tool trajectories on the real SGLang engine (in process): the agent contract,
and SGLang's prefix-cache hits as the backend reports them."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.agents import GREEDY, AgentContract, ToolTask, run


class TestSGLangAgents(AgentContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model_dir: rollout.load_backend("sglang", model=str(model_dir),
                                                      mode="engine", **ENGINE)

    def test_later_turns_take_their_history_from_the_prefix_cache(self, agent_ro):
        done = run(agent_ro, ToolTask(calls=2), sampling=GREEDY)
        for t in done:
            assert t.end_reason == "done", (t.end_reason, t.end_detail)
            assert len(t.turns) == 3
            for turn in t.turns:
                assert turn.cached_tokens is not None  # SGLang says it on every request
                assert 0 <= turn.cached_tokens <= turn.prompt_tokens
            for before, turn in zip(t.turns, t.turns[1:]):
                # A turn's prompt starts with the previous turn's prompt and sample, which
                # SGLang's radix cache kept when that request finished.
                assert turn.cached_tokens >= before.prompt_tokens, (turn, before)
