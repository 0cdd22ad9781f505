"""What the backend says to SGLang and how it reads the answers, for both engines.

Bodies are plain dicts: the in-process engine passes them as keyword arguments to
`Engine.async_generate` or to SGLang's request structs, the server engine sends them as JSON.
`STRUCTS` names the SGLang class each body must construct, so tests can check every body
against the installed SGLang (a renamed field then fails a test, not a user).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import NamedTuple

from rollout import GenerationError, InvalidRequestError, RolloutError, TokenLogprob
from rollout.contract.schemas import SamplingParams, StructuredOutputs
from rollout.kit.structured import choice_grammar, structural_tag_grammar

# body name -> (module, class) in sglang.srt
STRUCTS = {
    "generate": ("sglang.srt.managers.io_struct", "GenerateReqInput"),
    "sampling": ("sglang.srt.sampling.sampling_params", "SamplingParams"),
    "begin_weight_update": ("sglang.srt.managers.io_struct", "BeginWeightUpdateReqInput"),
    "update_weights_from_tensor": ("sglang.srt.managers.io_struct",
                                   "UpdateWeightsFromTensorReqInput"),
    "end_weight_update": ("sglang.srt.managers.io_struct", "EndWeightUpdateReqInput"),
    "update_weights_from_disk": ("sglang.srt.managers.io_struct", "UpdateWeightFromDiskReqInput"),
    "init_weights_update_group": ("sglang.srt.managers.io_struct",
                                  "InitWeightsUpdateGroupReqInput"),
    "update_weights_from_distributed": ("sglang.srt.managers.io_struct",
                                        "UpdateWeightsFromDistributedReqInput"),
    "destroy_weights_update_group": ("sglang.srt.managers.io_struct",
                                     "DestroyWeightsUpdateGroupReqInput"),
    "release": ("sglang.srt.managers.io_struct", "ReleaseMemoryOccupationReqInput"),
    "resume": ("sglang.srt.managers.io_struct", "ResumeMemoryOccupationReqInput"),
    "load_lora_adapter_from_tensors": ("sglang.srt.managers.io_struct",
                                       "LoadLoRAAdapterFromTensorsReqInput"),
    "unload_lora_adapter": ("sglang.srt.managers.io_struct", "UnloadLoRAAdapterReqInput"),
    "pause_generation": ("sglang.srt.managers.io_struct", "PauseGenerationReqInput"),
    "continue_generation": ("sglang.srt.managers.io_struct", "ContinueGenerationReqInput"),
    "update_weight_version": ("sglang.srt.managers.io_struct", "UpdateWeightVersionReqInput"),
}
# Held in place, a paused scheduler keeps its running requests and their KV cache. Going
# on, it is not asked to empty torch's CUDA cache (SGLang's default), which gives memory
# back only to other processes: a colocated trainer gets it from release().
PAUSE_IN_PLACE = {"mode": "in_place"}
GO_ON = {"torch_empty_cache": False}


# SGLang's name for the weights it started with; the backend names each update's weights
# by the number of updates made (SGLangBackend.updates).
FIRST_WEIGHTS = "default"


def weights_named(updates: int) -> dict:
    # (SGLang's HTTP server would abort every request first by default.)
    return {"new_version": str(updates), "abort_all_requests": False}


def weight_spans(meta: dict) -> list[tuple[int, int, int]] | None:
    """(updates, start, end) runs of a sample's output tokens by the weights that made
    them, from the output that ends it (SGLang's scheduler computes them as it finishes a
    request); None on any other output."""
    spans = meta.get("weight_versions")
    if spans is None:
        return None
    return [(0 if s["version"] == FIRST_WEIGHTS else int(s["version"]), s["start"], s["end"])
            for s in spans]


def struct(name: str):
    import importlib

    module, cls = STRUCTS[name]
    return getattr(importlib.import_module(module), cls)


class Delta(NamedTuple):
    """What one stream output of one sample adds."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[tuple[TokenLogprob, ...]] | None
    finish_reason: str | None  # stop, length or abort on the sample's last output
    # Prompt tokens SGLang took from its radix cache (meta_info["cached_tokens"], on each
    # output once the prompt is prefilled); None where an output does not carry it.
    cached_tokens: int | None = None
    # Per token, the ids it was drawn from, where the request asked SGLang for them.
    sampling_mask: list[tuple[int, ...]] | None = None


def processed(s: SamplingParams) -> bool:
    return s.logprobs is not None and s.logprobs_mode == "processed"


