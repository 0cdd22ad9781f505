"""Shared checks for engines that can die: killing the server (or failing the engine)
mid-request fails the waiting call within seconds with EngineDeadError saying why, and
later calls at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable

import pytest

from rollout import EngineDeadError, Rollout, RolloutError
from rollout.kit.aio import engine_loop

# 32 x 4 samples of 2000 tokens: minutes of engine work (vLLM's tests also cap a step at 4
# sequences, the most samples a request may then ask for).
BATCH, SAMPLES = 32, 4
LONG = {"prompt": "the ka lo", "sampling": {"temperature": 1.0, "n": SAMPLES, "max_tokens": 2000,
                                            "ignore_eos": True}}
# Failing "fast" is against the request timeout the call would hang to otherwise. Before the
# failure surfaces, this process still reads what the engine made until then, which on a
# loaded machine has taken a minute (the engine makes tokens faster than Python reads them).
FAIL_WITHIN_S = 300
ARM_TIMEOUT_S = 300  # for the engine's first token


def kill_when_running(backend: Rollout, pids: Iterable[int], group: bool = False
                      ) -> Callable[[], concurrent.futures.Future]:
    """An `arm` for `check_failure_fails_calls`: SIGKILL `pids` (their process groups, with
    `group`) while the engine streams a long probe request.

    On an event, not on a clock: a timer on the engine loop once fired two minutes late on
    a loaded machine (the process got no CPU), by when the batch it was meant to cut had
    ended; and waiting for anything this process does after the first token (taking the
    batch in) lets a starved process see the probe end first. So the kill comes from the
    engine loop at the probe's first token, and arming returns then: the probe, with
    thousands of tokens to go, is cut mid-stream whatever the machine's load, and the batch
    that follows meets a dead engine (waiting on it, or at once). The future arm returns
    holds the probe's error."""
    kill, targets, loop = os.killpg if group else os.kill, list(pids), engine_loop().loop

    def arm() -> concurrent.futures.Future:
        first_token = threading.Event()

        async def probe() -> BaseException | None:
            stream = backend.stream(LONG)
            try:
                async for chunk in stream:
                    if chunk.token_ids and not first_token.is_set():
                        for pid in targets:
                            with contextlib.suppress(ProcessLookupError):
                                kill(pid, signal.SIGKILL)
                        first_token.set()
            except RolloutError as exc:
                return exc
            finally:
                first_token.set()
                await stream.aclose()
            return None

        outcome = asyncio.run_coroutine_threadsafe(probe(), loop)
        if not first_token.wait(ARM_TIMEOUT_S):
            pytest.fail(f"the engine made no token within {ARM_TIMEOUT_S} s")
        return outcome

    return arm


def check_killed_server_fails_fast(backend: Rollout, server_pid: int) -> None:
    check_failure_fails_calls(backend, kill_when_running(backend, [server_pid], group=True),
                              ("exited with code", "end of its log"))


def check_failure_fails_calls(backend: Rollout, arm: Callable[[], None],
                              clues: tuple[str, ...]) -> None:
    """`arm()` arranges a failure that comes while a long request runs (a kill at a probe's
    first token; a step that fails after some steps), and may return a future of the
    probe's error. The batch sent after must raise EngineDeadError (not finish, not time
    out) with every one of `clues` in its message, and so must the probe, cut mid-stream;
    a later call fails the same way at once."""
    probe = arm()
    with pytest.raises(EngineDeadError) as failed:
        backend.generate([LONG] * BATCH, timeout=FAIL_WITHIN_S)
    assert all(clue in str(failed.value) for clue in clues), str(failed.value)
    if probe is not None:
        cut = probe.result(FAIL_WITHIN_S)
        assert isinstance(cut, EngineDeadError), cut
        assert all(clue in str(cut) for clue in clues), str(cut)
    with pytest.raises(EngineDeadError):
        backend.generate([{"prompt": "x"}], timeout=FAIL_WITHIN_S)
