"""A proxy that counts: every HTTP call an agent program makes, forwarded to a server and
recorded with what it was answered (tests/test_harnesses_*.py, bench/bench_harness_drift.py).
Standard library only."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import urllib.parse
from collections.abc import Callable

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
       "proxy-connection", "te", "upgrade"}


class Call:
    """One HTTP call: what the client sent (headers by their lower-case names) and the
    status and body it was answered with."""

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes):
        self.method, self.path, self.headers, self.body = method, path, headers, body
        self.status: int | None = None
        self.answer = b""  # the body it was answered with, as streamed

    def json(self):
        return json.loads(self.body) if self.body else None

    def events(self) -> list[dict]:
        """The JSON events of its answer, where that was a server-sent event stream."""
        return [json.loads(line[5:]) for line in self.answer.decode().splitlines()
                if line.startswith("data:") and line[5:].strip().startswith("{")]

    def __repr__(self) -> str:
        return f"{self.method} {self.path} -> {self.status}"


class CountingProxy:
    """Forwards every request to `target` (http://host:port) and records it with the status
    it was answered with; streams (SSE) are passed on as they come. `rewrite(call)` may
    return another body to forward (the call keeps what the client sent)."""

    def __init__(self, target: str, rewrite: Callable[[Call], bytes | None] | None = None,
                 timeout: float = 900.0):
        parsed = urllib.parse.urlsplit(target)
        self.target = (parsed.hostname, parsed.port)
        self.calls: list[Call] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one call a connection; a stream ends at close

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                call = Call(self.command, self.path,
                            {k.lower(): v for k, v in self.headers.items()}, body)
                proxy.calls.append(call)  # (atomic)
                sent = (rewrite(call) if rewrite else None) or body
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if sent or self.command in ("POST", "PUT", "PATCH"):
                    headers["Content-Length"] = str(len(sent))
                upstream = http.client.HTTPConnection(*proxy.target, timeout=timeout)
                try:
                    upstream.request(self.command, self.path, body=sent or None,
                                     headers=headers)
                    answer = upstream.getresponse()
                    call.status = answer.status
                    self.send_response(answer.status, answer.reason)
                    for key, value in answer.getheaders():
                        if key.lower() not in HOP or key.lower() == "content-length":
                            self.send_header(key, value)
                    self.end_headers()
                    if self.command != "HEAD":
                        while chunk := answer.read1(65536):
                            call.answer += chunk
                            self.wfile.write(chunk)
                            self.wfile.flush()
                finally:
                    upstream.close()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _forward

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="counting-proxy")

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def answered(call: Call) -> tuple[str | None, int, list[int] | None]:
    """A sampling call's answer as its client got it, from any of the three APIs, streamed
    or not: the text (None where it was a tool call), the count of sampled tokens, and
    their ids where the call asked for them (`return_token_ids`, chat completions)."""
    body = call.json()
    if body.get("stream"):
        events = call.events()
        if call.path.endswith("/v1/chat/completions"):
            choices = [c["choices"][0] for c in events if c.get("choices")]
            deltas = [c["delta"] for c in choices]
            text = "".join(d.get("content") or "" for d in deltas)
            tools = any(d.get("tool_calls") for d in deltas)
            ids = [i for c in choices for i in c.get("token_ids") or ()] \
                if any("token_ids" in c for c in choices) else None
            return (None if tools else text), events[-1]["usage"]["completion_tokens"], ids
        if call.path.endswith("/v1/messages"):
            text = "".join(e["delta"].get("text", "") for e in events
                           if e["type"] == "content_block_delta")
            (end,) = [e for e in events if e["type"] == "message_delta"]
            return text, end["usage"]["output_tokens"], None
        (end,) = [e for e in events if e["type"] in ("response.completed",
                                                      "response.incomplete")]
        answer = end["response"]
    else:
        answer = json.loads(call.answer)
    if "choices" in answer:
        choice = answer["choices"][0]
        message = choice["message"]
        return (None if message.get("tool_calls") else message["content"] or "",
                answer["usage"]["completion_tokens"], choice.get("token_ids"))
    if "content" in answer:  # a Messages answer
        blocks = answer["content"]
        tools = any(b["type"] == "tool_use" for b in blocks)
        return (None if tools else "".join(b.get("text", "") for b in blocks),
                answer["usage"]["output_tokens"], None)
    items = answer["output"]  # a Responses answer
    tools = any(i["type"] == "function_call" for i in items)
    text = "".join(c.get("text", "") for i in items if i["type"] == "message"
                   for c in i["content"])
    return (None if tools else text), answer["usage"]["output_tokens"], None
