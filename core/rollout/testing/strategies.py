"""Hypothesis strategies: valid requests (as dicts, the way they arrive from users) and
invalid ones paired with the field their error must name."""

from __future__ import annotations

import os
import string

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("ROLLOUT_CONTRACT_EXAMPLES", "8"))
# One backend often runs the suite in several classes (an in-process and a server mode),
# so the same inherited test runs on several instances: that is intended here.
HYPOTHESIS = settings(max_examples=EXAMPLES, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture,
                                             HealthCheck.too_slow,
                                             HealthCheck.differing_executors])

TEXT = st.text(alphabet=string.ascii_letters + string.digits + " .,:!?", min_size=1,
               max_size=40).filter(lambda s: s.strip())


@st.composite
def sampling_params(draw, max_tokens: int = 24, vocab_size: int = 256) -> dict:
    greedy = draw(st.booleans())
    temperature = 0.0 if greedy else draw(st.floats(0.1, 2.0))
    params = {
        "temperature": temperature,
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.5, 0.05])),
        "top_k": draw(st.none() | st.integers(1, 50)),
        "max_tokens": draw(st.integers(1, max_tokens)),
        "n": 1 if greedy else draw(st.integers(1, 3)),
        "stop": draw(st.lists(st.text(alphabet="aeiou .", min_size=1, max_size=3), max_size=2)),
        "stop_token_ids": draw(st.lists(st.integers(0, vocab_size - 1), max_size=2)),
        "seed": draw(st.none() | st.integers(0, 2**31 - 1)),
        "logprobs": draw(st.none() | st.integers(0, 5)),
        "ignore_eos": draw(st.booleans()),
        "repetition_penalty": draw(st.sampled_from([1.0, 1.0, 1.3, 0.8])),
        "presence_penalty": draw(st.sampled_from([0.0, 0.0, 0.5, -0.5])),
        "frequency_penalty": draw(st.sampled_from([0.0, 0.0, 0.4, -0.4])),
        "min_p": draw(st.sampled_from([0.0, 0.0, 0.05])),
        "logit_bias": draw(st.dictionaries(st.integers(0, vocab_size - 1),
                                           st.sampled_from([-100.0, -3.0, 3.0]), max_size=2)),
        "include_stop_str_in_output": draw(st.booleans()),
    }
    params["min_tokens"] = draw(st.integers(0, min(3, params["max_tokens"])))
    return params


def _messages():
    role = st.sampled_from(["system", "user", "assistant"])
    message = st.fixed_dictionaries({"role": role, "content": TEXT})
    last = st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})
    return st.tuples(st.lists(message, max_size=2), last).map(lambda t: t[0] + [t[1]])


@st.composite
def requests(draw, vocab_size: int = 256, max_tokens: int = 24, chat: bool = True) -> dict:
    """A valid request dict with a unique id."""
    kinds = ["prompt", "prompt_token_ids"] + (["messages"] if chat else [])
    kind = draw(st.sampled_from(kinds))
    prompt = {
        "prompt": TEXT,
        "prompt_token_ids": st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=20),
        "messages": _messages(),
    }[kind]
    return {
        "id": draw(st.uuids()).hex,
        kind: draw(prompt),
        "sampling": draw(sampling_params(max_tokens=max_tokens, vocab_size=vocab_size)),
    }


# Each corruption: (field the error must name, function that breaks a valid dict).
def _set(path: tuple, value):
    def corrupt(request: dict) -> dict:
        out = {**request, "sampling": dict(request["sampling"])}
        target = out
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return out

    return corrupt


def _replace_prompt(**prompt):
    def corrupt(request: dict) -> dict:
        out = {k: v for k, v in request.items()
               if k not in ("prompt", "prompt_token_ids", "messages")}
        return {**out, **prompt}

    return corrupt