def asks_for_the_drawn_set(s: SamplingParams) -> bool:
    """Whether SGLang is asked for each token's sampling support (its sampling mask): for
    masks, and for processed logprobs, which it computes only there. A greedy token was
    drawn from itself alone, and its processed logprobs are SGLang's own (the logits after
    bias, penalties and the min_tokens ban, unscaled)."""
    return s.temperature > 0 and (s.return_sampling_mask or processed(s))


def sampling_body(s: SamplingParams) -> dict:
    body = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
            # With min_tokens the backend checks stop strings itself (SGLang would end a
            # sample on one before min_new_tokens).
            "max_new_tokens": s.max_tokens, "stop": [] if s.min_tokens else list(s.stop),
            "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
            # Penalties go to the backend's custom logit processor (processors.py).
            "min_p": s.min_p,
            "min_new_tokens": s.min_tokens,
            # SGLang's keys are strings (SamplingParams.logit_bias: Dict[str, float]).
            "logit_bias": {str(t): float(b) for t, b in s.logit_bias.items()} or None,
            # Token ids stop at the stop string either way; the core decodes the text.
            "no_stop_trim": s.include_stop_str_in_output}
    if s.structured_outputs is not None:
        body.update(constraint_body(s.structured_outputs))
    return body


def constraint_body(so: StructuredOutputs) -> dict:
    """SGLang's own constraint fields, compiled by its xgrammar backend. A choice becomes
    an EBNF of escaped alternatives (as vLLM builds it). A JSON schema becomes EBNF too,
    built by xgrammar with compact separators: SGLang's `json_schema` with
    constrained_json_disable_any_whitespace still writes `", "` and `": "` (it passes no
    separators to compile_json_schema, and xgrammar's default then has spaces)."""
    if so.regex is not None:
        return {"regex": so.regex}
    if so.grammar is not None:
        return {"ebnf": so.grammar}
    if so.choice is not None:
        return {"ebnf": choice_grammar(so.choice)}
    if so.structural_tag is not None:
        return {"ebnf": structural_tag_grammar(so.structural_tag)}
    return {"ebnf": json_grammar(so.json)}


def json_grammar(schema: dict) -> str:
    import json

    import xgrammar

    field = "sampling.structured_outputs.json"
    try:
        from sglang.srt.constrained.json_schema_validation import validate_xgrammar_json_schema
    except ImportError:  # an SGLang without it: xgrammar's own checks only
        validate_xgrammar_json_schema = None
    try:
        if validate_xgrammar_json_schema is not None:
            validate_xgrammar_json_schema(schema)  # what SGLang's json_schema path refuses
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=(",", ":"))
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, SGLang its own
        raise InvalidRequestError(field, f"cannot compile the JSON schema: {exc}") from None
    return str(grammar)


def generate_body(rid: str, prompt: list[int], s: SamplingParams,
                  image_data: list | None = None, lora: str | None = None,
                  stream_interval: int = 1, vocab_size: int | None = None) -> dict:
    """One sample of one request, streamed. `n` samples are `n` bodies with their own rids
    (SGLang's own `n` replaces the rids), so that one can be aborted alone. `image_data`:
    one image per placeholder of `prompt`, in order (SGLang expands each placeholder).
    `lora`: the name of the LoRA adapter SGLang samples with (None: the base weights).
    `stream_interval`: tokens per stream output (the last may hold fewer). `vocab_size`:
    the top_k that keeps every token, where SGLang is asked for the drawn set."""
    body = {"rid": rid, "input_ids": prompt,
            "sampling_params": {**sampling_body(s), "stream_interval": stream_interval},
            "stream": True, "lora_path": lora}
    if image_data:
        body["image_data"] = image_data
    if s.return_routed_experts:
        body["return_routed_experts"] = True
    if penalized(s):
        from rollout_sglang.processors import Penalties

        body["custom_logit_processor"] = Penalties.to_str()
        body["sampling_params"]["custom_params"] = {name: getattr(s, name) for name in NEUTRAL}
    if asks_for_the_drawn_set(s):
        # SGLang returns the set only under a finite top_k, at most its
        # sampling_mask_max_tokens (which the backend starts at the vocabulary's size).
        if body["sampling_params"]["top_k"] == -1:
            body["sampling_params"]["top_k"] = vocab_size
        body["return_sampling_mask"] = True
        if processed(s):
            # Its logprob of each token renormalised over the set ("selected"), or of
            # every token of the set ("support"), the top ones taken from it.
            body["sampling_logprobs_mode"] = "support" if s.logprobs else "selected"
            return body
    if s.logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=s.logprobs)
    return body


# The penalties' values that change nothing.
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def penalty(s: SamplingParams) -> str | None:
    """The first penalty the request sets, if any."""
    return next((name for name, value in NEUTRAL.items() if getattr(s, name) != value), None)


def penalized(s: SamplingParams) -> bool:
    return penalty(s) is not None


