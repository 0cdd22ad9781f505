"""The server's Prometheus metrics (`/metrics`), made with the standard client library.

Names follow vLLM's server where the meaning is the same, under `rollout:` instead of
`vllm:` (`rollout:num_requests_running`, `rollout:time_to_first_token_seconds`, ...), with
the `model_name` label; rollout's own (weights, replicas) sit beside them. Each server has
a registry of its own; the process's default registry (the agent runner's counters) is
rendered with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.contract.errors import RolloutError
from rollout.contract.schemas import Chunk, Completion, Request
from rollout.service.service import WrappedStream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80,
                160, 640)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5,
                10, 20, 80)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 60, 120, 240, 480, 960,
               1920, 7680)
UPDATE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)

requests_log = logging.getLogger("rollout.requests")


class ServerMetrics:
    def __init__(self, service, model_name: str, log_prompts: bool = False):
        self.model_name = model_name
        self.log_prompts = log_prompts
        self.registry = registry = CollectorRegistry()
        model = ["model_name"]

        def counter(name, text, labels=()):
            return Counter(name, text, [*model, *labels], registry=registry)

        def histogram(name, text, buckets, labels=()):
            return Histogram(name, text, [*model, *labels], buckets=buckets, registry=registry)

        self.prompt_tokens = counter("rollout:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("rollout:generation_tokens", "Tokens generated.")
        self.success = counter("rollout:request_success", "Finished requests, by finish "
                               "reason of their samples.", ["finished_reason"])
        self.errors = counter("rollout:request_errors", "Failed requests and refused calls, "
                              "by error kind.", ["kind"])
        self.ttft = histogram("rollout:time_to_first_token_seconds", "From arrival to the "
                              "first token.", TTFT_BUCKETS)
        self.tpot = histogram("rollout:time_per_output_token_seconds", "Between output "
                              "tokens, after the first.", TPOT_BUCKETS)
        self.e2e = histogram("rollout:e2e_request_latency_seconds", "From arrival to the "
                             "last token.", E2E_BUCKETS)
        self.updates = counter("rollout:weight_updates", "Weight updates finished, by "
                               "transport.", ["transport"])
        self.update_seconds = histogram("rollout:weight_update_duration_seconds", "From "
                                        "begin to end of a weight update, by transport.",
                                        UPDATE_BUCKETS, ["transport"])
        registry.register(_ServiceState(service, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(REGISTRY)

    def labels(self, metric, *values):
        return metric.labels(self.model_name, *values)

    def error(self, exc: BaseException, kind: str | None = None) -> None:
        """Count an error once, however many layers (service, route, middleware) see it."""
        if getattr(exc, "_rollout_counted", False):
            return
        try:
            exc._rollout_counted = True
        except AttributeError:  # an exception without a __dict__: counted each time
            pass
        if kind is None:
            kind = exc.kind if isinstance(exc, RolloutError) else type(exc).__name__
        self.labels(self.errors, kind).inc()

    def finished(self, request: Request, completion: Completion, e2e: float,
                 first_token: float | None = None) -> None:
        """A request's figures; `first_token`: seconds from arrival to its first token,
        where this process saw it (else taken from the engine's timing)."""
        if completion.error is not None:
            self.error(completion.error)
            _log_request(request, completion, e2e, self.log_prompts)
            return
        results = completion.results
        tokens = [r.completion_tokens for r in results]
        if results:
            self.labels(self.prompt_tokens).inc(results[0].prompt_tokens)
        self.labels(self.generation_tokens).inc(sum(tokens))
        for result in results:
            self.labels(self.success, result.finish_reason).inc()
        timing = completion.timing
        if first_token is None and timing is not None and timing.first_token_s is not None:
            # the engine's time from its first token to its last, counted back from the end
            first_token = max(0.0, e2e - (timing.total_s - timing.first_token_s))
        if first_token is not None:
            self.labels(self.ttft).observe(first_token)
            if max(tokens, default=0) > 1:
                self.labels(self.tpot).observe((e2e - first_token) / (max(tokens) - 1))
        self.labels(self.e2e).observe(e2e)
        _log_request(request, completion, e2e, self.log_prompts)

    def weight_update(self, transport: str, seconds: float) -> None:
        self.labels(self.updates, transport).inc()
        self.labels(self.update_seconds, transport).observe(seconds)


class _ServiceState:
    """Gauges read off the service at each scrape: requests running and waiting, weights,
    replicas."""

    def __init__(self, service, model_name: str):
        self.service = service
        self.model_name = model_name

    def collect(self):
        if not hasattr(self.service, "state"):  # a service of someone else's: no gauges
            return
        state = self.service.state()
        model = [self.model_name]

        def gauge(name, text, value, labels=(), values=()):
            family = GaugeMetricFamily(name, text, labels=["model_name", *labels])
            family.add_metric([*model, *values], value)
            return family

        yield gauge("rollout:num_requests_running", "Requests running.", state["running"])
        yield gauge("rollout:num_requests_waiting", "Requests waiting for a turn.",
                    state["waiting"])
        if state["weight_version"] is not None:
            yield gauge("rollout:weight_version", "Version of the weights that serve.",
                        state["weight_version"])
        yield gauge("rollout:weights_dirty", "1 while a weight update that failed midway "
                    "keeps a backend from serving.", int(state["weights_dirty"]))
        replicas = state["replicas"]
        if replicas:
            healthy = GaugeMetricFamily("rollout:replica_healthy", "1 while the replica "
                                        "serves.", labels=["model_name", "replica"])
            running = GaugeMetricFamily("rollout:replica_requests_running", "Requests in "
                                        "flight to the replica.",
                                        labels=["model_name", "replica"])
            restarts = CounterMetricFamily("rollout:replica_restarts", "Times the replica's "
                                           "process was started again.",
                                           labels=["model_name", "replica"])
            for r in replicas:
                labels = [*model, r["replica"]]
                healthy.add_metric(labels, int(r["healthy"]))
                running.add_metric(labels, r["running"])
                restarts.add_metric(labels, r["restarts"])
            yield from (healthy, running, restarts)


class Metered:
    """A service whose requests are counted into `metrics`; the rest is the service's."""

    def __init__(self, service, metrics: ServerMetrics):
        self._service = service
        self.metrics = metrics

    def __getattr__(self, name):
        return getattr(self._service, name)

    async def generate(self, request: Request) -> Completion:
        started = time.monotonic()
        try:
            completion = await self._service.generate(request)
        except RolloutError as exc:
            self.metrics.error(exc)
            raise
        self.metrics.finished(request, completion, time.monotonic() - started)
        return completion

    def stream(self, request: Request) -> MeteredStream:
        return MeteredStream(self.metrics, request, self._service.stream(request))


class MeteredStream(WrappedStream):
    def __init__(self, metrics: ServerMetrics, request: Request, stream):
        super().__init__(stream)
        self.metrics = metrics
        self.request = request

    async def _chunks(self) -> AsyncIterator[Chunk]:
        started, first_token = time.monotonic(), None
        try:
            async for chunk in self.stream:
                if first_token is None and chunk.token_ids:
                    first_token = time.monotonic() - started
                yield chunk
        except RolloutError as exc:
            self.metrics.error(exc)
            raise
        if self.stream.completion is not None:
            self.metrics.finished(self.request, self.stream.completion,
                                  time.monotonic() - started, first_token)


def _log_request(request: Request, completion: Completion, e2e: float,
                 with_prompt: bool) -> None:
    if not requests_log.isEnabledFor(logging.DEBUG):
        return
    results = completion.results
    fields = {"request_id": request.id, "session_id": request.session_id,
              "weight_version": results[0].weight_version if results else None,
              "latency_s": round(e2e, 4),
              "prompt_tokens": results[0].prompt_tokens if results else None,
              "completion_tokens": [r.completion_tokens for r in results],
              "finish_reasons": [r.finish_reason for r in results],
              **({"error": completion.error.kind} if completion.error else {})}
    if with_prompt:
        fields["prompt"] = request.prompt if request.prompt is not None else [
            m.content if isinstance(m.content, str) else "<parts>"
            for m in request.messages] if request.messages else list(request.prompt_token_ids)
    requests_log.debug("request finished", extra=fields)
