"""The sandbox-fusion judge. Its error paths run against a small fake server here, since a
real one cannot fail on demand; its verdicts run against a real SandboxFusion server when
SANDBOX_FUSION_ENDPOINT names one, and must equal the local judge's."""

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from humaneval_variants import KINDS, VARIANT_PROBLEMS, broken, canonical, problems
from rollout.contract.errors import InvalidRequestError
from rollout.apps.judges import ProgramTests, Sample, StdioTests, load_judge
from rollout.apps.judges.sandbox_fusion import ENDPOINT_ENV

ENDPOINT = os.environ.get(ENDPOINT_ENV)
real_server = pytest.mark.skipif(
    not ENDPOINT, reason=f"{ENDPOINT_ENV} is not set: no SandboxFusion server to test against")

ANSWER = Sample("```python\ndef f():\n    return 1\n```",
                ProgramTests("def check(c):\n    assert c() == 1\n", "f"))


class FakeServer:
    """Answers /run_code with `replies` in turn (the last one repeats) and counts requests."""

    def __init__(self, replies, delay=0.0):
        self.replies, self.requests, self.bodies = list(replies), 0, []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:  # requests arrive concurrently
                    fake.bodies.append(body)
                    status, reply = fake.replies[min(fake.requests, len(fake.replies) - 1)]
                    fake.requests += 1
                time.sleep(delay)
                data = json.dumps(reply(body) if callable(reply) else reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except BrokenPipeError:
                    pass  # the client gave up waiting, as the hung-server test wants

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(replies, delay=0.0):
        servers.append(FakeServer(replies, delay))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def finished(stdout="", stderr="", code=0):
    return {"status": "Success" if code == 0 else "Failed", "message": "",
            "run_result": {"status": "Finished", "execution_time": 0.01, "return_code": code,
                           "stdout": stdout, "stderr": stderr}}


def passed(body):
    """What a server answers when the harness ran to its end: the marker it was sent."""
    marker = body["code"].split("'marker': '")[1].split("'")[0]
    return finished(stdout=f"\n{marker}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_api_error_with_the_cause_quickly():
    judge = load_judge("sandbox-fusion", endpoint=f"http://127.0.0.1:{free_port()}", retries=1)
    verdict = judge.judge([ANSWER])[0]
    # Refused, not timed out: each try ended at once, without waiting out its request timeout.
    assert verdict.status == "api_error" and "refused" in verdict.detail.lower(), verdict.detail
    assert "2 tries" in verdict.detail


def test_server_errors_are_retried_a_bounded_number_of_times(fake):
    always = fake([(503, {"detail": "busy"})])
    verdict = load_judge("sandbox-fusion", endpoint=always.url, retries=2).judge([ANSWER])[0]
    assert verdict.status == "api_error" and "HTTP 503" in verdict.detail
    assert always.requests == 3
    recovers = fake([(502, {}), (200, passed)])
    verdict = load_judge("sandbox-fusion", endpoint=recovers.url, retries=2).judge([ANSWER])[0]
    assert verdict.status == "success" and recovers.requests == 2


def test_a_hung_server_times_out(fake):
    slow = fake([(200, passed)], delay=120)  # far past the bound below: no race with it
    judge = load_judge("sandbox-fusion", endpoint=slow.url, retries=0, request_timeout=0.5)
    started = time.monotonic()
    verdict = judge.judge([ANSWER])[0]
    assert verdict.status == "api_error" and "timed out" in verdict.detail, verdict.detail
    assert time.monotonic() - started < 60  # it gave up; it did not wait for the answer


def test_status_mapping(fake):
    timeout = {"status": "Failed", "message": "", "run_result": {
        "status": "TimeLimitExceeded", "execution_time": 1.0, "return_code": None,
        "stdout": "", "stderr": ""}}
    sandbox_error = {"status": "SandboxError", "message": "no runtime", "run_result": None}
    cases = [
        ((200, passed), "success"),
        ((200, finished(stderr="AssertionError", code=3)), "wrong_answer"),
        ((200, finished(stderr="ZeroDivisionError", code=4)), "runtime_error"),
        ((200, finished()), "runtime_error"),  # status 0 without the marker: left early
        ((200, timeout), "timeout"),
        ((200, finished(code=128 + 24)), "timeout"),  # killed by the CPU-time limit
        ((200, sandbox_error), "api_error"),
        ((400, {"detail": "bad request"}), "api_error"),
    ]
    for reply, status in cases:
        server = fake([reply])
        verdict = load_judge("sandbox-fusion", endpoint=server.url, retries=0).judge([ANSWER])[0]
        assert verdict.status == status, (reply, verdict)
        assert server.requests == 1


def test_stdin_cases_send_stdin_and_compare_stdout(fake):
    server = fake([(200, lambda body: finished(stdout=str(2 * int(body["stdin"])) + "\n"))])
    tests = StdioTests(inputs=("3", "4"), outputs=("6", "9"))
    judge = load_judge("sandbox-fusion", endpoint=server.url, timeout=3, memory_mb=512)
    verdict = judge.judge([Sample("```python\nprint(2 * int(input()))\n```", tests)])[0]
    assert [c.status for c in verdict.cases] == ["success", "wrong_answer"]
    assert {(b["run_timeout"], b["memory_limit_MB"], b["language"]) for b in server.bodies} == {
        (3, 512, "python")}


def test_endpoint_from_the_environment_or_a_clear_error(monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    with pytest.raises(InvalidRequestError) as info:
        load_judge("sandbox-fusion")
    assert info.value.field == "judge_options.endpoint" and ENDPOINT_ENV in str(info.value)
    monkeypatch.setenv(ENDPOINT_ENV, "http://sandbox.example:8080/")
    assert load_judge("sandbox-fusion").url == "http://sandbox.example:8080/run_code"


@real_server
def test_real_server_agrees_with_the_local_judge():
    samples = [canonical(p) for p in problems()]
    samples += [broken(problems()[i], kind) for i in VARIANT_PROBLEMS for kind in KINDS]
    options = {"timeout": 3, "memory_mb": 256}
    remote = load_judge("sandbox-fusion", endpoint=ENDPOINT, **options).judge(samples)
    local = load_judge("local", **options).judge(samples)
    differ = [(i, r.status, l.status, r.detail[-300:]) for i, (r, l) in
              enumerate(zip(remote, local)) if r.status != l.status]
    assert not differ, differ
    assert sum(v.status == "success" for v in remote[:164]) == 164
