"""What the backend says to SGLang and how it reads the answers, for both engines.

Bodies are plain dicts: the in-process engine passes them as keyword arguments to
`Engine.async_generate` or to SGLang's request structs, the server engine sends them as JSON.
`STRUCTS` names the SGLang class each body must construct, so tests can check every body
against the installed SGLang (a renamed field then fails a test, not a user).
"""

from __future__ import annotations

from typing import NamedTuple

from rollout import GenerationError, InvalidRequestError, RolloutError
from rollout.schemas import SamplingParams

# body name -> (module, class) in sglang.srt
STRUCTS = {
    "generate": ("sglang.srt.managers.io_struct", "GenerateReqInput"),
    "sampling": ("sglang.srt.sampling.sampling_params", "SamplingParams"),
    "abort": ("sglang.srt.managers.io_struct", "AbortReq"),
    "begin_weight_update": ("sglang.srt.managers.io_struct", "BeginWeightUpdateReqInput"),
    "update_weights_from_tensor": ("sglang.srt.managers.io_struct",
                                   "UpdateWeightsFromTensorReqInput"),
    "end_weight_update": ("sglang.srt.managers.io_struct", "EndWeightUpdateReqInput"),
    "update_weights_from_disk": ("sglang.srt.managers.io_struct", "UpdateWeightFromDiskReqInput"),
    "release": ("sglang.srt.managers.io_struct", "ReleaseMemoryOccupationReqInput"),
    "resume": ("sglang.srt.managers.io_struct", "ResumeMemoryOccupationReqInput"),
}


def struct(name: str):
    import importlib

    module, cls = STRUCTS[name]
    return getattr(importlib.import_module(module), cls)


class Sample(NamedTuple):
    token_ids: list[int]
    finish_reason: str  # stop, length or abort
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def sampling_body(s: SamplingParams) -> dict:
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
            "max_new_tokens": s.max_tokens, "stop": list(s.stop),
            "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos}


def generate_body(rid: str, prompt: list[int], s: SamplingParams) -> dict:
    """One sample of one request. `n` samples are `n` bodies with their own rids, because
    SGLang's own `n` replaces the rids and its samples could then not be aborted."""
    body = {"rid": rid, "input_ids": prompt, "sampling_params": sampling_body(s),
            "stream": False}
    if s.logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=s.logprobs)
    return body


def abort_body(rid: str | None) -> dict:
    return {"abort_all": True} if rid is None else {"rid": rid}


def update_tensor_body(payload) -> dict:
    # One payload per tensor-parallel rank; flush_cache drops KV computed with old weights.
    return {"serialized_named_tensors": [payload], "flush_cache": True}


def parse_output(out: dict, logprobs: int | None) -> Sample:
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {"type": "abort"}
    kind = finish.get("type")
    if kind == "abort" and finish.get("status_code") not in (None, 200):
        # SGLang ends a request it rejected as "abort" with an HTTP-like status code.
        raise engine_error(str(finish.get("message", finish)))
    if kind not in ("stop", "length", "abort"):
        raise GenerationError(f"SGLang finished a request with {finish!r}")
    ids = [int(t) for t in out["output_ids"]]
    chosen = top = None
    if logprobs is not None:
        chosen = [float(step[0]) for step in meta.get("output_token_logprobs") or []]
    if logprobs:
        top = [sorted(((int(t), float(lp)) for lp, t, *_ in step or []),
                      key=lambda pair: -pair[1])[:logprobs]
               for step in meta.get("output_top_logprobs") or []]
    return Sample(ids, kind, chosen, top)


def engine_error(message: str) -> RolloutError:
    """SGLang's own request validation, as a per-request error naming our field."""
    lowered = message.lower()
    if "requested token count" in lowered or "max_new_tokens" in lowered:
        return InvalidRequestError("sampling.max_tokens", message)
    if "context length" in lowered or "input_ids" in lowered or "too long" in lowered:
        return InvalidRequestError("prompt_token_ids", message)
    for field in ("temperature", "top_p", "top_k", "stop_token_ids", "stop"):
        if field in lowered:
            return InvalidRequestError(f"sampling.{field}", message)
    return GenerationError(message)
