"""Sessions with exact tokens: what an agent harness sampled through the server, recorded as
one token sequence per branch of its conversation.

A call names its session (see `session_of`). The first call of a branch is rendered by the
chat template as any call; its prompt ids and the sampled ids become the branch's tokens.
A later call that sends the branch's conversation back, with the answers as the server gave
them, followed by new messages (tool results, a user turn), gets as its prompt the branch's
tokens followed by the template's tokens for the new messages alone
(`rollout.apps.agents.tokens.ChatTokens`): sampled ids are never re-tokenized, so the
session's assistant tokens are exactly the engine's. A call that keeps only the start of a
branch's conversation, up to one of its answers, and goes on otherwise (a harness that
drops or edits its last turns: Claude Code drops an answer with no text and asks again)
forks: a new branch, with the old one's tokens up to that answer, is recorded beside it.
A call whose history differs before any answer (compacted, or a changed system prompt), or
whose tools differ, starts a new branch rendered afresh. Branches are recorded, never
spliced into each other.

Memory is bounded by the count of sessions and of tokens kept; the least recently used
session goes first.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

from rollout.apps.agents.tokens import ChatTokens, TemplateError
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Completion, Message, Request, Result
from rollout.kit.prompts import PromptEncoder
from rollout.service.service import WrappedStream

log = logging.getLogger("rollout.serve")

SESSION_HEADER = "X-Session-ID"
MAX_SESSIONS = 1000
MAX_TOKENS = 20_000_000  # ids kept over all sessions (about 1 GB of Python lists at most)
TOOL_SETS_KEPT = 64  # chat templates rendered with a set of tools, kept for the next turn


class SessionGone(InvalidRequestError):
    kind = "session_not_found"


@attrs.define
class Branch:
    """One token sequence: every call's prompt tokens (mask 0) and sampled tokens (mask 1),
    with logprobs and weight versions on the sampled ones."""

    token_ids: list[int]
    mask: list[int]
    logprobs: list[float | None]
    versions: list[int | None]
    calls: list[dict]
    # The conversation as a client sends it back (the last call's messages and its
    # answer), as the keys a message sent back must match (`_key`); `turns[j]`: how many
    # of them run up to call j's answer.
    keys: list[Any]
    turns: list[int]
    tools: Any

    def as_dict(self) -> dict:
        return {"token_ids": self.token_ids, "mask": self.mask, "logprobs": self.logprobs,
                "weight_versions": self.versions, "calls": self.calls}


class Ticket:
    """One call of a session: the branch it continues (None: a new one) after which of its
    calls, its request as sent to the engine, and how to read the answer the client will
    send back."""

    def __init__(self, session: str, branch: Branch | None, after: int, request: Request,
                 messages: list[Message], logprobs_asked: bool, route: str,
                 answer: Callable[[Result], Message]):
        self.session, self.branch, self.after, self.request = session, branch, after, request
        self.messages, self.logprobs_asked, self.route = messages, logprobs_asked, route
        self.answer = answer


class Sessions:
    """`encoder`: gives the model's PromptEncoder (its tokenizer renders new messages);
    called on first use."""

    def __init__(self, encoder: Callable[[], Any], max_sessions: int = MAX_SESSIONS,
                 max_tokens: int = MAX_TOKENS):
        self._encoder = encoder
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self._kept: OrderedDict[str, list[Branch]] = OrderedDict()
        self._tokens = 0
        self._chat_tokens: OrderedDict[str, ChatTokens] = OrderedDict()  # per tool set
        self._lock = threading.Lock()

    # --- a call -----------------------------------------------------------------------

    def begin(self, session: str, request: Request, route: str,
              answer: Callable[[Result], Message]) -> Ticket:
        """The call's ticket, with the request to send: its prompt spliced onto the branch
        it continues, and logprobs asked for (the session records them)."""
        messages = list(request.messages or ())
        asked = request.sampling.logprobs is not None
        if not asked:
            request = attrs.evolve(request, sampling=attrs.evolve(request.sampling, logprobs=0))
        with self._lock:
            branches = self._kept.get(session, [])
        if request.sampling.n == 1 and not any(m.images for m in messages):
            tools, keys = _tools(request), [_key(m) for m in messages]
            for branch in reversed(branches):
                after = _last_shared_answer(branch, keys) if tools == branch.tools else None
                if after is None:
                    continue
                tail = self._tail(branch, after, messages, request, tools)
                if tail is not None:
                    end = branch.calls[after]["end"]
                    spliced = attrs.evolve(request, messages=None, tools=None,
                                           prompt_token_ids=(*branch.token_ids[:end], *tail))
                    return Ticket(session, branch, after, spliced, messages, asked, route,
                                  answer)
        return Ticket(session, None, -1, request, messages, asked, route, answer)

    def _tail(self, branch: Branch, after: int, messages: list[Message], request: Request,
              tools: list) -> list[int] | None:
        """The tokens of the messages that follow call `after`'s answer; None where the
        template cannot give them apart."""
        chat = self._chat(request, tools)
        if chat is None:
            return None  # no tokenizer here: each call is rendered afresh, a new branch
        call = branch.calls[after]
        try:
            return chat.continuation(branch.token_ids[call["prompt_end"]:call["end"]],
                                     messages[branch.turns[after]:])
        except TemplateError:
            return None  # the template cannot be used turn by turn: a new branch each time

    def _chat(self, request: Request, tools: list) -> ChatTokens | None:
        key = json.dumps(tools)
        if key not in self._chat_tokens:
            encoder = self._read_encoder()
            if encoder is None:
                return None
            tools = [t.as_openai() for t in request.tools] if request.tools else None
            self._chat_tokens[key] = ChatTokens(encoder.tokenizer, tools)
            if len(self._chat_tokens) > TOOL_SETS_KEPT:
                self._chat_tokens.popitem(last=False)
        self._chat_tokens.move_to_end(key)
        return self._chat_tokens[key]

    def _read_encoder(self) -> PromptEncoder | None:
        if callable(self._encoder):  # read on first use only
            try:
                self._encoder = self._encoder()
            except Exception:  # noqa: BLE001 - no tokenizer: calls are rendered afresh
                log.exception("sessions: the model's tokenizer could not be read; each "
                              "call of a session starts a new branch")
                self._encoder = None
        return self._encoder

    def end(self, ticket: Ticket, completion: Completion) -> Completion:
        """Record the call's sample (a call that failed, or made several, is not recorded);
        the completion as the client asked for it (logprobs only if asked)."""
        if completion.error is None and len(completion.results) == 1:
            try:
                answer = ticket.answer(completion.results[0])
            except Exception:  # noqa: BLE001 - an answer the call refuses: not recorded
                answer = None
            if answer is not None:
                self._record(ticket, completion.results[0], answer)
        return completion if ticket.logprobs_asked else _without_logprobs(completion)

    def _record(self, ticket: Ticket, result: Result, answer: Message) -> None:
        prompt, sampled = list(result.prompt_token_ids), list(result.token_ids)
        old, after = ticket.branch, ticket.after
        start = old.calls[after]["end"] if old is not None else 0
        if old is None or prompt[:start] != old.token_ids[:start]:  # (another prompt ran)
            old, after, start = None, -1, 0
        versions: list[int | None] = [None] * len(sampled)
        for span in result.weight_versions:
            versions[span.start:span.end] = [span.version] * (span.end - span.start)
        call = {"route": ticket.route, "start": start, "prompt_end": len(prompt),
                "end": len(prompt) + len(sampled), "finish_reason": result.finish_reason,
                "weight_versions": [{"version": s.version, "start": s.start + len(prompt),
                                     "end": s.end + len(prompt)} for s in result.weight_versions],
                "tool_calls": [convert.unstructure(c) for c in answer.tool_calls]}
        tail = len(prompt) - start
        keys = [_key(m) for m in ticket.messages + [answer]]
        branch = Branch(
            token_ids=prompt + sampled,
            mask=(old.mask[:start] if old else []) + [0] * tail + [1] * len(sampled),
            logprobs=(old.logprobs[:start] if old else []) + [None] * tail + list(
                result.logprobs or [None] * len(sampled)),
            versions=(old.versions[:start] if old else []) + [None] * tail + versions,
            calls=(old.calls[:after + 1] if old else []) + [call], keys=keys,
            turns=(old.turns[:after + 1] if old else []) + [len(keys)],
            tools=_tools(ticket.request) if old is None else old.tools)
        with self._lock:
            branches = self._kept.pop(ticket.session, [])
            # Continued from its last call, the branch grows; from an earlier one, the
            # new branch is kept beside it.
            if old is not None and after == len(old.calls) - 1 and old in branches:
                branches.remove(old)
                self._tokens -= len(old.token_ids)
            branches.append(branch)
            self._tokens += len(branch.token_ids)
            self._kept[ticket.session] = branches
            while self._kept and (len(self._kept) > self.max_sessions
                                  or self._tokens > self.max_tokens):
                _, gone = self._kept.popitem(last=False)
                self._tokens -= sum(len(b.token_ids) for b in gone)

    # --- reading them back ------------------------------------------------------------

    def get(self, session: str) -> dict:
        with self._lock:
            branches = self._kept.get(session)
        if branches is None:
            raise SessionGone("session", f"{session!r} is not kept here: unknown, or evicted "
                              f"(this server keeps {self.max_sessions} sessions and "
                              f"{self.max_tokens} tokens, the least recently used going "
                              "first)", "a session of a call made here")
        return {"id": session, "branches": [b.as_dict() for b in branches]}

    def pop(self, session: str) -> dict:
        """The session, no longer kept (a trainer that took it frees its memory)."""
        taken = self.get(session)
        with self._lock:
            gone = self._kept.pop(session, [])
            self._tokens -= sum(len(b.token_ids) for b in gone)
        return taken


def write_parquet(sessions: list[dict], path: str) -> int:
    """Sessions as `GET /rollout/sessions/{id}` gives them, one row per branch: session,
    branch, token_ids, mask, logprobs, weight_versions, and calls as JSON. The row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"session": s["id"], "branch": i, **{k: b[k] for k in (
                "token_ids", "mask", "logprobs", "weight_versions")},
             "calls": json.dumps(b["calls"])}
            for s in sessions for i, b in enumerate(s["branches"])]
    schema = pa.schema([("session", pa.string()), ("branch", pa.int32()),
                        ("token_ids", pa.list_(pa.int64())), ("mask", pa.list_(pa.int8())),
                        ("logprobs", pa.list_(pa.float64())),
                        ("weight_versions", pa.list_(pa.int64())), ("calls", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return len(rows)


class Recording:
    """A service that records one call's request into its session (see `Sessions`)."""

    def __init__(self, service, sessions: Sessions, ticket: Ticket):
        self._service, self._sessions, self.ticket = service, sessions, ticket

    def __getattr__(self, name):
        return getattr(self._service, name)

    async def generate(self, request: Request) -> Completion:
        return self._sessions.end(self.ticket, await self._service.generate(request))

    def stream(self, request: Request) -> RecordingStream:
        return RecordingStream(self._service.stream(request), self)


class RecordingStream(WrappedStream):
    def __init__(self, stream, recording: Recording):
        super().__init__(stream)
        self.recording = recording
        self._completion: Completion | None = None

    @property
    def completion(self) -> Completion | None:
        if self._completion is None and self.stream.completion is not None:
            self._completion = self.recording._sessions.end(self.recording.ticket,
                                                            self.stream.completion)
        return self._completion

    async def _chunks(self):
        asked = self.recording.ticket.logprobs_asked
        async for chunk in self.stream:
            yield chunk if asked else attrs.evolve(chunk, logprobs=None, top_logprobs=None)


def session_of(headers: Any, path_session: str | None, body: Any, route: str) -> str | None:
    """The session a call names: its path (`/sessions/{id}/v1/...`, for a harness that can
    set nothing else), the X-Session-ID header, or what the API or the harness uses for
    one: Claude Code's X-Claude-Code-Session-Id header and `metadata.user_id` on
    /v1/messages; Codex's session-id header, `prompt_cache_key` and `user` on the OpenAI
    routes."""
    if path_session:
        return path_session
    given = headers.get(SESSION_HEADER)
    if given:
        return given
    body = body if isinstance(body, dict) else {}
    if route == "messages":
        user = (body.get("metadata") or {}).get("user_id") \
            if isinstance(body.get("metadata"), dict) else None
        return headers.get("X-Claude-Code-Session-Id") or _session_in(user)
    for candidate in (headers.get("session-id"), body.get("prompt_cache_key"),
                      body.get("user")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return None


def _session_in(user_id: Any) -> str | None:
    """Claude Code's user_id is JSON with its session_id; any other, the id itself."""
    if not isinstance(user_id, str) or not user_id:
        return None
    try:
        inner = json.loads(user_id)
    except ValueError:
        return user_id
    found = inner.get("session_id") if isinstance(inner, dict) else None
    return found if isinstance(found, str) and found else user_id


def _without_logprobs(completion: Completion) -> Completion:
    return attrs.evolve(completion, results=[
        attrs.evolve(r, logprobs=None, top_logprobs=None) for r in completion.results])


def _last_shared_answer(branch: Branch, keys: list) -> int | None:
    """The last call of `branch` whose conversation, up to its answer, starts `keys` (the
    messages of a new call) and is followed by more; None where there is none."""
    shared = next((i for i, (a, b) in enumerate(zip(branch.keys, keys)) if a != b),
                  min(len(branch.keys), len(keys)))
    return next((j for j in reversed(range(len(branch.turns)))
                 if branch.turns[j] <= shared and branch.turns[j] < len(keys)), None)


def _tools(request: Request) -> Any:
    return [convert.unstructure(t) for t in request.tools or ()]


def _key(message: Message) -> Any:
    """What must match for a message sent back to be the one recorded: tool call ids and
    the JSON spacing of their arguments may differ (harnesses rewrite both)."""
    calls = [(c.name, _parsed(c.arguments)) for c in message.tool_calls]
    return message.role, convert.unstructure(message.content), calls, message.name


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
