"""The sandbox-fusion judge: each test case runs through a SandboxFusion server's
`/run_code`, with the same harness as the local judge, so the two give the same verdicts.

Every request has a timeout; connection failures and 5xx answers are retried a bounded
number of times with a growing pause; after that the case is api_error with the cause.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import attrs

from rollout.contract.errors import InvalidRequestError
from rollout.apps.judges.base import Judge, parse_options, positive
from rollout.apps.judges.harness import Limits, Outcome, Run

ENDPOINT_ENV = "SANDBOX_FUSION_ENDPOINT"


@attrs.frozen
class SandboxFusionOptions:
    endpoint: str | None = None  # the server's base URL; SANDBOX_FUSION_ENDPOINT by default
    timeout: float = attrs.field(default=10.0, validator=positive)  # run time per case, s
    memory_mb: int = attrs.field(default=1024, validator=positive)
    output_mb: int = attrs.field(default=16, validator=positive)
    concurrency: int = attrs.field(default=8, validator=positive)
    retries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    request_timeout: float | None = attrs.field(default=None, validator=positive)  # timeout + 30


class _Retry(Exception):
    """A failure worth another try: the server may be starting, busy or restarting."""


class SandboxFusionJudge(Judge):
    name = "sandbox-fusion"

    def __init__(self, **options):
        o = self.options = parse_options(options, SandboxFusionOptions)
        endpoint = o.endpoint or os.environ.get(ENDPOINT_ENV)
        if not endpoint:
            raise InvalidRequestError(
                "judge_options.endpoint", "missing",
                f"the server's URL, e.g. http://localhost:8080, or {ENDPOINT_ENV}")
        self.url = endpoint.rstrip("/") + "/run_code"
        self.limits = Limits(o.timeout, o.memory_mb, o.output_mb)
        self.concurrency = o.concurrency
        self.request_timeout = o.request_timeout or o.timeout + 30

    def describe(self) -> dict:
        return {**super().describe(), "endpoint": self.url, "isolation": "the server's"}

    def execute(self, run: Run) -> Outcome:
        body = json.dumps({
            "code": run.program, "language": "python", "stdin": run.stdin,
            "compile_timeout": self.limits.timeout, "run_timeout": self.limits.timeout,
            "memory_limit_MB": self.limits.memory_mb,
        }).encode()
        tries = self.options.retries + 1
        for attempt in range(tries):
            try:
                return outcome_of(self._post(body))
            except _Retry as exc:
                cause = str(exc)
            if attempt + 1 < tries:
                time.sleep(min(0.5 * 2 ** attempt, 4.0))
        return Outcome(api_error=f"{self.url}: {cause} (gave up after {tries} tries)")

    def _post(self, body: bytes) -> dict:
        request = urllib.request.Request(self.url, data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            text = exc.read(500).decode("utf-8", "replace")
            if exc.code >= 500:
                raise _Retry(f"HTTP {exc.code}: {text}") from None
            raise RuntimeError(f"HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            raise _Retry(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from None


def outcome_of(reply: dict) -> Outcome:
    """A `/run_code` answer as an outcome: the server's failures are api_error; the
    program's own result is left to the harness's rules, as for the local judge."""
    run = reply.get("run_result") or {}
    if reply.get("status") == "SandboxError" or run.get("status") not in (
            "Finished", "Error", "TimeLimitExceeded"):
        return Outcome(api_error=f"sandbox: {reply.get('status')}: {reply.get('message') or ''}"
                       f" (run: {run.get('status')})".strip())
    seconds = run.get("execution_time") or 0.0
    if run["status"] == "TimeLimitExceeded":
        return Outcome(timed_out=True, stderr=run.get("stderr") or "", seconds=seconds)
    if run.get("return_code") is None:
        return Outcome(api_error=f"sandbox: no return code ({run['status']})")
    return Outcome(exit_code=run["return_code"], stdout=run.get("stdout") or "",
                   stderr=run.get("stderr") or "", seconds=seconds)