CORRUPTIONS = {
    "negative temperature": ("sampling.temperature", _set(("sampling", "temperature"), -0.5)),
    "top_p zero": ("sampling.top_p", _set(("sampling", "top_p"), 0.0)),
    "top_p above one": ("sampling.top_p", _set(("sampling", "top_p"), 1.5)),
    "top_k zero": ("sampling.top_k", _set(("sampling", "top_k"), 0)),
    "max_tokens zero": ("sampling.max_tokens", _set(("sampling", "max_tokens"), 0)),
    "max_tokens float": ("sampling.max_tokens", _set(("sampling", "max_tokens"), 2.5)),
    "n zero": ("sampling.n", _set(("sampling", "n"), 0)),
    "logprobs too many": ("sampling.logprobs", _set(("sampling", "logprobs"), 21)),
    "unknown logprobs mode": ("sampling.logprobs_mode",
                              _set(("sampling", "logprobs_mode"), "processed_logits")),
    "prompt_logprobs negative": ("sampling.prompt_logprobs",
                                 _set(("sampling", "prompt_logprobs"), -1)),
    "empty stop string": ("sampling.stop", _set(("sampling", "stop"), [""])),
    "negative stop token": ("sampling.stop_token_ids", _set(("sampling", "stop_token_ids"), [-1])),
    "string seed": ("sampling.seed", _set(("sampling", "seed"), "seven")),
    "typo in sampling": ("sampling.temprature", _set(("sampling", "temprature"), 1.0)),
    "repetition penalty zero": ("sampling.repetition_penalty",
                                _set(("sampling", "repetition_penalty"), 0.0)),
    "presence penalty too big": ("sampling.presence_penalty",
                                 _set(("sampling", "presence_penalty"), 2.5)),
    "min_p above one": ("sampling.min_p", _set(("sampling", "min_p"), 1.5)),
    "min_tokens above max_tokens": ("sampling.min_tokens",
                                    _set(("sampling", "min_tokens"), 10_000)),
    "logit bias too big": ("sampling.logit_bias.3", _set(("sampling", "logit_bias"), {3: 1e3})),
    "logit bias on a word": ("sampling.logit_bias.ka", _set(("sampling", "logit_bias"),
                                                            {"ka": 1.0})),
    "two constraints": ("sampling.structured_outputs", _set(
        ("sampling", "structured_outputs"), {"regex": "a", "choice": ["b"]})),
    "empty choice": ("sampling.structured_outputs.choice", _set(
        ("sampling", "structured_outputs"), {"choice": []})),
    "tools without messages": ("tools", _replace_prompt(prompt="x", tools=[{"name": "f"}])),
    "unknown field": ("max_new_tokens", _set(("max_new_tokens",), 8)),
    "two prompts": ("prompt", _replace_prompt(prompt="a", prompt_token_ids=[1, 2])),
    "no prompt": ("prompt", _replace_prompt()),
    "empty token ids": ("prompt_token_ids", _replace_prompt(prompt_token_ids=[])),
    "negative token id": ("prompt_token_ids", _replace_prompt(prompt_token_ids=[3, -1])),
    "bad role": ("messages[0].role", _replace_prompt(messages=[{"role": "robot", "content": "x"}])),
    "bad part": ("messages[0].content[0].type",
                 _replace_prompt(messages=[{"role": "user", "content": [{"type": "video"}]}])),
}


def greedy_n(request: dict) -> dict:
    return {**request, "sampling": {**request["sampling"], "temperature": 0.0, "n": 2}}


CORRUPTIONS["n > 1 with greedy"] = ("sampling.n", greedy_n)


@st.composite
def invalid_requests(draw, vocab_size: int = 256, max_model_len: int | None = None):
    """(request dict, field its error must name): a valid request with one thing broken,
    including what only the engine can know (a token id outside the vocabulary, a prompt
    longer than the context)."""
    request = draw(requests(vocab_size=vocab_size))
    corruptions = dict(CORRUPTIONS)
    corruptions["token id outside the vocabulary"] = (
        "prompt_token_ids", _replace_prompt(prompt_token_ids=[1, vocab_size + 7]))
    if max_model_len:
        corruptions["prompt longer than the context"] = (
            "prompt_token_ids", _replace_prompt(prompt_token_ids=[1] * (max_model_len + 1)))
    name = draw(st.sampled_from(sorted(corruptions)))
    field, corrupt = corruptions[name]
    return corrupt(request), field
