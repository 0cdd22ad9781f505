"""Real agent harnesses for tests/test_harnesses_live.py: Claude Code and Codex CLI, pinned,
installed from npm into a cache folder outside the clone (keyed by the pins, so a second run
installs nothing), and a counting proxy that sees every HTTP call a CLI makes.

`python tests/harnesses.py` installs them (scripts/test.sh does) and prints the folder.
Standard library only."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path

PACKAGES = {"@anthropic-ai/claude-code": "2.1.328", "@openai/codex": "0.169.0"}
CACHE = Path(os.environ.get("ROLLOUT_NPM_CACHE", Path.home() / ".cache" / "rollout" / "npm"))
INSTALL_TIMEOUT_S = 600
DONE = ".installed"  # written once every package is in place


class NoNpm(RuntimeError):
    """npm or node is not on PATH: the harnesses cannot be installed here."""


def folder() -> Path:
    specs = " ".join(f"{name}@{version}" for name, version in sorted(PACKAGES.items()))
    key = hashlib.sha256(f"{specs} {sys.platform} {platform.machine()}".encode()).hexdigest()
    return CACHE / key[:16]


def install() -> Path:
    """The folder holding both packages, installed on first use. NoNpm where npm or node is
    missing; a failed install raises (CalledProcessError, TimeoutExpired)."""
    target = folder()
    if (target / DONE).exists():
        return target
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        raise NoNpm(f"{' and '.join(missing)} not on PATH: cannot install "
                    f"{', '.join(f'{n}@{v}' for n, v in PACKAGES.items())}")
    CACHE.mkdir(parents=True, exist_ok=True)
    # Installed beside the target, then renamed: a run that dies half way leaves no folder
    # that looks installed, and two runs at once do not mix their files.
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=CACHE))
    try:
        subprocess.run(["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                        "--no-save", "--loglevel=error",
                        *(f"{name}@{version}" for name, version in PACKAGES.items())],
                       check=True, timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
        claude_binary(staging), codex_binary(staging)  # (each raises where it is absent)
        (staging / DONE).write_text(json.dumps(PACKAGES))
        try:
            staging.rename(target)
        except OSError:  # another run finished first
            if not (target / DONE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _one(pattern: str, root: Path) -> Path:
    found = sorted(p for p in root.glob(pattern) if p.is_file())
    if not found:
        raise FileNotFoundError(f"no {pattern} under {root}: the platform's package of the "
                                "CLI was not installed")
    return found[0]


def claude_binary(root: Path) -> Path:
    """Claude Code's native binary (its optional platform package; the wrapper's postinstall,
    which npm may not run, only links it)."""
    return _one("node_modules/@anthropic-ai/claude-code-*/claude", root)


def codex_binary(root: Path) -> Path:
    return _one("node_modules/@openai/codex-*/vendor/*/bin/codex", root)


# --- a proxy that counts ----------------------------------------------------------------------

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


if __name__ == "__main__":
    print(install())
