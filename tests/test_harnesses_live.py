"""The real agent harnesses, headless and offline, against `rollout serve` (the HF backend on
the tiny model): Claude Code 2.1.328 on /v1/messages and Codex CLI 0.169.0 on /v1/responses,
each asked "What is 2+2?" with its own HOME. Every HTTP call a CLI makes passes through a
counting proxy (tests/harnesses.py) and must be answered with a 2xx; the session it ran
under is recorded with the tokens each call was sampled, masked. Calls that continue each
other make one branch; a harness that edits its history forks another (Claude Code,
answered with no text, drops that answer and asks again), and the test expects the
branches the calls it saw make.

The CLIs come from npm (tests/harnesses.py installs them, pinned, into ~/.cache/rollout/npm;
scripts/test.sh does so before the suite runs); without npm or node the test is skipped, a
failed install fails it. The tiny model is random: its answers are gibberish, cut at a few
tokens (CLAUDE_CODE_MAX_OUTPUT_TOKENS for Claude Code; Codex 0.169.0 has no such setting and
sends no max_output_tokens, so the proxy adds one to its calls) so that a run takes seconds
of sampling; most of the time goes to prefilling each call's 23-41k prompt tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

import rollout
from harnesses import NoNpm, claude_binary, codex_binary, install
from rollout.apps.serving.app import ServerThread
from rollout.service.service import LocalService
from rollout.testing.proxy import CountingProxy
from rollout.testing.server_contract import metric, scrape

KEY = "harness-key"
MODEL = "tiny"
PROMPT = "What is 2+2?"
CONTEXT = 65536  # Claude Code's prompt is about 41k tokens of this tokenizer, Codex's 23k
LIMIT = 16  # tokens an answer may have
CLI_TIMEOUT_S = 900  # a loaded machine prefills a 41k-token prompt slowly: no race


@pytest.fixture(scope="module")
def harnesses():
    try:
        return install()
    except NoNpm as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def server(tiny_model):
    ro = rollout.load_backend("hf", model=str(tiny_model), max_model_len=CONTEXT)
    with ServerThread(LocalService(ro, MODEL), api_key=KEY) as server:
        yield server
    ro.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def run_cli(argv: list, env: dict, cwd) -> subprocess.CompletedProcess:
    """`argv` in a session of its own, killed with everything it started at the timeout."""
    process = subprocess.Popen([str(a) for a in argv], env=env, cwd=cwd, text=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{argv[0]} ran past {CLI_TIMEOUT_S} s\nstdout: {out[-3000:]}\n"
                    f"stderr: {err[-3000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def base_env(home) -> dict:
    """Nothing of this machine's environment but PATH: no API keys, no settings."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "LANG": "C.UTF-8", "SHELL": "/bin/bash", "TERM": "dumb"}


