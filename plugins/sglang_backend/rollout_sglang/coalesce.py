"""Requests made in one turn of the engine loop reach SGLang's scheduler as one message.

SGLang's tokenizer manager sends each request to the scheduler as soon as it is made. A
batch of samples, each its own `async_generate`, takes tens of milliseconds to make (256 of
them: about 70 ms here), and the scheduler, polling its socket between steps, starts
prefilling the first few while the rest are being made: more and smaller prefills than
`sglang.Engine.generate` runs, which sends a batch as one message. So the generate
requests dispatched in one turn of the loop are held and sent at the start of the next,
together, as the batch message SGLang's own batch path sends. Any other message (an abort
above all) first sends what is held: the scheduler sees everything in the order it was made.

The held requests go grouped by LoRA adapter (in their order otherwise): SGLang batches
them in that order, and its LoRA runs one product per run of neighbouring rows of one
adapter, so that a mixed batch's rows interleaved would cost one product per row.
"""

from __future__ import annotations

import asyncio


def coalesce_requests(tokenizer_manager, loop: asyncio.AbstractEventLoop) -> None:
    """Make `tokenizer_manager` (on `loop`) send the requests of one loop turn together."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    tm, send = tokenizer_manager, tokenizer_manager._dispatch_to_scheduler
    held: list = []

    def flush() -> None:
        batch = sorted(held, key=lambda request: request.lora_id or "")  # stable
        held.clear()
        if len(batch) == 1:
            send(batch[0])
        elif batch:
            send(tm.batch_tokenized_generate_req_type(batch=batch))

    def dispatch(obj) -> None:
        if type(obj) is not TokenizedGenerateReqInput:
            send(obj)  # through the socket below, which sends what is held first
            return
        if not held:
            loop.call_soon(flush)
        held.append(obj)

    tm.send_to_scheduler = _FlushingSocket(tm.send_to_scheduler, flush)
    tm._dispatch_to_scheduler = dispatch


class _FlushingSocket:
    """The scheduler's socket, sending the held requests before anything else: SGLang's
    control calls (weights, adapters, aborts) all write to it, some by their own path."""

    def __init__(self, socket, flush):
        self._socket, self._flush = socket, flush

    def send(self, *args, **kwargs):
        self._flush()
        return self._socket.send(*args, **kwargs)

    def send_pyobj(self, *args, **kwargs):
        self._flush()
        return self._socket.send_pyobj(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._socket, name)
