"""The HTTP server in front of the real HF backend on the tiny model: the shared server
contract (OpenAI routes through the official `openai` client, the native route, keys, load),
plus what does not depend on the backend."""

import signal
import subprocess
import sys

import openai
import pytest

import rollout
from rollout.contract.errors import EngineDeadError, NoReplicaError, RolloutTimeoutError
from rollout.apps.serving.app import ServerThread
from rollout.testing.server_contract import CHAT, ServerContract, http


class TestHFServer(ServerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model, max_model_len: rollout.load_backend(
            "hf", model=model, max_model_len=max_model_len)


# --- a service that cannot serve ----------------------------------------------------------


class FailingService:
    """Stands for a pool whose replicas are gone (only the error path is under test)."""

    name = "failing"

    def __init__(self, error):
        self.error = error

    async def generate(self, request):
        raise self.error

    def stream(self, request):
        return FailingStream(self.error)

    async def health(self):
        raise self.error

    async def close(self):
        pass


class FailingStream:
    completion = None

    def __init__(self, error):
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    async def aclose(self):
        pass


@pytest.mark.parametrize(("error", "status"), [
    (NoReplicaError("no healthy replica"), 503),
    (EngineDeadError("engine exited"), 503),
    (RolloutTimeoutError("too slow"), 504),
])
def test_a_service_that_cannot_serve_is_a_503_or_504(error, status):
    with ServerThread(FailingService(error)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="failing", messages=CHAT, max_tokens=2)
        assert caught.value.status_code == status
        assert caught.value.body["code"] == error.kind
        with pytest.raises(openai.APIStatusError) as caught:
            list(client.completions.create(model="failing", prompt="x", stream=True))
        assert caught.value.status_code == status  # nothing sent yet: a plain error
        assert http(f"{server.url}/health")[0] == 503
        assert http(f"{server.url}/rollout/generate", {"requests": [{"prompt": "x"}]})[0] == status
        assert http(f"{server.url}/rollout/stream", {"request": {"prompt": "x"}})[0] == status


# --- running the server -------------------------------------------------------------------

SERVE_SCRIPT = """
import asyncio, sys, rollout
from rollout.apps.serving.app import serve
from rollout.service.service import LocalService

class Service(LocalService):
    async def close(self):
        await super().close()
        print("closed", flush=True)

ro = rollout.load_backend("hf", model=sys.argv[1])
asyncio.run(serve(Service(ro, "tiny"), port=0, on_started=lambda url: print(url, flush=True)))
print("returned", flush=True)
"""


def test_serve_stops_on_sigterm_and_closes_the_service(tiny_model):
    process = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(tiny_model)],
                               stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert http(f"{url}/health")[0] == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert process.stdout.read().split() == ["closed", "returned"]
    finally:
        process.kill()
        process.wait()


def test_serve_on_a_taken_port_fails_at_once_before_loading_the_model(tmp_path):
    """The port is bound first: a taken one is said at once, and replicas started after
    it cannot be handed the same port as a free one."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "rollout", "serve", "--backend", "hf",
                               "--model", str(tmp_path / "no-model-here"), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_serve_without_aiohttp_says_how_to_install_it(tiny_model):
    blocked = ("import sys; sys.modules['aiohttp'] = None; sys.argv[0] = 'rollout'; "
               "from rollout.apps.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", blocked, "serve", "--backend", "hf",
                           "--model", str(tiny_model)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "needs aiohttp" in done.stderr and "pip install" in done.stderr