def session(server, name: str) -> dict:
    import urllib.request

    request = urllib.request.Request(f"{server.url}/rollout/sessions/{name}",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return json.loads(response.read())


def counts(server) -> tuple[float, float]:
    scraped = scrape(server.url, KEY)
    return (metric(scraped, "rollout:request_success_total"),
            metric(scraped, "rollout:request_errors_total"))


def check_session(server, tokenizer, name: str, sampled: list[tuple[str, int, int]],
                  histories: list[list], answers: list) -> list[dict]:
    """The session `name` is these calls, in order: `sampled` holds each call's text and
    counts of prompt and output tokens, as its client was answered; `histories` the
    conversation each call sent, `answers` its answer as a client sends it back (see
    `branches_of`). In each branch the mask is 1 exactly on each call's sampled tokens,
    which decode to the text the client got, and only those carry logprobs."""
    recorded = session(server, name)
    assert recorded["id"] == name
    expected = branches_of(histories, answers)
    assert len(recorded["branches"]) == len(expected), expected
    for branch, indices in zip(recorded["branches"], expected):
        check_branch(branch, tokenizer, [sampled[i] for i in indices])
    return recorded["branches"]


def branches_of(histories: list[list], answers: list) -> list[list[int]]:
    """The calls' indices per branch, as the session records them: a call that sends back
    the conversation of a branch's last call, with its answer, and goes on continues that
    branch; one that keeps it only up to an earlier call's answer forks a branch after that
    call (the latest branch that has one); any other starts a branch."""
    branches: list[list[int]] = []
    for i, history in enumerate(histories):
        for branch in reversed(branches):
            kept = [j for j, call in enumerate(branch)
                    if len(history) > len(histories[call]) + 1 and
                    history[:len(histories[call]) + 1] == [*histories[call], answers[call]]]
            if kept and kept[-1] == len(branch) - 1:
                branch.append(i)
                break
            if kept:
                branches.append([*branch[:kept[-1] + 1], i])
                break
        else:
            branches.append([i])
    return branches


def plain(message: dict) -> tuple:
    """A message as the server compares it: its role, its text, and its other blocks
    without the fields harnesses rewrite from call to call (cache markers, ids)."""
    content = message.get("content")
    if not isinstance(content, list):
        content = [{"type": "text", "text": content or ""}]
    text = "".join(b.get("text", "") for b in content if "text" in b)
    others = [{k: v for k, v in b.items() if k not in ("cache_control", "id")}
              for b in content if "text" not in b]
    return message.get("role", message.get("type")), text, json.dumps(others, sort_keys=True)


def check_branch(branch: dict, tokenizer, sampled: list[tuple[str, int, int]]) -> None:
    ids, mask, logprobs, calls = (branch[k] for k in ("token_ids", "mask", "logprobs", "calls"))
    assert len(ids) == len(mask) == len(logprobs) == calls[-1]["end"]
    assert len(calls) == len(sampled)
    previous_end = 0
    for call, (text, prompt_tokens, output_tokens) in zip(calls, sampled):
        # Each call's prompt is the branch so far (its sampled ids as sampled), then its own
        # new messages.
        assert call["start"] == previous_end < call["prompt_end"] == prompt_tokens < call["end"]
        previous_end = call["end"]
        own = ids[call["prompt_end"]:call["end"]]
        assert len(own) == output_tokens <= LIMIT
        decoded = tokenizer.decode(own, skip_special_tokens=True)
        # (A `<tool_call>` block that is no call is kept in the text, which is then stripped.)
        assert text == decoded or ("<tool_call>" in decoded and text == decoded.strip())
    assert mask == [int(any(c["prompt_end"] <= i < c["end"] for c in calls))
                    for i in range(len(ids))]
    assert sum(mask) == sum(n for *_, n in sampled)
    assert [p is not None for p in logprobs] == [bool(m) for m in mask]


def check_calls(proxy: CountingProxy, path: str, before, after) -> list:
    """Every HTTP call was answered with a 2xx; all were sampling calls on `path`, each
    counted by the server as a success and none as an error."""
    assert proxy.calls, "the CLI made no call"
    assert all(c.status is not None and 200 <= c.status < 300 for c in proxy.calls), \
        proxy.calls
    assert {(c.method, c.path.split("?")[0]) for c in proxy.calls} == {("POST", path)}
    assert after[0] - before[0] == len(proxy.calls) and after[1] == before[1]
    return proxy.calls


def test_claude_code(harnesses, server, tokenizer, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = {**base_env(tmp_path / "home"), "ANTHROPIC_BASE_URL": "", "ANTHROPIC_API_KEY": KEY,
           "ANTHROPIC_MODEL": MODEL, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(LIMIT),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_TELEMETRY": "1", "API_TIMEOUT_MS": str(CLI_TIMEOUT_S * 1000)}
    before = counts(server)
    with CountingProxy(server.url) as proxy:
        env["ANTHROPIC_BASE_URL"] = proxy.url
        done = run_cli([claude_binary(harnesses), "-p", PROMPT, "--output-format", "json"],
                       env, work)
    after = counts(server)
    calls = check_calls(proxy, "/v1/messages", before, after)
    out = json.loads(done.stdout)
    assert out["type"] == "result", out
    # A random model seldom ends an answer within LIMIT tokens: Claude Code then asks it to
    # go on (up to 3 times) and, still cut, ends with an error of its own, exit status 1,
    # and no HTTP error (api_error_status). An answer that ended is a success.
    if done.returncode == 0:
        assert out["is_error"] is False
    else:
        assert (done.returncode, out["api_error"], out["api_error_status"]) == \
            (1, "max_output_tokens", None), (done.stdout, done.stderr[-3000:])
    name = out["session_id"]
    assert {c.headers.get("x-claude-code-session-id") for c in calls} == {name}
    assert out["num_turns"] == len(calls)
    sampled = []
    for call in calls:
        assert call.json()["stream"] is True
        events = call.events()
        assert events[-1]["type"] == "message_stop"
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "text_delta")
        (end,) = [e for e in events if e["type"] == "message_delta"]
        usage = end["usage"]
        sampled.append((text, usage["input_tokens"] + usage["cache_read_input_tokens"],
                        usage["output_tokens"]))
    histories = [[plain({"role": "system", "content": c.json().get("system")}),
                  *map(plain, c.json()["messages"])] for c in calls]
    answers = [plain({"role": "assistant", "content": [{"type": "text", "text": text}]})
               for text, *_ in sampled]
    branches = check_session(server, tokenizer, name, sampled, histories, answers)
    assert sum(n for *_, n in sampled) == out["usage"]["output_tokens"]
    assert {c["route"] for b in branches for c in b["calls"]} == {"messages"}


def test_codex(harnesses, server, tokenizer, tmp_path):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = {**base_env(home), "LOCAL_KEY": KEY}
    (home / ".codex").mkdir()
    before = counts(server)

    def limit(call):
        """Codex 0.169.0 has no setting for the length of an answer (it warns that
        `model_max_output_tokens` "is ignored") and sends none: the proxy adds one."""
        body = call.json()
        if call.path.endswith("/v1/responses") and isinstance(body, dict):
            return json.dumps({**body, "max_output_tokens": LIMIT}).encode()
        return None

    with CountingProxy(server.url, rewrite=limit) as proxy:
        (home / ".codex" / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "local"\n'
            f'[model_providers.local]\nname = "local"\nbase_url = "{proxy.url}/v1"\n'
            'wire_api = "responses"\nenv_key = "LOCAL_KEY"\n'
            f"stream_idle_timeout_ms = {CLI_TIMEOUT_S * 1000}\n")
        done = run_cli([codex_binary(harnesses), "exec", "--json", "--skip-git-repo-check",
                        PROMPT], env, work)
    after = counts(server)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    calls = check_calls(proxy, "/v1/responses", before, after)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (name,) = [e["thread_id"] for e in events if e["type"] == "thread.started"]
    assert {c.headers.get("session-id") for c in calls} == {name}
    (turn,) = [e for e in events if e["type"] in ("turn.completed", "turn.failed")]
    assert turn["type"] == "turn.completed", turn
    sampled = []
    for call in calls:
        assert call.json()["stream"] is True and "max_output_tokens" not in call.json()
        streamed = call.events()
        text = "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta")
        (end,) = [e for e in streamed if e["type"] in ("response.completed",
                                                       "response.incomplete")]
        usage = end["response"]["usage"]
        sampled.append((text, usage["input_tokens"], usage["output_tokens"]))
    histories = [[plain({"role": "system", "content": c.json().get("instructions")}),
                  *map(plain, c.json()["input"])] for c in calls]
    answers = [plain({"role": "assistant", "content": [{"type": "output_text", "text": text}]})
               for text, *_ in sampled]
    branches = check_session(server, tokenizer, name, sampled, histories, answers)
    assert sum(n for *_, n in sampled) == turn["usage"]["output_tokens"]
    assert {c["route"] for b in branches for c in b["calls"]} == {"responses"}
