"""`AgentContract`: multi-turn tool trajectories on a backend's real engine.

A random tiny model is made to call a tool by a regex constraint, then to answer by
another. For every trajectory the suite checks that ids, loss mask and logprobs line up,
that the mask is 1 exactly on sampled tokens, that the logprobs are a plain forward pass
of the model over the final sequence (under the same constraint masks), that the final
tokens are what the chat template renders, that the budget holds, and that greedy
trajectories are the HF backend's token for token.

A subclass provides `make_rollout`, a class-scoped fixture returning a callable
`make_rollout(model_dir) -> Rollout`.
"""

from __future__ import annotations

import asyncio
import json
import re

import attrs
import pytest

from rollout import Rollout, SamplingParams
from rollout.apps.agents import AgentConfig, AgentRunner, Environment, Trajectory
from rollout.testing.server_contract import ANSWER_REGEX, CALL_REGEX

ROWS = [{"prompt": f"what is {a} + {b}?"} for a, b in ((1, 2), (3, 4), (5, 0), (2, 2))]
LOGPROB_TOLERANCE = 1e-3


def add(a: int, b: int) -> int:
    """Add two digits.

    Args:
        a: the first digit
        b: the second digit
    """
    return a + b


class ToolTask(Environment):
    """`calls` turns forced to call `add`, then one forced to answer; reward 1.0 when the
    answer states the last tool result."""

    def __init__(self, calls: int = 1):
        super().__init__([add], reward_fn=self.score)
        self.calls = calls

    def sampling(self, row, turn, messages):
        return {"structured_outputs": {"regex": CALL_REGEX if turn < self.calls
                                       else ANSWER_REGEX}}

    @staticmethod
    def score(row, messages) -> float:
        results = [m.text for m in messages if m.role == "tool"]
        return float(bool(results) and messages[-1].text == f"The sum is {results[-1]}.")


def run(ro: Rollout, environment: Environment, rows=ROWS, **config) -> list[Trajectory]:
    runner = AgentRunner(ro, environment, AgentConfig(**config))
    return asyncio.run(runner.run_many(rows))


GREEDY = SamplingParams(temperature=0.0, max_tokens=128)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=128)


class AgentContract:
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        raise NotImplementedError("override make_rollout: lambda model_dir: Rollout")

    @pytest.fixture(scope="class")
    @classmethod
    def agent_ro(cls, make_rollout, tiny_model):
        ro = make_rollout(tiny_model)
        yield ro
        ro.close()

    @pytest.fixture(scope="class")
    @classmethod
    def greedy(cls, agent_ro):
        return run(agent_ro, ToolTask(), sampling=GREEDY)

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, tiny_model):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def test_tool_trajectories_hold_exact_tokens(self, agent_ro, greedy, model):
        seeded = agent_ro.capabilities.supports("seed")
        sampled = run(agent_ro, ToolTask(), sampling=SAMPLED if seeded else
                      attrs.evolve(SAMPLED, seed=None))
        for t in greedy + sampled:
            assert t.end_reason == "done", (t.end_reason, t.end_detail)
            assert [turn.sampled_tokens > 0 for turn in t.turns] == [True, True]
            call = t.turns[0].tool_calls[0]
            assert (call.name, call.outcome) == ("add", "ok")
            assert call.detail == str(add(**json.loads(call.arguments)))
            assert re.fullmatch(ANSWER_REGEX, t.turns[1].text)
            check_lined_up(t)
            check_logprobs(t, model, agent_ro.encoder.tokenizer,
                           [CALL_REGEX, ANSWER_REGEX])
            check_rendering(t, agent_ro.encoder.tokenizer)

    def test_the_token_budget_holds(self, agent_ro):
        for budget in (40, 90):
            done = run(agent_ro, ToolTask(), sampling=GREEDY, max_tokens=budget)
            for t in done:
                assert len(t.response_ids) <= budget
                assert t.end_reason in ("max_tokens", "done"), t.end_detail
                check_lined_up(t)
            if budget == 40:  # less than one call and its result
                assert all(t.end_reason == "max_tokens" for t in done)

    def test_greedy_trajectories_are_the_hf_backends(self, agent_ro, greedy, tiny_model):
        if agent_ro.name == "hf":
            pytest.skip("the HF backend is the reference")
        pytest.importorskip("rollout_hf", reason="the HF backend is not installed here")
        import rollout

        with rollout.load_backend("hf", model=str(tiny_model)) as hf:
            reference = run(hf, ToolTask(), sampling=GREEDY)
        for mine, theirs in zip(greedy, reference):
            assert mine.prompt_ids == theirs.prompt_ids
            assert mine.response_ids == theirs.response_ids
            assert mine.mask == theirs.mask


def check_lined_up(t: Trajectory) -> None:
    """ids, mask and logprobs line up; the mask is 1 exactly on each turn's sampled tokens."""
    assert len(t.response_ids) == len(t.mask) == len(t.logprobs)
    expected = []
    for turn in t.turns:
        expected += [1] * turn.sampled_tokens + [0] * turn.appended_tokens
    assert t.mask == expected
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if not m)


def check_logprobs(t: Trajectory, model, tokenizer, regexes: list[str]) -> None:
    """Each sampled token's logprob is a plain forward pass over the final sequence, masked
    by the turn's constraint (the contract's logprobs come after a constraint's mask)."""
    import torch

    from rollout.contract.schemas import StructuredOutputs
    from rollout.kit.sampler.grammars import Grammars, allowed_tokens

    sequence = t.prompt_ids + t.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    vocab = model.get_input_embeddings().num_embeddings
    grammars = Grammars(tokenizer, vocab, {tokenizer.eos_token_id})
    position = len(t.prompt_ids)
    for turn, regex in zip(t.turns, regexes):
        matcher = grammars.matcher(grammars.compile(StructuredOutputs(regex=regex)))
        for _ in range(turn.sampled_tokens):
            token = sequence[position]
            allowed = allowed_tokens([matcher], vocab, logits.device)[0]
            row = logits[position - 1, :vocab].masked_fill(~allowed, float("-inf"))
            expected = row.log_softmax(-1)[token].item()
            got = t.logprobs[position - len(t.prompt_ids)]
            assert abs(expected - got) < LOGPROB_TOLERANCE, (turn.index, position, expected, got)
            matcher.accept_token(token)
            position += 1
        position += turn.appended_tokens


def check_rendering(t: Trajectory, tokenizer) -> None:
    """The final tokens are the chat template's rendering of the whole conversation: as
    text always (this template rewrites nothing), and as tokens where the model's samples
    are the tokenizer's own tokenization."""
    from rollout.apps.agents import function_tool
    from rollout.kit.prompts import template_message

    text = tokenizer.apply_chat_template([template_message(m) for m in t.messages],
                                         tools=[function_tool(add).spec.as_openai()],
                                         tokenize=False)
    held = tokenizer.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False)
    assert held == text, (held, text)
    if t.render == "same":
        assert t.prompt_ids + t.response_ids == tokenizer(text, add_special_tokens=False).input_ids
