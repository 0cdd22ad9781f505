"""Training through an agent program run unchanged: each sample runs the agent once, with
its base URLs pointed at a session of a `rollout serve` (or of a gateway over the trainer's
own `Rollout`), and becomes the session's exact tokens as the server recorded them.

    harness = Harness(["llm", "-m", "rollout", "-n", "{task}"], url)   # a command
    harness = Harness(my_agent, url)        # or a function of an AgentCall
    groups = GroupSampler(sampler, prompts, group_size=8, batch_size=4,
                          sample=harness.run, score=lambda request, episodes: [...])

A command's arguments may name `{task}` (the prompt's text), `{session}`, `{model}`,
`{openai_base_url}` and `{anthropic_base_url}`; it also gets them in its environment as
`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL`, the API keys and `ROLLOUT_SESSION` (see
`AgentCall.env`), with stdin closed. What it prints on stdout is the episode's `output`,
for the reward. A function gets the `AgentCall` and returns the output (or awaits it).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import attrs

from rollout.apps.agents.trajectory import Trajectory
from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Request, WeightSpan, add_span

AGENT_TIMEOUT_S = 600.0
OUTPUT_LIMIT = 1 << 20  # bytes of an agent's stdout kept for its reward
KILL_WAIT_S = 10.0
PLACEHOLDERS = ("task", "session", "model", "openai_base_url", "anthropic_base_url")


@attrs.frozen
class AgentCall:
    """What one run of the agent gets: its task, and where its session is served."""

    task: str
    session: str
    url: str  # the server's root
    model: str
    api_key: str
    request: Request

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/sessions/{self.session}/v1"

    @property
    def anthropic_base_url(self) -> str:  # (the Anthropic SDK adds /v1 itself)
        return f"{self.url}/sessions/{self.session}"

    @property
    def env(self) -> dict[str, str]:
        """The variables the OpenAI and Anthropic SDKs, Codex and Claude Code read."""
        return {"OPENAI_BASE_URL": self.openai_base_url, "OPENAI_API_KEY": self.api_key,
                "ANTHROPIC_BASE_URL": self.anthropic_base_url,
                "ANTHROPIC_API_KEY": self.api_key, "ANTHROPIC_MODEL": self.model,
                "ROLLOUT_SESSION": self.session, "ROLLOUT_MODEL": self.model}


@attrs.frozen
class Episode:
    """One run of the agent: what it printed (or returned), how it ended, and its session's
    token sequences, one `Trajectory` per branch (a harness that compacts its history or
    makes side calls has several; each one's sampled tokens are mask 1)."""

    id: str  # the sample's request id
    session: str
    output: str
    branches: tuple[Trajectory, ...]
    error: str | None  # why the agent failed: an exit status, a timeout, an exception
    seconds: float

    @property
    def weight_versions(self) -> tuple[WeightSpan, ...]:
        """Every branch's spans (the group sampler reads its oldest version from them)."""
        return tuple(s for b in self.branches for s in b.weight_versions)

    @property
    def sampled_tokens(self) -> int:
        return sum(sum(b.mask) for b in self.branches)

    @property
    def calls(self) -> list[list[int]]:
        """Each call's sampled ids, branch by branch: the runs of mask 1 (a call's new
        messages always put the template's tokens between two answers)."""
        runs = []
        for branch in self.branches:
            run: list[int] = []
            for token, sampled in zip(branch.response_ids, branch.mask):
                if sampled:
                    run.append(token)
                elif run:
                    runs.append(run)
                    run = []
            runs += [run] if run else []
        return runs


Agent = Sequence[str] | Callable[[AgentCall], str | None | Awaitable[str | None]]


class Harness:
    """Runs `agent` once per sample against the server at `url` (a `rollout serve`, or
    `gateway(rollout)`): `run` is a `GroupSampler`'s `sample`. `model`: the served model's
    name (default: the server's first); `env`: more variables for a command;
    `timeout`: seconds an agent may run before it is killed (its episode then ends with
    that error, and what it sampled so far is kept; a function that is not a coroutine
    runs in a thread, which cannot be killed: it is left to end by itself)."""

    def __init__(self, agent: Agent, url: str, *, api_key: str | None = None,
                 model: str | None = None, env: Mapping[str, str] | None = None,
                 timeout: float = AGENT_TIMEOUT_S):
        if isinstance(agent, str) or not (callable(agent) or _is_command(agent)):
            raise InvalidRequestError("agent", f"got {agent!r}",
                                      "a command as a list of strings, or a function")
        self.agent, self.url, self.api_key = agent, url.rstrip("/"), api_key
        self.model, self.env, self.timeout = model, dict(env or {}), timeout

    async def run(self, request: Request) -> Episode:
        """One episode of `request`'s task, in a session of its own."""
        from rollout.service.client import RemoteService

        server = RemoteService(self.url, self.api_key)  # (its connections, on this loop)
        try:
            if self.model is None:
                self.model = await server.model()
            session = f"{re.sub(r'[^A-Za-z0-9._-]', '-', request.id)}-{uuid.uuid4().hex[:8]}"
            call = AgentCall(task_of(request), session, self.url, self.model,
                             self.api_key or "rollout", request)
            started = time.monotonic()
            output, error = await self._run_agent(call)
            return Episode(request.id, session, output, await _branches(server, session),
                           error, time.monotonic() - started)
        finally:
            await server.close()

    async def _run_agent(self, call: AgentCall) -> tuple[str, str | None]:
        try:
            if callable(self.agent):
                return await asyncio.wait_for(_call(self.agent, call), self.timeout), None
            return await _run_command(self.agent, call, self.env, self.timeout)
        except asyncio.TimeoutError:
            return "", f"timed out after {self.timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - the agent's failure ends its episode
            return "", f"{type(exc).__name__}: {exc}"


def task_of(request: Request) -> str:
    """The text a task gives its agent: the last user message's, or the prompt."""
    if request.messages:
        for message in reversed(request.messages):
            if message.role == "user":
                content = message.content
                return content if isinstance(content, str) else "".join(
                    getattr(part, "text", None) or "" for part in content)
    if isinstance(request.prompt, str):
        return request.prompt
    raise InvalidRequestError("messages", "a harness's task needs a user message or a text "
                              "prompt", "a request with messages or a prompt")


def trajectory(id: str, branch: Mapping) -> Trajectory:
    """A recorded branch (`GET /rollout/sessions/{id}`) as a Trajectory: the first call's
    prompt, then every token after it with the mask of the sampled ones, their logprobs
    (0.0 on the others) and their weight versions."""
    start = branch["calls"][0]["prompt_end"]
    mask = list(branch["mask"][start:])
    versions = branch["weight_versions"][start:]
    spans: list[WeightSpan] = []
    for i, sampled in enumerate(mask):
        if sampled:
            add_span(spans, versions[i], i, i + 1)
    return Trajectory(id=id, prompt_ids=list(branch["token_ids"][:start]),
                      response_ids=list(branch["token_ids"][start:]), mask=mask,
                      logprobs=[0.0 if lp is None else lp for lp in branch["logprobs"][start:]],
                      weight_versions=spans, end_reason="done")


@contextlib.contextmanager
def gateway(rollout, name: str = "policy") -> Iterator[str]:
    """A server over a `Rollout` in this process, on a free loopback port, for agents to
    call: yields its URL. The rollout stays open when it stops (the trainer owns it)."""
    from rollout.apps.serving.app import ServerThread
    from rollout.service.service import LocalService

    class Borrowed(LocalService):
        async def close(self) -> None:  # the trainer closes its rollout itself
            pass

    with ServerThread(Borrowed(rollout, name), model_name=name) as server:
        yield server.url


async def _branches(server, session: str) -> tuple[Trajectory, ...]:
    """The session's branches, taken from the server (which keeps them no longer)."""
    from rollout.apps.serving.sessions import SessionGone

    try:
        recorded = await server.session(session, pop=True)
    except SessionGone:  # the agent made no call that was answered
        return ()
    return tuple(trajectory(f"{session}/{i}", b) for i, b in enumerate(recorded["branches"]))


def _is_command(agent) -> bool:
    return (isinstance(agent, Sequence) and len(agent) > 0
            and all(isinstance(a, str) for a in agent))


async def _call(agent: Callable, call: AgentCall) -> str:
    if inspect.iscoroutinefunction(agent):
        output = await agent(call)
    else:
        output = await asyncio.to_thread(agent, call)
        if inspect.isawaitable(output):
            output = await output
    return "" if output is None else str(output)


async def _run_command(command: Sequence[str], call: AgentCall, env: Mapping[str, str],
                       timeout: float) -> tuple[str, str | None]:
    """Run the command in its own process group (killed whole on a timeout or a cancel)."""
    values = {name: str(getattr(call, name)) for name in PLACEHOLDERS}
    argv = [re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), a)
            for a in command]
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **call.env, **env},
        start_new_session=True)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), KILL_WAIT_S)
        raise
    output = stdout[:OUTPUT_LIMIT].decode(errors="replace")
    if process.returncode != 0:
        tail = stderr[-2000:].decode(errors="replace").strip()
        return output, f"exit status {process.returncode}: {tail}"
    return output, None

