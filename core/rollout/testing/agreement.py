"""Checks that another backend agrees with the HF backend on the same model.

Tolerance: both run float32 on the CPU, but with different kernels (the engine's own
attention and fused layers, torch's matmul in transformers), so logprobs differ by
rounding, about 1e-5. We allow 1e-3 on first-token logprobs: far below any real difference
between distributions. Greedy tokens must be identical, except after a near-tie (the top
two HF logprobs within 2e-3), where rounding may legitimately pick the other token.
"""

from __future__ import annotations

from rollout import Result, Rollout
from rollout.testing.probes import PROBE_PROMPTS
from rollout.testing.sampling import MASKED, REGEX

TOLERANCE = 1e-3
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the ka lo"}]


def agreement_requests() -> list[dict]:
    requests = [{"id": f"p{i}", "prompt": p,
                 "sampling": {"temperature": 0.0, "max_tokens": 24, "logprobs": 3,
                              "ignore_eos": True}} for i, p in enumerate(PROBE_PROMPTS)]
    requests.append({"id": "chat", "messages": CHAT,
                     "sampling": {"temperature": 0.0, "max_tokens": 24, "logprobs": 3}})
    # The sampling vocabulary and a constraint mean the same on every backend: the same
    # greedy tokens and the same (raw, after the constraint's mask) logprobs.
    requests.append({"id": "penalized", "prompt": PROBE_PROMPTS[0], "sampling": {
        "temperature": 0.0, "max_tokens": 24, "logprobs": 3, "ignore_eos": True,
        "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.3,
        "min_tokens": 4, "logit_bias": {7: -100.0, 9: 5.0}}})
    requests.append({"id": "constrained", "prompt": PROBE_PROMPTS[1], "sampling": {
        "temperature": 0.0, "max_tokens": 32, "logprobs": 3,
        "structured_outputs": {"regex": REGEX}}})
    return requests


def greedy_outputs(backend: Rollout) -> list[Result]:
    return [c.unwrap()[0] for c in backend.generate(agreement_requests())]


def check_first_token_logprobs(pairs: list[tuple[Result, Result]]) -> None:
    for hf, other in pairs:
        assert hf.prompt_tokens == other.prompt_tokens
        assert abs(hf.logprobs[0] - other.logprobs[0]) < TOLERANCE
        for a, b in zip(hf.top_logprobs[0], other.top_logprobs[0]):
            if a.logprob <= MASKED and b.logprob <= MASKED:
                continue  # both forbidden by a constraint: their order means nothing
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOLERANCE


def check_greedy_tokens(pairs: list[tuple[Result, Result]]) -> None:
    for hf, other in pairs:
        for j, (a, b) in enumerate(zip(hf.token_ids, other.token_ids)):
            if a != b:
                top = hf.top_logprobs[j]
                gap = top[0].logprob - top[1].logprob
                assert gap < 2 * TOLERANCE, f"differ at token {j} with a clear winner (gap {gap})"
                break
        else:
            assert hf.token_ids == other.token_ids
            # A sample cut by its length may end inside a character: vLLM holds those bytes
            # back, HF decodes them as U+FFFD.
            assert hf.text.rstrip("\ufffd") == other.text.rstrip("\ufffd")
