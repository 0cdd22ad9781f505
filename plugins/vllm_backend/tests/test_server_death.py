"""A vLLM server that dies mid-request fails the waiting call fast, with its log."""

from conftest import ENGINE

import rollout
from rollout.testing.server_death import check_killed_server_fails_fast


def test_killed_server_fails_waiting_calls_within_seconds(tiny_model):
    # 4 sequences a step: the failing batch runs for tens of seconds.
    with rollout.load_backend("vllm", model=str(tiny_model), mode="server", **ENGINE,
                              engine_args={"max_num_seqs": 4}) as backend:
        check_killed_server_fails_fast(backend, backend._backend.engine.process.proc.pid)
