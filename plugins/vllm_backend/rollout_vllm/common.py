"""What the vLLM engines share: a request's sampling as vLLM's SamplingParams, vLLM's delta
outputs as chunks, its refusals as our typed errors, the counts of its multimodal processor
cache in this process, where its sockets go, and the step after any reload of its weights
(in the worker extension and the gloo transfer engine alike)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager

import attrs

from rollout import Chunk, GenerationError, InvalidRequestError, RolloutError, TokenLogprob

from rollout_vllm.engine import Spans

FINISH_REASONS = ("stop", "length", "abort")
FIRST_WEIGHTS = "default"  # vLLM's weight version until one is named
# A request that is stopped: how long to wait for what vLLM made and held back (one step,
# or a weight load that runs); after it, what was handed over is what the caller gets.
END_TIMEOUT_S = 10


def private_socket_folder() -> None:
    """vLLM names its ZMQ sockets `/tmp/<uuid>`, and an engine ended by a signal (as a server
    is stopped) leaves them there, seven an engine. Unless the user chose their place
    (VLLM_RPC_BASE_PATH), they go in a folder of this process's, removed when it exits."""
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        folder = tempfile.mkdtemp(prefix="rollout-vllm-sockets-")
        os.environ["VLLM_RPC_BASE_PATH"] = folder
        atexit.register(shutil.rmtree, folder, True)


def request_error(message: str, parameter: str | None = None) -> RolloutError:
    """vLLM's own request validation, as a per-request error naming our field."""
    if parameter == "input_tokens" or "context length" in message or "out of vocabulary" in message:
        return InvalidRequestError("prompt_token_ids", message)
    if parameter:
        return InvalidRequestError(f"sampling.{parameter}", message)
    return GenerationError(message)


def refusal(exc: Exception) -> Exception:
    """What vLLM raised on taking a request, as that request's error where it is one."""
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, RolloutError):
        return exc
    if isinstance(exc, VLLMClientError):
        return request_error(str(exc), getattr(exc, "parameter", None))
    if isinstance(exc, ValueError):
        return request_error(str(exc))
    return exc


def finish_reason(reason: str | None, index: int) -> str | None:
    """vLLM's finish reason for sample `index`, one of the contract's; any other fails."""
    if reason is not None and reason not in FINISH_REASONS:
        raise GenerationError(f"vLLM ended sample {index} with {reason!r}")
    return reason


def sampling_params(params: dict, stream_interval: int):
    """vLLM's SamplingParams for our request, deltas only; its refusal as the request's
    error. `stream_interval` applies where `params` names none."""
    # From its module: `from vllm import` goes through vLLM's lazy `__getattr__` (5 us).
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    structured = params.get("structured_outputs")
    try:
        return SamplingParams(**{
            **params, "output_kind": RequestOutputKind.DELTA,
            "stream_interval": params.get("stream_interval", stream_interval),
            # vLLM's text is not used (the core decodes tokens): made only to find stops.
            "detokenize": bool(params.get("stop")),
            "structured_outputs": StructuredOutputsParams(**structured)
            if structured else None,
            # Made fresh for each call, as vLLM's server makes its own: its deep copy
            # (about 20 us a request) protects nothing here.
            "skip_clone": True})
    except Exception as exc:  # noqa: BLE001 - as the request's error where it is one
        raise refusal(exc) from None


def chunks(outputs: list, k: int | None, pk: int | None = None) -> list[Chunk | Spans]:
    """A chunk per sample from delta RequestOutputs (several merged when they piled up),
    with vLLM's count of the prompt tokens it found in its prefix cache, the prompt's
    scores (`pk`: sampling.prompt_logprobs) first where vLLM gave them, and a finished
    sample's `Spans` before its last chunk."""
    made: list = []
    spans = {o.index: o.weight_versions for output in outputs for o in output.outputs
             if o.weight_versions}
    for chunk in _chunks(outputs, k):
        if chunk.finish_reason is not None and chunk.index in spans:
            made.append(Spans(chunk.index, [(0 if v.version == FIRST_WEIGHTS else
                                             int(v.version), v.start, v.end)
                                            for v in spans[chunk.index]]))
        made.append(chunk)
    if pk is not None:
        scored = next((o for o in outputs if o.prompt_logprobs), None)
        if scored is not None:
            made.insert(0, Chunk(0, **prompt_scores(scored.prompt_token_ids,
                                                    scored.prompt_logprobs, pk)))
    return made


