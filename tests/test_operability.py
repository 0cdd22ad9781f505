"""What an operator sees and relies on, on real processes (HF backend, tiny model): a real
Prometheus server scraping `rollout serve --replicas 2`, a batch job backing off from a
server that refuses work, and the JSON log lines."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request

import openai
import pyarrow as pa
import pyarrow.parquet as pq

from processes import replicas_of

import rollout
from rollout.service.admission import Limits
from rollout.apps.serving.app import ServerThread
from rollout.service.served import ServedRollout
from rollout.service.service import LocalService
from rollout.kit.process import HOST, ServerProcess, free_port
from rollout.testing.model_folders import load_weights
from rollout.testing.server_contract import metric, scrape
from rollout.testing.waiting import wait_for

KEY = "ops-key"


def serve(tiny_model, *args, keep_log: bool = False) -> tuple[ServerProcess, str]:
    port = free_port()
    server = ServerProcess("serve", [sys.executable, "-m", "rollout", "serve", "--backend", "hf",
                                     "--model", str(tiny_model), "--port", str(port),
                                     "--served-model-name", "tiny", *args],
                           env={"ROLLOUT_API_KEY": KEY}, keep_log=keep_log)
    url = f"http://{HOST}:{port}"
    try:
        server.wait_healthy(f"{url}/health", 300, {"Authorization": f"Bearer {KEY}"})
    except BaseException:
        server.stop()
        raise
    return server, url


def test_prometheus_scrapes_requests_and_replica_restarts(tiny_model, tmp_path):
    """Debian's prometheus, on a free loopback port, scrapes the server each second; its
    queries give back what the test sent, a weight update, then the restart of a killed
    replica."""
    binary = shutil.which("prometheus")
    assert binary, "the prometheus server is missing: scripts/test.sh installs Debian's"
    server, url = serve(tiny_model, "--replicas", "2")
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # (JSON is YAML)
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "rollout", "authorization": {"credentials": KEY},
                            "static_configs": [{"targets": [url.removeprefix("http://")]}]}]}))
    prometheus = ServerProcess("prometheus", [
        binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address={HOST}:{prom_port}"])
    prom = f"http://{HOST}:{prom_port}"

    def query(expression: str) -> float | None:
        address = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(address, timeout=10) as response:
            result = json.loads(response.read())["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    try:
        prometheus.wait_healthy(f"{prom}/-/ready", 120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        usages = [client.completions.create(model="tiny", prompt=f"{i} + {i} =", max_tokens=4,
                                            temperature=0).usage for i in range(5)]
        generated = sum(u.completion_tokens for u in usages)
        wait_for(lambda: query("rollout:generation_tokens_total") == generated, 60,
                 "Prometheus to scrape the tokens generated")
        assert query("rollout:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert query("sum(rollout:request_success_total)") == 5
        assert query("rollout:e2e_request_latency_seconds_count") == 5
        assert query("rollout:time_to_first_token_seconds_count") == 5
        assert query("sum(rollout:replica_healthy)") == 2
        assert query('up{job="rollout"}') == 1

        with ServedRollout.connect(url, KEY) as trainer:  # a weight update, by shm
            trainer.update_weights(load_weights(tiny_model).items(), version=1)
        wait_for(lambda: query("rollout:weight_version") == 1, 60,
                 "Prometheus to see the new weight version")
        assert query('rollout:weight_updates_total{transport="shm"}') == 1
        assert query('rollout:weight_update_duration_seconds_count{transport="shm"}') == 1
        assert query("rollout:weights_dirty") == 0

        os.kill(replicas_of(server.proc.pid)[0], signal.SIGKILL)
        wait_for(lambda: query("sum(rollout:replica_restarts_total)") == 1, 180,
                 "Prometheus to see the replica restarted")
        wait_for(lambda: query("sum(rollout:replica_healthy)") == 2, 180,
                 "the restarted replica to serve")
    finally:
        prometheus.stop()
        server.stop()


def test_batch_job_backs_off_from_a_refusing_server_and_loses_nothing(tiny_model, tmp_path):
    """A server that runs one request and lets none wait refuses most of the job's calls
    (429); the job backs off, retries, and writes every row."""
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"{i} + {i} =" for i in range(12)]}), prompts)
    ro = rollout.load_backend("hf", model=str(tiny_model))
    try:
        service = LocalService(ro, "tiny", Limits(max_running=1, max_waiting=0))
        with ServerThread(service, api_key=KEY) as server:
            job = subprocess.run(
                [sys.executable, "-m", "rollout", "generate", "--server", server.url,
                 "--input", str(prompts), "--output", str(tmp_path / "out.parquet"),
                 "--max-tokens", "6", "--in-flight", "6", "--quiet"],
                env={**os.environ, "ROLLOUT_CLIENT_API_KEY": KEY}, capture_output=True,
                text=True, timeout=600)
            refused = metric(scrape(server.url, KEY), "rollout:request_errors_total",
                             kind="overloaded")
    finally:
        ro.close()
    assert job.returncode == 0, job.stderr[-3000:]
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert len(out) == 12 and all(row["error"] is None for row in out)
    assert refused >= 1  # the job was refused, and came back


def test_agent_runner_backs_off_from_a_refusing_server_to_the_same_trajectories(tiny_model):
    """Eight trajectories at once against a server that runs one turn and lets none wait:
    refused turns are sent again after a backoff, and every trajectory ends as it does in
    process; the agent counters count them."""
    from prometheus_client import REGISTRY

    from rollout.apps.agents import AgentConfig, AgentRunner
    from rollout.testing.agents import GREEDY, ROWS, ToolTask, run

    def done_count():
        return REGISTRY.get_sample_value("rollout:agent_trajectories_total",
                                         {"outcome": "done"}) or 0

    ro = rollout.load_backend("hf", model=str(tiny_model))
    local = run(ro, ToolTask(), ROWS * 2, sampling=GREEDY)
    counted = done_count()
    with ServerThread(LocalService(ro, "tiny", Limits(max_running=1, max_waiting=0)),
                      api_key=KEY) as server:
        with ServedRollout.connect(server.url, KEY) as sampler:
            runner = AgentRunner(sampler, ToolTask(), AgentConfig(sampling=GREEDY),
                                 tokenizer=str(tiny_model))
            remote = asyncio.run(runner.run_many(ROWS * 2))
        refused = metric(scrape(server.url, KEY), "rollout:request_errors_total",
                         kind="overloaded")
    assert [t.end_reason for t in remote] == ["done"] * len(local)
    assert [t.response_ids for t in remote] == [t.response_ids for t in local]
    assert refused >= 1
    assert done_count() - counted == len(remote)


def test_json_logs_carry_request_and_session_but_no_prompt(tiny_model):
    """One JSON object per line; a finished request's line (debug) names its request and
    session; lifecycle calls log at info; the prompt shows only with --log-prompts."""
    secret = "the secret prompt text"
    for with_prompts in (False, True):
        server, url = serve(tiny_model, "--log-format", "json", "--log-level", "debug",
                            *(["--log-prompts"] if with_prompts else []), keep_log=True)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            client.completions.create(model="tiny", prompt=secret, max_tokens=3,
                                      extra_headers={"X-Session-ID": "session-7"})
            for step in ("release", "resume"):
                request = urllib.request.Request(
                    f"{url}/rollout/{step}", data=b'{"tags": null}',
                    headers={"Authorization": f"Bearer {KEY}"})
                urllib.request.urlopen(request, timeout=60).close()
        finally:
            server.stop()
        log = server.log_path.read_text()
        server.log_path.unlink()
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        finished = [x for x in lines if x["message"] == "request finished"]
        assert len(finished) == 1 and finished[0]["level"] == "debug"
        assert finished[0]["session_id"] == "session-7" and finished[0]["request_id"]
        assert finished[0]["completion_tokens"] and finished[0]["latency_s"] > 0
        messages = {x["message"] for x in lines if x["level"] == "info"}
        assert {"released everything", "resumed everything"} <= messages
        assert (secret in log) is with_prompts