def reshapes_logprobs(s: SamplingParams) -> bool:
    """SGLang computes output logprobs from the logits after logit_bias, the min_new_tokens
    ban (ModelRunner._preprocess_logits applies them in place) and custom processors (the
    penalties) where the contract wants the raw model's."""
    return penalized(s) or bool(s.logit_bias) or s.min_tokens > 0


def score_body(rid: str, prompt: list[int], tokens: list[int], logprobs: int,
               image_data: list | None = None, expanded: int | None = None,
               lora: str | None = None) -> dict:
    """A prefill of prompt + sample that generates nothing and returns the sample's raw
    logprobs as input logprobs (the logits processor's, with no penalty, bias or
    temperature). It starts one token early: SGLang gives the first position None. With
    images, SGLang counts that start in the prompt it expanded (each image's run of
    tokens): `expanded` is that prompt's length (SGLang's `prompt_tokens`)."""
    if image_data and expanded is None:
        raise GenerationError("SGLang did not say how long the image prompt it scored is")
    body = {"rid": rid, "input_ids": list(prompt) + list(tokens),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": (expanded if image_data else len(prompt)) - 1,
            "top_logprobs_num": logprobs, "stream": False, "lora_path": lora}
    if image_data:
        body["image_data"] = image_data
    return body


def prompt_score_body(rid: str, prompt: list[int], logprobs: int,
                      lora: str | None = None) -> dict:
    """A prefill of the prompt alone that generates nothing and returns the raw logprob of
    every prompt token (`sampling.prompt_logprobs`), with the top `logprobs` per position."""
    return {"rid": rid, "input_ids": list(prompt),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": logprobs,
            "stream": False, "lora_path": lora}


def parse_prompt_scores(out: dict, prompt: int, logprobs: int) -> dict:
    """The Chunk fields of a prompt_score_body's answer: None, then the logprob of each
    later prompt token; for k > 0 the top k per position (none at the first)."""
    meta = out["meta_info"]
    steps = meta.get("input_token_logprobs") or []
    if len(steps) != prompt:
        raise GenerationError(f"SGLang scored {len(steps)} positions of a {prompt}-token prompt")
    values = [None, *(_logprob(step[0]) for step in steps[1:])]
    tops = None
    if logprobs:
        tops = [(), *(_top(step, logprobs) for step in (meta.get("input_top_logprobs") or [])[1:])]
        if len(tops) != prompt:
            raise GenerationError(f"SGLang gave the top logprobs of {len(tops)} positions "
                                  f"of a {prompt}-token prompt")
    return {"prompt_logprobs": values, "prompt_top_logprobs": tops}


def parse_scores(out: dict, tokens: int, logprobs: int):
    """(logprobs, top_logprobs) of the `tokens` scored tokens."""
    meta = out["meta_info"]
    chosen = [_logprob(step[0]) for step in (meta.get("input_token_logprobs") or [])[1:]]
    if len(chosen) != tokens:
        raise GenerationError(f"SGLang scored {len(chosen)} of {tokens} tokens")
    top = [_top(step, logprobs) for step in (meta.get("input_top_logprobs") or [])[1:]] \
        if logprobs else None
    return chosen, top


def _top(step, k: int) -> tuple[TokenLogprob, ...]:
    """SGLang's (logprob, token id, text) entries of one position, most likely first."""
    pairs = sorted(((_logprob(lp), int(t)) for lp, t, *_ in step or []), key=lambda p: -p[0])
    return tuple(TokenLogprob(t, lp) for lp, t in pairs[:k])


def _logprob(value) -> float:
    # The server's JSON (orjson) writes -inf, a token a constraint masks, as null.
    return -math.inf if value is None else float(value)


# No flush with an update: SGLang then fails the update while aborted requests are still
# leaving its scheduler; the backend flushes once after it, retrying until they are gone.
def update_tensor_body(payload) -> dict:
    # One payload per tensor-parallel rank.
    return {"serialized_named_tensors": [payload], "flush_cache": False}


def update_disk_body(path: str) -> dict:
    return {"model_path": path, "flush_cache": False}


def adapter_body(name: str, rank: int, scale: float, modules: list[str], payload) -> dict:
    """Load LoRA adapter `name` from the payload of a flattened bucket of PEFT's names.
    SGLang scales by lora_alpha / r and reads no rsLoRA flag: the alpha sent is the one
    that gives `scale`."""
    return {"lora_name": name, "serialized_named_tensors": [payload],
            "load_format": "flattened_bucket",
            "config_dict": {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank,
                            "target_modules": modules}}