def unfinished(items: list) -> list:
    """The chunks (and `Spans`) of a request's last outputs, taken as it is stopped: vLLM
    ends its samples with "abort", which is not theirs to say (the core stops them, and may
    go on from them later); chunks left with nothing to give are dropped."""
    kept = []
    for item in items:
        if isinstance(item, Chunk) and item.finish_reason == "abort":
            item = attrs.evolve(item, finish_reason=None)
            if not item.token_ids and item.prompt_logprobs is None:
                continue
        kept.append(item)
    return kept


def prompt_scores(prompt: list[int], steps: list, k: int) -> dict:
    """vLLM's prompt logprobs (None, then per position token id -> Logprob, the prompt's
    token and the top k) as the Chunk's fields."""
    if len(steps) != len(prompt):
        raise GenerationError(f"vLLM scored {len(steps)} positions of a {len(prompt)}-token "
                              "prompt")
    values = [None, *(float(step[t].logprob) for t, step in zip(prompt[1:], steps[1:]))]
    return {"prompt_logprobs": values,
            "prompt_top_logprobs": [(), *_top(steps[1:], k)] if k else None}


def _chunks(outputs: list, k: int | None) -> list[Chunk]:
    cached = outputs[-1].num_cached_tokens
    if len(outputs) == 1:  # the usual case: one step's output
        return [Chunk(o.index, o.token_ids, _chosen(o.token_ids, o.logprobs) if k is not None
                      else None, _top(o.logprobs, k) if k else None,
                      finish_reason(o.finish_reason, o.index), cached_tokens=cached)
                for o in outputs[0].outputs]
    merged: dict[int, list] = {}
    for output in outputs:
        for o in output.outputs:
            m = merged.setdefault(o.index, [[], [], [], None])
            m[0] += o.token_ids
            if k is not None:
                m[1] += _chosen(o.token_ids, o.logprobs)
            if k:
                m[2] += _top(o.logprobs, k)
            m[3] = finish_reason(o.finish_reason, o.index) or m[3]
    return [Chunk(i, tokens, logprobs if k is not None else None, top if k else None, finish,
                  cached_tokens=cached)
            for i, (tokens, logprobs, top, finish) in merged.items()]


def _chosen(token_ids, logprobs) -> list[float]:
    return [float(step[t].logprob) for t, step in zip(token_ids, logprobs)]


def _top(logprobs, k: int) -> list[tuple[TokenLogprob, ...]]:
    # vLLM adds the chosen token to each position's top k, wherever it ranks.
    return [tuple(TokenLogprob(t, lp) for t, lp in sorted(
        ((int(t), float(x.logprob)) for t, x in step.items() if x.rank <= k),
        key=lambda pair: -pair[1])[:k]) for step in logprobs]


class MMCacheCounts:
    """(hits, lookups) of vLLM's multimodal processor cache in this process, cumulative since
    the engine started. Read with `make_stats()` without `delta`, which resets nothing (vLLM's
    stats logger owns the deltas). vLLM zeroes the counts when it clears the cache (on sleep),
    so the counts read last before a clear go into `base`; `release` reads around it."""

    def __init__(self, cache):
        self.cache = cache
        self.lock = threading.Lock()  # read from any thread
        self.base = self.last = (0, 0)

    @classmethod
    def of(cls, renderer) -> MMCacheCounts | None:
        cache = renderer.mm_processor_cache  # None: a text model, or the cache turned off
        return None if cache is None else cls(cache)

    def read(self) -> tuple[int, int]:
        with self.lock:
            info = self.cache.make_stats()
            if info.total < self.last[1]:  # cleared since the last read
                self.base = (self.base[0] + self.last[0], self.base[1] + self.last[1])
            self.last = (info.hits, info.total)
            return self.base[0] + info.hits, self.base[1] + info.total


@contextmanager
def counted_across_clear(counts: MMCacheCounts | None):
    """Read just before and after a call that may clear the cache (no request runs then):
    the counts before it are kept, and the clear is seen before any new lookup."""
    if counts is not None:
        counts.read()
    try:
        yield
    finally:
        if counts is not None:
            counts.read()


def refresh_tied_output(model, names) -> None:
    """Pack a tied output layer again after its embedding was reloaded. vLLM's reload skips
    `lm_head` when it shares the embedding's weight, and its CPU kernels run the output
    layer from a packed copy made at load time: without this, a model with tied embeddings
    (SmolLM2, for one) keeps computing its logits from the old embedding."""
    head = getattr(model, "lm_head", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if head is None or not tied or not any(n.endswith("embed_tokens.weight") for n in names):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
