"""`OnPolicyContract`: a backend's logprobs are those of the distribution it says it
sampled from (`sampling.logprobs_mode`), checked token by token against the model in
transformers with docs/sampling.md's transforms applied by hand, in float64. Mixed into
`BackendContract`; `OnPolicyOnly` runs these tests alone (a backend started in another
logprobs mode)."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout import InvalidRequestError
from rollout.contract.schemas import LOGPROBS_MODES
from rollout.testing.sampling import penalized
from rollout.testing.strategies import HYPOTHESIS

TOLERANCE = 1e-4  # float32 engines against a float64 reference
# A token whose place in the kept set another kernel may decide either way: its score, or
# the mass above it against top_p, this close to the boundary.
BOUNDARY = 1e-5


def processed_reference(logits, prompt: list[int], output: list[int], s: dict):
    """The log-probabilities one step's token was drawn from (docs/sampling.md), and whether
    some token sits on a boundary of the kept set. `logits` are the raw ones (torch)."""
    z = logits.double().clone()
    for token, bias in (s.get("logit_bias") or {}).items():
        z[int(token)] += bias
    z = penalized(z, prompt, output, s.get("repetition_penalty", 1.0),
                  s.get("presence_penalty", 0.0), s.get("frequency_penalty", 0.0))
    temperature = s.get("temperature", 1.0)
    if temperature == 0:  # greedy: the processed logits, unscaled and untruncated
        return z.log_softmax(-1), False
    z = z / temperature
    edges = []
    if s.get("min_p"):
        floor = z.max() + math.log(s["min_p"])
        edges.append((z - floor).abs().min())
        z = z.masked_fill(z < floor, float("-inf"))
    ranked, order = z.sort(descending=True)
    if s.get("top_k") and s["top_k"] < len(z):
        k = s["top_k"]
        edges.append(ranked[k - 1] - ranked[k])
        z[order[k:]] = float("-inf")
        ranked[k:] = float("-inf")
    top_p = s.get("top_p", 1.0)
    if top_p < 1:
        probs = ranked.softmax(-1)
        before = probs.cumsum(-1) - probs
        edges.append((before - top_p).abs().min())
        z[order[before >= top_p]] = float("-inf")
    ambiguous = any(float(e) < BOUNDARY for e in edges)
    return z.log_softmax(-1), ambiguous


@st.composite
def sampled_settings(draw) -> dict:
    """Sampling with transforms, every one of them drawn."""
    s = {"temperature": draw(st.sampled_from([0.0, 0.7, 1.0, 1.3])),
         "top_p": draw(st.sampled_from([1.0, 0.9, 0.8, 0.5])),
         "top_k": draw(st.sampled_from([None, 3, 40])),
         "min_p": draw(st.sampled_from([0.0, 0.05]))}
    if draw(st.booleans()):
        s.update(repetition_penalty=draw(st.sampled_from([0.8, 1.3])),
                 presence_penalty=draw(st.sampled_from([-0.5, 0.0, 0.7])),
                 frequency_penalty=draw(st.sampled_from([0.0, 0.4])))
    if draw(st.booleans()):
        s["logit_bias"] = {draw(st.integers(0, 99)): draw(st.sampled_from([-3.0, 2.5]))}
    if s["temperature"] == 0:
        s.update(top_p=1.0, top_k=None)  # (vLLM truncates a greedy row only in a mixed batch)
    return {k: v for k, v in s.items() if v is not None}


PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def refused_by(caps, s: dict) -> set[str]:
    """The fields a request for the set drawn from (masks, processed logprobs) with
    settings `s` is refused by, where the backend's capabilities say it cannot give the set
    of that combination (`drawn_set.*`); empty where it must answer. A greedy token's set
    is itself: always answered."""
    if s["temperature"] == 0:
        return set()
    if not caps.supports("drawn_set.penalties"):
        penalties = {f"sampling.{n}" for n, neutral in PENALTIES.items()
                     if s.get(n, neutral) != neutral}
        if penalties:
            return penalties
    if not caps.supports("drawn_set.top_p_after_truncation") and s["top_p"] < 1 \
            and (s.get("top_k") or s.get("min_p")):
        return {"sampling.top_p"}
    return set()


def _answered(completion, refused: set[str]):
    """The results, or None where the request was refused as it must be."""
    if refused:
        assert isinstance(completion.error, InvalidRequestError), completion
        assert completion.error.field in refused, (completion.error, refused)
        return None
    return completion.unwrap()


class OnPolicyContract:
    """Needs the `harness` and `reference` fixtures of `BackendContract`."""

    def test_a_logprobs_mode_the_backend_cannot_give_is_refused_by_name(self, harness):
        caps = harness.caps
        assert caps.supports(f"logprobs_mode.{caps.logprobs_mode}")
        refused = [m for m in LOGPROBS_MODES if not caps.supports(f"logprobs_mode.{m}")]
        requests = [{"prompt": "ka lo", "sampling": {"max_tokens": 2, "logprobs": 0,
                                                     "logprobs_mode": mode}}
                    for mode in (*refused, caps.logprobs_mode)]
        *bad, good = harness.rollout.generate(requests)
        for completion in bad:
            assert isinstance(completion.error, InvalidRequestError), completion.error
            assert completion.error.field == "sampling.logprobs_mode"
        assert good.ok and len(good.results[0].logprobs) == len(good.results[0].token_ids)

    def test_routed_experts_are_given_for_every_token_run_or_refused_by_name(self, harness):
        """Where the backend (or its model: a dense one) has none to give, the request is
        refused naming the field; the other requests of the batch are answered."""
        asked, plain = harness.rollout.generate([
            {"prompt": "ka lo", "sampling": {"max_tokens": 3, "return_routed_experts": True}},
            {"prompt": "ka lo", "sampling": {"max_tokens": 3}}])
        assert plain.ok and plain.results[0].routed_experts is None
        if not harness.caps.supports("routed_experts"):
            assert isinstance(asked.error, InvalidRequestError), asked.error
            assert asked.error.field == "sampling.return_routed_experts"
            return
        for result in asked.unwrap():
            assert len(result.routed_experts) == \
                len(result.prompt_token_ids) + len(result.token_ids) - 1

    @HYPOTHESIS
    @given(s=sampled_settings(), data=st.data())
    def test_a_trace_is_generated_as_given_and_scored_as_if_drawn(self, harness, reference,
                                                                  s, data):
        """`trace_decode_token_ids` (vLLM's trace replay): the sample is the trace (an EOS
        in it ends nothing), each token scored under the request's transforms: in the
        processed mode, where the backend gives it, a token outside the kept set at -inf;
        the sampling mask, where given, is the set the engine would have drawn from."""
        if not harness.caps.supports("trace_replay"):
            (refused,) = harness.rollout.generate([{"prompt": "ka", "sampling": {
                "max_tokens": 2, "trace_decode_token_ids": [5, 6]}}])
            assert isinstance(refused.error, InvalidRequestError), refused.error
            assert refused.error.field == "sampling.trace_decode_token_ids"
            pytest.skip(f"trace_replay unsupported: {harness.caps.unsupported['trace_replay']}")
        trace = data.draw(st.lists(st.integers(0, reference.vocab - 1), min_size=1,
                                   max_size=6))
        trace.insert(data.draw(st.integers(0, len(trace) - 1)), reference.eos)
        processed = harness.caps.supports("logprobs_mode.processed")
        masks = harness.caps.supports("sampling_mask")
        sampling = {**s, "max_tokens": None, "logprobs": 0, "trace_decode_token_ids": trace,
                    "logprobs_mode": "processed" if processed else "raw",
                    "return_sampling_mask": masks}
        prompt = reference.repeating
        (result,) = harness.rollout.generate(
            [{"prompt_token_ids": prompt, "sampling": sampling}])[0].unwrap()
        assert list(result.token_ids) == trace and result.finish_reason == "length"
        logits = reference.logits(list(prompt) + trace)[len(prompt) - 1:-1]
        for step, token in enumerate(trace):
            expected, ambiguous = processed_reference(logits[step], prompt, trace[:step], s) \
                if processed else (logits[step].double().log_softmax(-1), False)
            if ambiguous:
                continue
            if expected[token] == float("-inf"):
                assert result.logprobs[step] == float("-inf"), (step, result.logprobs[step])
            else:
                assert abs(result.logprobs[step] - float(expected[token])) < TOLERANCE, (
                    step, result.logprobs[step], float(expected[token]))
            if not masks:
                continue
            if s["temperature"] == 0:  # the argmax, where no other token is as likely
                first, second = expected.topk(2).values.tolist()
                if first - second >= BOUNDARY:
                    assert result.sampling_mask[step] == (int(expected.argmax()),)
            else:
                kept = (expected > float("-inf")).nonzero()[:, 0].tolist()
                assert sorted(result.sampling_mask[step]) == kept

    def test_a_trace_continued_from_its_first_tokens_goes_on_with_the_rest(self, harness,
                                                                          reference):
        """A sample continued (`continue_from`, or held across a keep update) replays the
        rest of its trace, not the trace again."""
        if not harness.caps.supports("trace_replay"):
            pytest.skip(f"trace_replay unsupported: {harness.caps.unsupported['trace_replay']}")
        request = {"prompt_token_ids": reference.prompt, "sampling": {
            "temperature": 0.7, "top_p": 0.8, "seed": 1, "logprobs": 0, "max_tokens": None,
            "trace_decode_token_ids": list(range(10, 22))}}
        (whole,) = harness.rollout.generate([request])[0].unwrap()
        partial = attrs.evolve(whole, token_ids=whole.token_ids[:5], finish_reason="abort",
                               logprobs=whole.logprobs[:5], completion_tokens=5,
                               weight_versions=())
        (again,) = harness.rollout.generate([{**request, "continue_from": partial}])[0].unwrap()
        assert again.token_ids == whole.token_ids == tuple(range(10, 22))
        assert again.logprobs == pytest.approx(whole.logprobs, abs=TOLERANCE)

    def test_a_trace_is_refused_with_what_would_end_it_otherwise(self, harness):
        base = {"max_tokens": 3, "trace_decode_token_ids": [5, 6, 7]}
        for extra, field in (({"stop": ["x"]}, "stop"), ({"n": 2, "temperature": 1.0}, "n"),
                             ({"max_tokens": 2}, "max_tokens"),
                             ({"trace_decode_token_ids": []}, "trace_decode_token_ids")):
            (completion,) = harness.rollout.generate([{"prompt": "ka", "sampling": {
                **base, **extra}}])
            assert isinstance(completion.error, InvalidRequestError), completion.error
            assert completion.error.field == f"sampling.{field}"

    @HYPOTHESIS
    @given(s=sampled_settings(), neighbours=st.lists(st.tuples(
        st.integers(0, 24), st.integers(0, 12), st.integers(1, 12)), min_size=1, max_size=8))
    def test_a_batch_invariant_request_is_the_same_beside_any_other(self, harness, reference,
                                                                      s, neighbours):
        """`sampling.batch_invariant`: tokens, logprobs and top logprobs are exactly those of
        the request alone, beside neighbours of other lengths that share some of its prompt
        (a neighbour: (tokens of the prompt it shares, tokens of its own, max_tokens)). A
        backend that cannot promise it refuses the request by name; the others of the batch
        are answered."""
        prompt = list(reference.repeating)
        sampling = {**s, "max_tokens": 8, "ignore_eos": True, "logprobs": 2,
                    "batch_invariant": True}
        if not harness.caps.supports("seed"):  # the same draw cannot be asked for twice
            sampling.update(temperature=0.0, top_p=1.0)
            sampling.pop("top_k", None)
        else:
            sampling["seed"] = 11
        asked = {"prompt_token_ids": prompt, "sampling": sampling}
        others = [{"prompt_token_ids": prompt[:shared] + [(7 * i + 3) % reference.vocab
                                                          for i in range(own or 1)],
                   "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}
                  for shared, own, max_tokens in neighbours]
        if not harness.caps.supports("batch_invariant"):
            refused, other = harness.rollout.generate([asked, others[0]])
            assert isinstance(refused.error, InvalidRequestError), refused.error
            assert refused.error.field == "sampling.batch_invariant"
            assert other.ok, other.error
            pytest.skip("batch_invariant unsupported: "
                        f"{harness.caps.unsupported['batch_invariant']}")
        (alone,) = harness.rollout.generate([asked])[0].unwrap()
        half = len(others) // 2
        beside = harness.rollout.generate(others[:half] + [asked] + others[half:] + [asked])
        for completion in (beside[half], beside[-1]):
            (result,) = completion.unwrap()
            assert result.token_ids == alone.token_ids
            assert result.logprobs == alone.logprobs
            assert result.top_logprobs == alone.top_logprobs

    @pytest.mark.parametrize("mode", LOGPROBS_MODES)
    def test_logprobs_are_those_of_the_distribution_named(self, harness, reference, mode):
        """With no transform at temperature 1 the two modes agree; the default mode is the
        one `Capabilities` names."""
        _skip_unless(harness, mode)
        seeded = harness.caps.supports("seed")
        sampling = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 0,
                    "seed": 3 if seeded else None}
        named, default = harness.rollout.generate(
            [{"prompt_token_ids": reference.prompt,
              "sampling": {**sampling, "logprobs_mode": mode}},
             {"prompt_token_ids": reference.prompt, "sampling": sampling}])
        result = named.unwrap()[0]
        ids = list(reference.prompt) + list(result.token_ids)
        raw = reference.logits(ids)[len(reference.prompt) - 1:-1].double().log_softmax(-1)
        for step, token in enumerate(result.token_ids):
            assert abs(result.logprobs[step] - float(raw[step, token])) < TOLERANCE
        if harness.caps.logprobs_mode == mode and seeded:
            same = default.unwrap()[0]
            assert same.token_ids == result.token_ids
            assert all(abs(a - b) < TOLERANCE for a, b in zip(same.logprobs, result.logprobs))

    @HYPOTHESIS
    @given(s=sampled_settings())
    def test_processed_logprobs_are_the_distribution_sampled_from(self, harness, reference,
                                                                   s):
        """Every sampled token lies in the kept set, and its logprob and the top ones are
        the renormalised distribution it was drawn from, within float32 error."""
        _skip_unless(harness, "processed")
        prompt = reference.repeating
        sampling = {**s, "max_tokens": 8, "ignore_eos": True, "logprobs": 3, "n": 2,
                    "logprobs_mode": "processed"}
        if s["temperature"] == 0:
            sampling["n"] = 1
        results = _answered(harness.rollout.generate(
            [{"prompt_token_ids": prompt, "sampling": sampling}])[0], refused_by(harness.caps, s))
        if results is None:
            return
        checked = 0
        for result in results:
            ids = list(prompt) + list(result.token_ids)
            logits = reference.logits(ids)[len(prompt) - 1:-1]
            for step, token in enumerate(result.token_ids):
                expected, ambiguous = processed_reference(
                    logits[step], prompt, list(result.token_ids[:step]), s)
                if ambiguous:
                    continue
                assert expected[token] > float("-inf"), f"step {step}: {token} outside the set"
                assert abs(result.logprobs[step] - float(expected[token])) < TOLERANCE, (
                    step, result.logprobs[step], float(expected[token]))
                tops = [t.logprob for t in result.top_logprobs[step]]
                want = expected.topk(len(tops)).values.tolist()
                assert all(abs(a - b) < TOLERANCE for a, b in zip(tops, want)
                           if b > -1e30), (tops, want)
                checked += 1
        assert checked, "every step sat on a boundary"


    @HYPOTHESIS
    @given(s=sampled_settings())
    def test_each_token_lies_in_its_sampling_mask_which_is_the_kept_set(self, harness,
                                                                        reference, s):
        _skip_unless(harness, None)
        prompt = reference.repeating
        sampling = {**s, "max_tokens": 6, "ignore_eos": True, "return_sampling_mask": True,
                    "n": 1 if s["temperature"] == 0 else 2}
        results = _answered(harness.rollout.generate(
            [{"prompt_token_ids": prompt, "sampling": sampling}])[0], refused_by(harness.caps, s))
        for result in results or ():
            assert len(result.sampling_mask) == len(result.token_ids)
            logits = reference.logits(list(prompt) + list(result.token_ids))[len(prompt) - 1:-1]
            for step, (token, mask) in enumerate(zip(result.token_ids, result.sampling_mask)):
                assert token in mask, f"step {step}: {token} not in its mask"
                if s["temperature"] == 0:
                    assert mask == (token,)
                    continue
                expected, ambiguous = processed_reference(
                    logits[step], prompt, list(result.token_ids[:step]), s)
                if not ambiguous:
                    kept = (expected > float("-inf")).nonzero()[:, 0].tolist()
                    assert sorted(mask) == kept, (step, len(mask), len(kept))

    def test_renormalised_over_the_mask_a_trainer_is_on_policy(self, harness, reference):
        """TRL #6789's case (top_p=0.8): the trainer's own temperature-scaled distribution,
        renormalised over each token's mask, against the engine's processed logprobs: the
        mean importance ratio is within 1% of 1 (without the mask it is the kept mass)."""
        _skip_unless(harness, "processed")
        _skip_unless(harness, None)
        import torch

        prompt = reference.repeating
        ratios, truncated = [], []
        for temperature in (1.0, 0.7):
            sampling = {"temperature": temperature, "top_p": 0.8, "max_tokens": 16, "n": 4,
                        "ignore_eos": True, "logprobs": 0, "logprobs_mode": "processed",
                        "return_sampling_mask": True}
            for result in harness.rollout.generate(
                    [{"prompt_token_ids": prompt, "sampling": sampling}])[0].unwrap():
                logits = reference.logits(list(prompt) + list(result.token_ids))[
                    len(prompt) - 1:-1].double() / temperature
                trainer = logits.log_softmax(-1)
                for step, (token, mask) in enumerate(zip(result.token_ids,
                                                         result.sampling_mask)):
                    kept = trainer[step, list(mask)].logsumexp(-1)
                    engine = result.logprobs[step]
                    ratios.append(math.exp(float(trainer[step, token] - kept) - engine))
                    truncated.append(math.exp(float(trainer[step, token]) - engine))
        mean = sum(ratios) / len(ratios)
        assert abs(mean - 1) < 0.01, mean
        assert sum(truncated) / len(truncated) < 0.99  # (the mask is what made it 1)
        assert torch.isfinite(torch.tensor(ratios)).all()


def _skip_unless(harness, mode: str | None) -> None:
    """Skip unless the backend gives logprobs in `mode`, or (None) sampling masks."""
    capability = "sampling_mask" if mode is None else f"logprobs_mode.{mode}"
    if not harness.caps.supports(capability):
        pytest.skip(f"{capability} unsupported by this backend: "
                    f"{harness.caps.unsupported[capability]}")


class OnPolicyOnly:
    """Mix into a `BackendContract` subclass whose backend differs from another only in
    its logprobs mode: it runs the on-policy tests alone."""

    @pytest.fixture(autouse=True)
    def _on_policy_only(self, request):
        if "logprob" not in request.node.name and "mask" not in request.node.name:
            pytest.skip("not about logprobs: the same as in the backend's other mode")