def init_group_body(host: str, port: int, group_name: str, backend: str) -> dict:
    """The server joins as rank 1 of 2 (its only tensor-parallel rank); the trainer is 0."""
    return {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": backend}


def update_distributed_body(group: list, group_name: str) -> dict:
    """What one group of broadcasts will carry, tensor by tensor in this order; SGLang
    receives each into a new tensor of this dtype and shape."""
    return {"names": [name for name, _ in group],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in group],
            "shapes": [list(t.shape) for _, t in group],
            "group_name": group_name, "flush_cache": False}


def parse_delta(out: dict, logprobs: int | None, from_mask: bool = False) -> Delta:
    """One output of a sample's stream. The engines run SGLang with
    incremental_streaming_output, so its output ids, logprobs and masks are the new ones
    only (without it they are everything so far). `from_mask`: the logprobs are the
    sampling mask's, processed (generate_body asked for them there)."""
    meta = out["meta_info"]
    finish = meta.get("finish_reason")
    kind = None
    if finish is not None:
        kind = finish.get("type")
        if kind == "abort" and finish.get("status_code") not in (None, 200):
            # SGLang ends a request it rejected as "abort" with an HTTP-like status code.
            raise engine_error(str(finish.get("message", finish)))
        if kind not in ("stop", "length", "abort"):
            raise GenerationError(f"SGLang finished a request with {finish!r}")
    ids = out["output_ids"]
    chosen = top = masks = None
    if "output_token_sampling_mask" in meta:
        masks = [tuple(m) for m in meta["output_token_sampling_mask"]]
        if len(masks) != len(ids):
            raise GenerationError(f"SGLang sent {len(masks)} sampling masks for "
                                  f"{len(ids)} tokens")
    if from_mask:
        chosen, top = _drawn_logprobs(ids, masks, meta["output_token_sampling_logprobs"],
                                      logprobs)
    elif logprobs is not None:
        chosen = [_logprob(step[0]) for step in meta.get("output_token_logprobs") or ()]
        if len(chosen) != len(ids):
            raise GenerationError(f"SGLang sent {len(chosen)} logprobs for {len(ids)} tokens")
        if logprobs:
            top = [_top(step, logprobs) for step in meta.get("output_top_logprobs") or ()]
    cached = meta.get("cached_tokens")
    return Delta(ids, chosen, top, kind, None if cached is None else int(cached), masks)


def _drawn_logprobs(ids: list[int], masks: list[tuple[int, ...]], values: list, k: int):
    """Processed logprobs from SGLang's sampling mask: for k = 0 its logprob of each token
    ("selected"); for k > 0 those of the whole set ("support"), of which the top k are
    the top logprobs (padded with -inf ones where the set is smaller, as a distribution
    that gives every other token -inf would be)."""
    if not k:
        return [float(v) for v in values], None
    chosen, top = [], []
    for token, mask, support in zip(ids, masks, values, strict=True):
        logprob = dict(zip(mask, support, strict=True))
        chosen.append(float(logprob[token]))
        best = heapq.nlargest(k, logprob.items(), key=lambda p: p[1])
        outside = (t for t in itertools.count() if t not in logprob)
        best += [(next(outside), -math.inf) for _ in range(k - len(best))]
        top.append(tuple(TokenLogprob(t, float(lp)) for t, lp in best))
    return chosen, top


def routed_experts(encoded: str, tokens: int, top_k: int):
    """SGLang's routing of a sample that ran `tokens` tokens through the model (base64
    int32, [tokens, MoE layers, top_k] flattened), as `Result.routed_experts` holds it."""
    import base64

    import numpy as np

    ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if not tokens or not ids.size or ids.size % (tokens * top_k):
        raise GenerationError(f"SGLang routed {ids.size} expert ids, not {top_k} per MoE "
                              f"layer for each of {tokens} tokens")
    rows = ids.reshape(tokens, -1, top_k).tolist()
    return tuple(tuple(tuple(layer) for layer in row) for row in rows)


def engine_error(message: str) -> RolloutError:
    """SGLang's own request validation, as a per-request error naming our field."""
    lowered = message.lower()
    if "requested token count" in lowered or "max_new_tokens" in lowered:
        return InvalidRequestError("sampling.max_tokens", message)
    if "context length" in lowered or "input_ids" in lowered or "too long" in lowered:
        return InvalidRequestError("prompt_token_ids", message)
    if "grammar" in lowered or "regex" in lowered or "ebnf" in lowered or "json" in lowered:
        return GenerationError(message)  # the backend names the request's constraint
    for field in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
                  "logit_bias", "temperature", "top_p", "top_k", "stop_token_ids", "stop"):
        if field in lowered:
            return InvalidRequestError(f"sampling.{field}", message)
    return GenerationError(message)
