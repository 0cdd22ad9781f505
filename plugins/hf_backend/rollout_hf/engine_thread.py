"""The engine thread: the one thread that runs the model, with continuous batching.

Requests arrive from the event loop as Jobs whose rows (one per sample) wait in a queue.
Each step the engine:

1. drops the rows of cancelled requests (an abort, a timeout, a dropped client);
2. admits waiting rows while fewer than `batch_size` decode;
3. runs one decode step for the running rows and a prefill for the admitted ones, and
   merges the newcomers into the running batch (batch.py). A row that asked for batch
   invariance (`sampling.batch_invariant`) runs alone instead, in a batch of its own:
   its forward passes and draws then have the same shapes whatever else runs;
4. chooses every row's token (`rollout.kit.sampler`, each row with its own parameters
   and seed), with logprobs where asked;
5. hands the step's tokens to each event loop in one `call_soon_threadsafe` (handoff.py);
6. drops the rows that finished: a request ends when its own samples do.

A step that raises fails the requests it was running (a GenerationError each) and the
engine goes on with an empty batch; if the thread itself ends, every request still
waiting fails with EngineDeadError, and so does every later one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext

import torch

from rollout import EngineDeadError, GenerationError, RolloutTimeoutError

from rollout.kit.moe import routers
from rollout.kit.sampler import LogitsProcessor, Row, next_tokens, uses_processing

from rollout_hf.batch import Batch, prefill
from rollout_hf.handoff import Job, PromptScores, Token, deliver
from rollout_hf.lora import Adapters
from rollout_hf.routing import RouterTap

# An elementwise op this large runs in parallel (ATen's grain size is 32768 elements).
OPENMP_TEAM_ELEMENTS = 1 << 20
IDLE_WAIT_S = 1.0  # an idle engine wakes this often to look at its state
STEP_TIMEOUT_S = 600.0  # a step this long means the engine is stuck
LIFECYCLE_TIMEOUT_S = 600.0  # how long a lifecycle call waits for the running step


class Engine:
    def __init__(self, model, tokenizer, *, batch_size: int, pad_id: int,
                 device: torch.device, grammar_vocab: int, adapters: Adapters | None = None):
        self.model = model
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.device = device
        self.grammar_vocab = grammar_vocab  # the vocabulary the grammars are compiled for
        self.dead: EngineDeadError | None = None
        # Weight updates that succeeded (under the step lock): every token is stamped with
        # the count it was made under, which a "keep_kv" update changes between steps.
        self.updates = 0
        self._work = threading.Condition()  # guards _waiting, _stopping and dead
        self._waiting: deque[Row] = deque()
        self._stopping = False
        self._step_lock = threading.Lock()  # held through each step; lifecycle calls take it
        self._step_started: float | None = None
        # The engine thread's own (and a lifecycle call's, holding the step lock):
        self._batch = Batch()  # the rows that decode together
        self._alone: list[Batch] = []  # a batch of one for each batch-invariant row
        self._joining: list[Row] = []  # rows being admitted in this step
        self.routers = RouterTap(routers(model))  # (no router: a dense model)
        if device.type == "cpu":
            _start_openmp_team()
        self._thread = threading.Thread(target=self._run, name="rollout-hf-engine",
                                        daemon=True)
        self._thread.start()

    # --- on the event loop --------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._work:
            if self.dead is not None:
                raise self.dead
            self._waiting.extend(job.rows)
            self._work.notify()

    def check(self) -> None:
        """Raise if the engine cannot answer: a request that waited a while asks."""
        if self.dead is not None:
            raise self.dead
        if not self._thread.is_alive():
            raise EngineDeadError("the HF engine thread is gone")
        started = self._step_started
        if started is not None and time.monotonic() - started > STEP_TIMEOUT_S:
            raise GenerationError(
                f"the HF engine has been in one step for more than {STEP_TIMEOUT_S:.0f} s")

    # --- from the trainer's thread ------------------------------------------------------

    @contextmanager
    def exclusive(self):
        """No step runs inside, and the rows of cancelled requests (which may still be
        in the batch when the core starts a lifecycle call) are gone with their cache."""
        if not self._step_lock.acquire(timeout=LIFECYCLE_TIMEOUT_S):
            raise RolloutTimeoutError(
                f"the HF engine did not finish its step within {LIFECYCLE_TIMEOUT_S:.0f} s")
        try:
            with torch.inference_mode():  # the cache tensors were made in it
                self._drop_cancelled()
            yield
        finally:
            self._step_lock.release()

    def close(self, timeout: float = 30.0) -> None:
        with self._work:
            self._stopping = True
            self._work.notify_all()
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        death = None
        try:
            while True:
                with self._work:
                    while not (self._stopping or self._waiting or self._running()):
                        self._work.wait(IDLE_WAIT_S)
                    if self._stopping:
                        return
                with self._step_lock, torch.inference_mode():
                    self._step_started = time.monotonic()
                    try:
                        self._step()
                    except Exception as exc:  # noqa: BLE001 - fails this step's requests
                        self.fail_running(exc)
                    finally:
                        self._step_started = None
        except BaseException as exc:  # noqa: BLE001 - the thread ends; requests must not hang
            death = exc
        finally:
            self._die(death)

    def _batches(self) -> list[Batch]:
        return [self._batch, *self._alone]

    def _step(self) -> None:
        self._drop_cancelled()
        running = sum(len(batch) for batch in self._batches())
        # (Rows admitted stay in _joining until the step ends: if it raises, they fail too.)
        self._joining = joining = self._admit(self.batch_size - running)
        output: dict[Job, list] = {}
        self._advance(self._batch, [row for row in joining if not row.alone], output)
        for batch in self._alone:
            self._advance(batch, [], output)
        for row in joining:
            if row.alone:
                self._alone.append(Batch())
                self._advance(self._alone[-1], [row], output)
        self._alone = [batch for batch in self._alone if batch.rows]
        self._joining = []
        self._send(output)

    def _advance(self, batch: Batch, joining: list[Row], output: dict[Job, list]) -> None:
        """One step of `batch`: a decode of its rows, a prefill of `joining` (who then join
        it), and the next token of each; the tokens (and prompt scores) into `output`."""
        parts = []
        if batch.rows:
            with self._adapted(batch.rows), self.routers.reading(batch.rows,
                                                                 [1] * len(batch)):
                parts.append(batch.decode(self.model))
        if joining:
            scoring = [i for i, row in enumerate(joining) if _to_score(row.owner)]
            with self._adapted(joining), self.routers.reading(
                    joining, [len(row.prompt) for row in joining]):
                newcomers, logits, every = prefill(self.model, joining, self.pad_id,
                                                   self.device, every=bool(scoring))
            for i in scoring:  # one row of a job scores its prompt, once
                row = joining[i]
                if not row.owner.scored:
                    row.owner.scored = True
                    output.setdefault(row.owner, []).append(
                        score_prompt(every[i], row.prompt, row.owner.prompt_logprobs))
            parts.append(logits)
            batch.join(newcomers)
            batch.processor_stale = True
        if not batch.rows:
            return
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        chosen, logprobs, tops, masks = self._choose(batch, logits)
        ids = chosen.tolist()
        keep = []
        for i, row in enumerate(batch.rows):
            finish = row.push(ids[i], self.tokenizer)
            output.setdefault(row.owner, []).append(
                Token(row.index, ids[i], logprobs[i], tops[i], finish, masks[i],
                      tuple(row.routing) if finish and row.routing is not None else None,
                      self.updates))
            if finish is None:
                keep.append(i)
        batch.next_ids = chosen
        self._select(batch, keep)

    def _running(self) -> list[Row]:
        """Every admitted row (one that joined a batch in this step may be listed twice)."""
        return [row for batch in self._batches() for row in batch.rows] + self._joining

    def _adapted(self, rows: list[Row]):
        """The forward pass of `rows`, each row with its own LoRA adapter (or none)."""
        if self.adapters is None:
            return nullcontext()
        return self.adapters.active([row.adapter for row in rows])

    def _admit(self, free: int) -> list[Row]:
        rows: list[Row] = []
        with self._work:
            while self._waiting and len(rows) < free:
                row = self._waiting.popleft()
                if not row.owner.cancelled:
                    rows.append(row)
        return rows

    def _choose(self, batch: Batch, logits: torch.Tensor):
        rows = batch.rows
        if batch.processor_stale:  # rows joined: per-row state for the new batch
            batch.processor = LogitsProcessor(rows, logits.shape[-1], self.grammar_vocab,
                                              self.device) \
                if any(uses_processing(r) for r in rows) else None
            batch.processor_stale = False
        return next_tokens(rows, logits, batch.processor)

    def _select(self, batch: Batch, keep: list[int]) -> None:
        """Keep only the rows of `batch` at `keep`."""
        if len(keep) == len(batch):
            return
        if not keep:
            batch.processor = None
        elif batch.processor is not None:
            batch.processor.select(keep, torch.tensor(keep, device=self.device))
        batch.keep(keep)

    def _drop_cancelled(self) -> None:
        for batch in self._batches():
            self._select(batch, [i for i, row in enumerate(batch.rows)
                                 if not row.owner.cancelled])

    def _send(self, output: dict[Job, list], even_cancelled: bool = False) -> None:
        """One call_soon_threadsafe per event loop for everything in `output`."""
        by_loop: dict = {}
        for job, items in output.items():
            if even_cancelled or not job.cancelled:
                by_loop.setdefault(job.loop, []).append((job, items))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                for job, _ in batch:
                    job.cancelled = True

    def fail_running(self, exc: BaseException, during: str = "a step") -> None:
        """A step (or a weight update beside running rows, holding the step lock) raised:
        fail the requests it ran, start again with an empty batch."""
        jobs = {row.owner for row in self._running()}
        self._batch, self._alone, self._joining = Batch(), [], []
        with self._work:  # their other samples do not run either
            self._waiting = deque(r for r in self._waiting if r.owner not in jobs)
        failures = {}
        for job in jobs:
            error = GenerationError(f"the HF engine failed during {during}: {exc!r}")
            error.__cause__ = exc
            failures[job] = [error]
        self._send(failures)

    def _die(self, death: BaseException | None) -> None:
        with self._work:
            self._stopping = True
            self.dead = EngineDeadError("the HF engine was closed" if death is None
                                        else f"the HF engine thread died: {death!r}")
            rows = list(self._waiting)
            self._waiting.clear()
        jobs = {row.owner for row in rows + self._running()}
        self._batch, self._alone, self._joining = Batch(), [], []
        self._send({job: [EngineDeadError(str(self.dead))] for job in jobs},
                   even_cancelled=True)


def _to_score(job: Job) -> bool:
    return job.prompt_logprobs is not None and not job.scored


def score_prompt(logits: torch.Tensor, prompt: list[int], k: int) -> PromptScores:
    """The prompt's scores from one row's logits at every position [width, vocab] (the
    prompt at its right end): each token's logprob given those before it, and the k most
    likely tokens at each position."""
    n = len(prompt)
    width = logits.shape[0]
    logprobs = torch.log_softmax(logits[width - n: width - 1].float(), dim=-1)  # [n-1, V]
    ids = torch.tensor(prompt[1:], dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()
    tops: list[tuple] = [()]
    if k:
        values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        tops += [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return PromptScores([None, *chosen], tops if k else None)


def _start_openmp_team() -> None:
    """Give the constructing thread (normally the trainer's main thread, which lives on) an
    OpenMP team of its own. libgomp spin-waits its idle workers for long unless the process
    has more OpenMP threads than CPUs; with the engine thread's team alone, those spinning
    workers starve the event loop's thread, which then holds the GIL while the engine waits
    for it (decoding was measured 8x slower on 2 cores). A second team ends the spinning."""
    torch.zeros(OPENMP_TEAM_ELEMENTS).add_(1)

