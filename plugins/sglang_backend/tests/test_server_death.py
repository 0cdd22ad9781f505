"""An SGLang server that dies mid-request fails the waiting call fast, with its log."""

from conftest import ENGINE

import rollout
from rollout.testing.server_death import check_killed_server_fails_fast


def test_killed_server_fails_waiting_calls_within_seconds(tiny_model):
    with rollout.load_backend("sglang", model=str(tiny_model), mode="server", **ENGINE) as backend:
        check_killed_server_fails_fast(backend, backend._backend.engine.process.proc.pid)
