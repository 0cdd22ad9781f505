"""`SamplingContract`: the sampling vocabulary and structured outputs, checked for real.

Penalties are checked token by token against a plain forward pass of the model with the
formulas of docs/sampling.md applied by hand; bias, `min_tokens` and `min_p` by what they
must forbid; constrained outputs by matching, parsing or validating every sample. Mixed
into `BackendContract`, so every backend runs it on its real engine.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from rollout import InvalidRequestError, Tool
from rollout.apps.tool_parsers import load_tool_parser

PROMPT = "the ka lo"
REPEATING = "1 2 3 +"  # greedy output repeats tokens here, so every penalty changes it
NEAR_TIE = 1e-3  # processed logits this close may be ordered either way by another kernel
MASKED = -1e4  # a logprob at or below this is a token the constraint forbids

JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["ka", "lo", "mi ne"]},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello"\nname ::= "ka" | "lo" | "mi"'
GRAMMAR_LANGUAGE = r"(hi|hello) (ka|lo|mi)!"
REGEX = r"(ka|lo|mi)( (ka|lo|mi)){1,3}\."
CHOICES = ("yes", "no", 'maybe "so"\t\\')  # escapes must survive
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD = {"name": "add", "description": "add two digits",
       "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                      "required": ["a", "b"]}}
# A random model calls a tool (hermes style), then answers, when a regex says so.
CALL_REGEX = r'<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'
ANSWER_REGEX = r"The sum is [0-9]{1,2}\."


def penalized(logits, prompt: list[int], output: list[int], repetition: float,
              presence: float, frequency: float):
    """docs/sampling.md's formulas, applied to one step's raw logits."""
    import torch

    z = logits.clone()
    seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
    if repetition != 1.0 and len(seen):
        z[seen] = torch.where(z[seen] > 0, z[seen] / repetition, z[seen] * repetition)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=z.shape[0]) \
        if output else torch.zeros_like(z)
    return z - frequency * counts - presence * (counts > 0).to(z.dtype)


class SamplingContract:
    """Needs the `harness` fixture of `BackendContract`."""

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, harness):
        """The model itself in transformers, float32 on the CPU: raw logits per step."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(harness.model_dir),
                                                     dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(harness.model_dir))

        class Reference:
            eos = tokenizer.eos_token_id
            prompt = tokenizer(PROMPT).input_ids
            repeating = tokenizer(REPEATING).input_ids

            @staticmethod
            def logits(ids: list[int]):
                """Raw next-token logits after each prefix of `ids` past the prompt."""
                with torch.inference_mode():
                    return model(torch.tensor([ids])).logits[0].float()

            vocab = model.get_input_embeddings().num_embeddings

            @staticmethod
            def batch_logits(ids):
                """Raw next-token logits after each row of `ids` (equal lengths)."""
                with torch.inference_mode():
                    return model(ids).logits[:, -1].float()

            @staticmethod
            def decode(ids) -> str:
                return tokenizer.decode(list(ids), skip_special_tokens=True)

            @staticmethod
            def token(text: str) -> int:
                (token,) = tokenizer(text, add_special_tokens=False).input_ids
                return token

        return Reference

    def _one(self, harness, prompt=PROMPT, **sampling):
        request = {"prompt": prompt, "sampling": {"temperature": 0.0, **sampling}}
        return harness.rollout.generate([request])[0].unwrap()

    def _ids(self, harness, reference, prompt=None, **sampling):
        request = {"prompt_token_ids": prompt or reference.prompt,
                   "sampling": {"temperature": 0.0, **sampling}}
        return harness.rollout.generate([request])[0].unwrap()[0]

    # --- bias, min_tokens, min_p ----------------------------------------------------------

    def test_logit_bias_bans_and_forces_tokens(self, harness, reference):
        plain = self._ids(harness, reference, max_tokens=8, ignore_eos=True)
        banned = {t: -100.0 for t in plain.token_ids}
        avoided = self._ids(harness, reference, max_tokens=8, ignore_eos=True,
                            logit_bias=banned)
        assert not set(avoided.token_ids) & set(banned)
        forced = reference.token("ka")
        result = self._ids(harness, reference, max_tokens=6, ignore_eos=True,
                           logit_bias={forced: 100.0})
        assert list(result.token_ids) == [forced] * 6

    def test_min_tokens_holds_back_eos_and_stop_tokens(self, harness, reference):
        eager = {reference.eos: 100.0}  # EOS would come first
        assert list(self._ids(harness, reference, max_tokens=10,
                              logit_bias=eager).token_ids) == [reference.eos]
        held = self._ids(harness, reference, max_tokens=10, logit_bias=eager, min_tokens=5)
        assert len(held.token_ids) == 6 and held.token_ids[-1] == reference.eos
        assert reference.eos not in held.token_ids[:5] and held.finish_reason == "stop"
        stop = reference.token("ka")
        held = self._ids(harness, reference, max_tokens=10, ignore_eos=True,
                         stop_token_ids=[stop], logit_bias={stop: 100.0}, min_tokens=3)
        assert len(held.token_ids) == 4 and held.token_ids[-1] == stop
        assert held.finish_reason == "stop"

    def test_min_p_never_samples_below_the_bound(self, harness):
        min_p = 0.3
        results = self._one(harness, temperature=1.0, n=4, max_tokens=24, min_p=min_p,
                            logprobs=1, ignore_eos=True)
        # Temperature 1 and no penalties: the raw logprobs are the sampled distribution.
        for result in results:
            for chosen, (best,) in zip(result.logprobs, result.top_logprobs):
                assert chosen >= best.logprob + math.log(min_p) - NEAR_TIE

    # --- penalties ------------------------------------------------------------------------

    @pytest.mark.parametrize("penalties", [
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"repetition_penalty": 1.3, "frequency_penalty": -0.5, "presence_penalty": 0.7},
    ], ids=lambda p: ",".join(f"{k.split('_')[0]}={v}" for k, v in p.items()))
    def test_penalties_follow_the_documented_formula(self, harness, reference, penalties):
        prompt = reference.repeating
        plain = self._ids(harness, reference, prompt, max_tokens=16, ignore_eos=True)
        result = self._ids(harness, reference, prompt, max_tokens=16, ignore_eos=True,
                           logprobs=0, **penalties)
        assert result.token_ids != plain.token_ids, "the penalty changed nothing"
        ids = list(prompt) + list(result.token_ids)
        logits = reference.logits(ids)[len(prompt) - 1 : -1]
        args = (penalties.get("repetition_penalty", 1.0),
                penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0))
        for step, token in enumerate(result.token_ids):
            # Logprobs stay the raw model's; the penalty acts on the choice.
            raw = logits[step].log_softmax(-1)
            assert abs(result.logprobs[step] - float(raw[token])) < NEAR_TIE
            z = penalized(logits[step], prompt, list(result.token_ids[:step]), *args)
            best = float(z.max())
            assert float(z[token]) >= best - NEAR_TIE, (
                f"step {step}: chose {token} ({float(z[token]):.4f}), but "
                f"{int(z.argmax())} scores {best:.4f} after the penalties")

    def test_repetition_penalty_covers_the_prompt(self, harness, reference):
        import torch

        # A prompt of one token repeated, which the model would repeat once more, unless
        # the penalty on the prompt's tokens (the output is still empty) turns it away.
        with torch.inference_mode():
            raw = reference.batch_logits(torch.arange(reference.vocab)[:, None].repeat(1, 4))
        loops = raw.argmax(-1) == torch.arange(reference.vocab)
        penalized = torch.where(raw > 0, raw / 2.0, raw * 2.0)  # where the token is its own
        own = penalized.gather(1, torch.arange(reference.vocab)[:, None])[:, 0]
        others = raw.scatter(1, torch.arange(reference.vocab)[:, None], float("-inf"))
        flips = loops & (others.max(-1).values > own + NEAR_TIE)
        if not flips.any():
            pytest.skip("no token that the tiny model repeats and the penalty turns away")
        token = int(flips.nonzero()[0, 0])
        result = self._ids(harness, reference, [token] * 4, max_tokens=1, ignore_eos=True,
                           repetition_penalty=2.0)
        assert result.token_ids[0] != token
        assert result.token_ids[0] == int(others[token].argmax())

    # --- stop strings ---------------------------------------------------------------------

    def test_stop_string_is_kept_when_asked(self, harness):
        full = self._one(harness, max_tokens=24, ignore_eos=True)[0]
        for start in range(len(full.text) // 2, len(full.text) - 2):
            stop = full.text[start : start + 2]
            if stop.isascii() and stop.strip() == stop and full.text.find(stop) == start:
                break
        else:
            pytest.skip("no clean two-character stop string in the probe output")
        kept = self._one(harness, max_tokens=24, ignore_eos=True, stop=[stop],
                         include_stop_str_in_output=True)[0]
        assert kept.finish_reason == "stop"
        assert kept.text == full.text[: start + len(stop)]

    def test_stop_strings_wait_for_min_tokens(self, harness, reference):
        held_tokens = 6
        for prompt in (PROMPT, REPEATING, "def x", "mi ne su ta ri po"):
            full = self._one(harness, max_tokens=24, ignore_eos=True, prompt=prompt)[0]
            early = reference.decode(full.token_ids[:2])
            stops = [early[i:i + 2] for i in range(len(early) - 1)
                     if early[i:i + 2].isascii() and early[i:i + 2].strip() == early[i:i + 2]]
            if stops and full.text.startswith(early):
                break
        else:
            pytest.skip("no probe output starts with a clean two-character stop string")
        stop = stops[0]
        result = self._one(harness, max_tokens=24, ignore_eos=True, prompt=prompt, stop=[stop],
                           min_tokens=held_tokens)[0]
        assert len(result.token_ids) > held_tokens  # the early match did not end it
        held = len(reference.decode(full.token_ids[:held_tokens]))
        later = full.text.find(stop, max(0, held - len(stop) + 1))
        if later < 0:
            assert (result.finish_reason, result.token_ids) == ("length", full.token_ids)
        else:
            assert result.finish_reason == "stop" and result.text == full.text[:later]
            assert full.token_ids[: len(result.token_ids)] == result.token_ids

    # --- structured outputs ---------------------------------------------------------------

    def _constrained(self, harness, n=3, max_tokens=48, **constraint):
        sampling = {"temperature": 1.0, "n": n, "max_tokens": max_tokens,
                    "structured_outputs": constraint}
        if harness.caps.supports("seed"):
            sampling["seed"] = 11
        request = {"prompt": PROMPT, "sampling": sampling}
        results = harness.rollout.generate([request])[0].unwrap()
        assert all(r.finish_reason == "stop" for r in results), [r.text for r in results]
        if harness.caps.supports("seed"):  # a constrained sample is reproducible too
            again = harness.rollout.generate([request])[0].unwrap()
            assert [r.token_ids for r in again] == [r.token_ids for r in results]
        return [r.text for r in results]

    def test_regex_output_matches(self, harness):
        _skip_unless(harness, "structured_outputs.regex")
        for text in self._constrained(harness, regex=REGEX):
            assert re.fullmatch(REGEX, text), text

    def test_json_output_validates_against_its_schema(self, harness):
        _skip_unless(harness, "structured_outputs.json")
        import jsonschema

        for text in self._constrained(harness, n=4, max_tokens=96, json=JSON_SCHEMA):
            jsonschema.validate(json.loads(text), JSON_SCHEMA)
            assert " " not in text.replace("mi ne", ""), f"not compact: {text!r}"

    def test_choice_output_is_one_of_the_choices(self, harness):
        _skip_unless(harness, "structured_outputs.choice")
        texts = self._constrained(harness, n=6, choice=list(CHOICES))
        assert set(texts) <= set(CHOICES), texts

    def test_grammar_output_is_in_the_language(self, harness):
        _skip_unless(harness, "structured_outputs.grammar")
        for text in self._constrained(harness, grammar=GRAMMAR):
            assert re.fullmatch(GRAMMAR_LANGUAGE, text), text

    def test_a_structural_tag_constrains_only_what_follows_its_trigger(self, harness,
                                                                        reference):
        _skip_unless(harness, "structured_outputs.structural_tag")
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"],
            "tags": [{"type": "tag", "begin": "<tool_call>",
                      "content": {"type": "json_schema", "json_schema": {"enum": ["ka", "lo"]}},
                      "end": "</tool_call>"}]}}
        opening = reference.token("<tool_call>")
        # The trigger written (a bias): what follows is the tag's, up to its end.
        sampling = {"temperature": 1.0, "n": 4, "max_tokens": 32,  # the end may come spelt out
                    "logit_bias": {opening: 100}, "stop": ["</tool_call>"],
                    "include_stop_str_in_output": True, "structured_outputs": {
                        "structural_tag": tag}}
        results = harness.rollout.generate([{"prompt": PROMPT, "sampling": sampling}])[0]
        assert {r.text for r in results.unwrap()} <= {'<tool_call>"ka"</tool_call>',
                                                       '<tool_call>"lo"</tool_call>'}
        # No trigger (banned): the text is free, the same as without the tag.
        free = {"max_tokens": 12, "logit_bias": {opening: -100}}
        assert self._one(harness, **free)[0].token_ids == self._one(
            harness, **free, structured_outputs={"structural_tag": tag})[0].token_ids

    @pytest.mark.parametrize(("kind", "value"), [("regex", "(ka|lo"),
                                                 ("grammar", "root ::= ( missing")])
    def test_a_bad_constraint_fails_alone(self, harness, kind, value):
        _skip_unless(harness, f"structured_outputs.{kind}")
        good = {"prompt": PROMPT, "sampling": {"temperature": 0.0, "max_tokens": 4}}
        bad = {"prompt": PROMPT, "sampling": {"max_tokens": 4,
                                              "structured_outputs": {kind: value}}}
        first, failed, last = harness.rollout.generate([good, bad, dict(good)])
        assert isinstance(failed.error, InvalidRequestError), failed.error
        assert failed.error.field == f"sampling.structured_outputs.{kind}"
        assert first.unwrap()[0].token_ids == last.unwrap()[0].token_ids

    def test_logprobs_under_a_constraint_are_after_its_mask(self, harness, reference):
        _skip_unless(harness, "structured_outputs.regex")
        allowed = {reference.token("a"), reference.token("b")}
        result = self._one(harness, max_tokens=4, logprobs=5,
                           structured_outputs={"regex": "[ab]"})[0]
        assert result.token_ids[0] in allowed and result.token_ids[-1] == reference.eos
        first = result.top_logprobs[0]
        # Renormalised over what the constraint allows; every other token is masked.
        assert all(t.token_id in allowed or t.logprob <= MASKED for t in first)
        mass = sum(math.exp(t.logprob) for t in first if t.token_id in allowed)
        assert abs(mass - 1.0) < NEAR_TIE
        assert abs(result.logprobs[-1]) < NEAR_TIE  # EOS is then the only choice

    # --- tools ----------------------------------------------------------------------------

    def test_a_tool_call_round_trip_in_python(self, harness):
        _skip_unless(harness, "tools")
        _skip_unless(harness, "structured_outputs.regex")
        from transformers import AutoTokenizer

        messages = [{"role": "user", "content": "what is 2 + 3?"}]
        # A constraint allows any spelling of the call: a random model often spells it out
        # a few letters a token, so it needs room.
        sampling = {"temperature": 1.0, "max_tokens": 128}
        if harness.caps.supports("seed"):
            sampling["seed"] = 3
        first = harness.rollout.generate([{"messages": messages, "tools": [ADD], "sampling": {
            **sampling, "structured_outputs": {"regex": CALL_REGEX}}}])[0].unwrap()[0]
        parsed = load_tool_parser("hermes").parse(first.text, [Tool(**ADD)])
        assert parsed.ok and parsed.content == "", parsed
        (call,) = parsed.tool_calls
        arguments = json.loads(call.arguments)
        messages += [{"role": "assistant", "content": "", "tool_calls": [
                         {"id": call.id, "name": call.name, "arguments": call.arguments}]},
                     {"role": "tool", "tool_call_id": call.id,
                      "content": str(arguments["a"] + arguments["b"])}]
        final = harness.rollout.generate([{"messages": messages, "tools": [ADD], "sampling": {
            **sampling, "structured_outputs": {"regex": ANSWER_REGEX}}}])[0].unwrap()[0]
        assert re.fullmatch(ANSWER_REGEX, final.text)
        # The call and its result reached the template as the model's own format.
        tokenizer = AutoTokenizer.from_pretrained(str(harness.model_dir))
        rendered = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "add", "arguments": arguments}}]}, messages[2]]
        text = tokenizer.apply_chat_template(rendered, tools=[{"type": "function",
                                                               "function": ADD}],
                                             add_generation_prompt=True, tokenize=False)
        assert first.text in text
        assert final.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)


def _skip_unless(harness, capability: str) -> None:
    if not harness.caps.supports(capability):
        pytest.skip(f"{capability} unsupported by this backend: "
                    f"{harness.caps.unsupported[capability]}")
