"""Weight sync from this (trainer) process into an engine server in another process.

A real model of 327 MiB (343 MB; float32, the tiny model's tokenizer, a Llama scaled up) is
pushed into the engine several times; rounds alternate between paths and medians are
compared. Paths:
- raw: the transport alone, the same group buckets written into shared memory here and
  copied out by a child process (no engine): the floor;
- new: the backend's `update_weights` hook (buckets already packed), and the whole
  `Rollout.update_weights` (packing included);
- old (vLLM): the path before shared memory, each group as safetensors + base64 in the
  body of `/collective_rpc`.
Targets: raw/new >= 0.8 (the new path moves bytes at 80% of the transport's speed).

One function per backend (`bench_vllm`, `bench_sglang`), each returning its timings; the
model, the raw transport (a receiver child beside the engine: `receiver_beside`) and the
report are shared.

`--model smollm2` (or a model folder) pushes that model's weights instead of the built one
(SmolLM2-135M-Instruct: 538 MB, 30 layers, tied embeddings).

Run in the engine's environment (scripts/env.sh vllm):
    python bench/bench_weight_sync.py --backend vllm [--repeats 3] [--layers 12] [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from pathlib import Path

from common import prepare_engine

SETTINGS = {"dtype": "float32", "enforce_eager": True}


# --- the model -----------------------------------------------------------------------------

def build_model(out: Path, layers: int, hidden: int = 768) -> Path:
    """The tiny model's tokenizer with a Llama of `layers` layers of width `hidden`
    (12 x 768: 86M parameters, 327 MiB in float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.kit.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def load_state(model: Path) -> dict:
    """The weights in this process's memory, as a trainer holds them (and as the raw path's
    buckets are): safetensors maps the file, and reading its pages cost up to 0.5 s more."""
    from safetensors.torch import load_file

    return {name: t.clone() for name, t in load_file(str(model / "model.safetensors")).items()}


# --- the raw transport: shared memory between two processes, no engine ---------------------

RECEIVER = """
import sys, json
from rollout.weights.transports.shm import receive_shm
for line in sys.stdin:
    receive_shm(json.loads(line))
    print("ok", flush=True)
"""


def raw_shm(buckets: list, child: subprocess.Popen) -> float:
    """Seconds to move `buckets` through a fresh shared-memory file into `child`, which
    copies each out before it answers (as an engine's receiver does)."""
    from rollout.weights.transports.shm import ShmSender

    started = time.perf_counter()
    with ShmSender() as sender:  # a fresh file, as each update makes
        for bucket in buckets:
            child.stdin.write(json.dumps(sender.put(bucket)) + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "ok"
    return time.perf_counter() - started


def start_receiver() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


PROBE = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "max_tokens": 8}}


def greedy_tokens(backend):
    return backend.generate([PROBE])[0].unwrap()[0].token_ids


@contextmanager
def receiver_beside(backend, transport: str):
    """A receiver child for the raw `transport` ("shm", or "gloo" in a fresh group) beside
    `backend`: yields (child, group), group None for shm. The same weights go in every
    round, so the backend's greedy output must come out unchanged at the end. The child,
    the group and the backend are all closed on the way out."""
    from rollout.weights.transports import collective

    with closing(backend):
        child, group = (start_receiver(), None) if transport == "shm" else start_gloo_receiver()
        try:
            before = greedy_tokens(backend)
            yield child, group
            assert greedy_tokens(backend) == before
        finally:
            child.stdin.close()
            child.wait(30)
            if group is not None:
                collective.close(group)


# --- vLLM ----------------------------------------------------------------------------------

# The old path needs its receiving end in vLLM's worker: this module, as its extension.
try:
    from rollout_vllm.worker import WeightUpdateExtension
except ImportError:  # another engine's environment
    WeightUpdateExtension = object


class OldPathExtension(WeightUpdateExtension):
    def bench_load_safetensors(self, data: str) -> int:
        import base64

        from safetensors.torch import load

        tensors = load(base64.b64decode(data))
        self.reload_weights(weights_iterator=list(tensors.items()))
        return len(tensors)


def old_vllm_update(url: str, groups: list[dict]) -> None:
    """Before shared memory: each group as safetensors + base64 over HTTP, then a reset."""
    import base64
    import urllib.request

    from safetensors.torch import save

    def post(path: str, body: dict) -> None:
        request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            assert response.status == 200, response.read()

    for group in groups:
        data = base64.b64encode(save(group)).decode()
        post("/collective_rpc", {"method": "bench_load_safetensors", "args": [data]})
    post("/reset_prefix_cache", {})


def bench_vllm(model: Path, repeats: int) -> dict[str, list[float]]:
    import rollout
    from rollout.weights.buckets import DEFAULT_BUCKET_BYTES, iter_buckets
    from rollout_vllm.backend import layer_groups

    # The server imports this module (the old path's extension) from here.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    backend = rollout.load_backend(
        "vllm", model=str(model), mode="server", max_model_len=512, weight_transport="shm",
        engine_args={"worker_extension_cls": "bench_weight_sync.OldPathExtension"}, **SETTINGS)
    with receiver_beside(backend, "shm") as (child, _):
        inner = backend._backend
        state = load_state(model)
        buckets = list(iter_buckets(state.items(), DEFAULT_BUCKET_BYTES))
        groups = list(layer_groups(buckets, inner.shapes, inner.weight_group_bytes))
        group_buckets = [next(iter_buckets(g.items(), 2**62)) for g in groups]
        times: dict[str, list[float]] = {"raw": [], "new (hook)": [], "new (Rollout)": [],
                                          "old": []}
        for _ in range(repeats):
            times["raw"].append(raw_shm(group_buckets, child))
            times["new (hook)"].append(_timed(lambda: inner.update_weights(buckets=buckets)))
            times["new (Rollout)"].append(_timed(lambda: backend.update_weights(state.items())))
            times["old"].append(_timed(lambda: old_vllm_update(inner.engine.url, groups)))
    times.update(bench_vllm_gloo(model, repeats, state, group_buckets))
    return times


def bench_vllm_gloo(model: Path, repeats: int, state: dict, group_buckets: list) -> dict:
    """`weight_transport="gloo"`: vLLM's weight-transfer routes and our gloo engine, against
    the raw gloo broadcast of the same groups into a child process, into fresh buffers as
    our engine receives (started after the first server is gone: one vLLM server at a time)."""
    import rollout

    backend = rollout.load_backend("vllm", model=str(model), mode="server", max_model_len=512,
                                   weight_transport="gloo", **SETTINGS)
    with receiver_beside(backend, "gloo") as (child, group):
        backend.update_weights(state.items())  # opens the group, once per backend
        times: dict[str, list[float]] = {"raw (gloo)": [], "new (gloo)": []}
        for _ in range(repeats):
            times["raw (gloo)"].append(raw_gloo(group_buckets, child, group, fresh=True))
            times["new (gloo)"].append(_timed(lambda: backend.update_weights(state.items())))
    return times


# --- a rollout serve (HF backend) ----------------------------------------------------------

def bench_hf(model: Path, repeats: int) -> dict[str, list[float]]:
    """Through `rollout serve` in a replica process: `ServedRollout.update_weights` (packing
    straight into shared memory, one HTTP message per bucket) against the raw transport
    moving the same buckets."""
    from rollout.service.served import ServedRollout
    from rollout.weights.buckets import DEFAULT_BUCKET_BYTES, iter_buckets

    state = load_state(model)
    buckets = list(iter_buckets(state.items(), DEFAULT_BUCKET_BYTES))
    served = ServedRollout.start("hf", str(model))
    with receiver_beside(served, "shm") as (child, _):
        times: dict[str, list[float]] = {"raw": [], "new (served)": []}
        for _ in range(repeats):
            times["raw"].append(raw_shm(buckets, child))
            times["new (served)"].append(_timed(lambda: served.update_weights(state.items())))
    return times


# --- SGLang --------------------------------------------------------------------------------

GLOO_RECEIVER = """
import sys, json
from rollout.weights.transports import collective
group = collective.open_group("127.0.0.1", int(sys.argv[1]), 1, 2, sys.argv[2], "gloo", 120)
print("joined", flush=True)
buffer = None  # reused unless told (SGLang receives into new tensors every time)
for line in sys.stdin:
    message = json.loads(line)
    data = collective.receive_bucket(group, message, out=None if message["fresh"] else buffer).data
    buffer = data if buffer is None or data.numel() > buffer.numel() else buffer
    print("ok", flush=True)
collective.close(group)
"""


def start_gloo_receiver():
    """A child process joined to a fresh gloo group with this one (rank 0 here)."""
    from rollout.kit.process import HOST, free_port
    from rollout.weights.transports import collective

    port, name = free_port(), collective.unique_group_name()
    child = subprocess.Popen([sys.executable, "-c", GLOO_RECEIVER, str(port), name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    group = collective.open_group(HOST, port, 0, 2, name, "gloo", 120)
    assert child.stdout.readline().strip() == "joined"
    return child, group


def raw_gloo(buckets: list, child: subprocess.Popen, group, fresh: bool) -> float:
    """Seconds to broadcast `buckets` to `child` tensor by tensor, the layout announced
    first on its stdin, as SGLang's receiver takes them; into a buffer the child reuses
    (the transport alone), or `fresh` ones (its page faults too, as SGLang's receiver)."""
    from rollout.weights.buckets import layout
    from rollout.weights.transports import collective

    started = time.perf_counter()
    for bucket in buckets:
        child.stdin.write(json.dumps({**layout(bucket.tensors, bucket.nbytes),
                                      "fresh": fresh}) + "\n")
        child.stdin.flush()
        collective.broadcast_bucket(group, bucket)
        assert child.stdout.readline().strip() == "ok"
    return time.perf_counter() - started


def bench_sglang(model: Path, repeats: int) -> dict[str, list[float]]:
    """gloo (the update group) and tensor (`update_weights_from_tensor`) into one SGLang
    server, against the raw gloo broadcast of the same groups into a child process."""
    import rollout
    from rollout.weights.buckets import DEFAULT_BUCKET_BYTES, iter_buckets
    from rollout_sglang.transport import make_sender
    from rollout_sglang.weights import checked_groups

    backend = rollout.load_backend("sglang", model=str(model), mode="server",
                                   dtype="float32", max_total_tokens=4096,
                                   weight_transport="gloo")
    with receiver_beside(backend, "gloo") as (child, group):
        inner = backend._backend
        senders = {"gloo": inner.weights,
                   "tensor": make_sender("tensor", inner.engine, inner.request_timeout, 60)}
        state = load_state(model)
        buckets = list(iter_buckets(state.items(), DEFAULT_BUCKET_BYTES))
        groups = checked_groups(buckets, inner.shapes, inner.weight_group_bytes)
        group_buckets = [next(iter_buckets(g, 2**62)) for g in groups]
        inner.update_weights(buckets=buckets)  # opens the update group, once per backend
        times: dict[str, list[float]] = {"raw": [], "raw (fresh)": [], "new (hook)": [],
                                          "new (Rollout)": [], "old": []}

        def hook(transport: str) -> float:
            # Fresh buckets, as a trainer's every step makes: the tensor path moves each
            # tensor it has not sent before into shared memory (a copy).
            fresh = list(iter_buckets(state.items(), DEFAULT_BUCKET_BYTES))
            inner.weights = senders[transport]
            return _timed(lambda: inner.update_weights(buckets=fresh))

        for _ in range(repeats):
            times["raw"].append(raw_gloo(group_buckets, child, group, fresh=False))
            times["raw (fresh)"].append(raw_gloo(group_buckets, child, group, fresh=True))
            times["new (hook)"].append(hook("gloo"))
            times["new (Rollout)"].append(_timed(lambda: backend.update_weights(state.items())))
            times["old"].append(hook("tensor"))
            inner.weights = senders["gloo"]
    return times


BACKENDS = {"hf": bench_hf, "vllm": bench_vllm, "sglang": bench_sglang}


# --- running and reporting -----------------------------------------------------------------

def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def report(times: dict[str, list[float]], nbytes: int) -> None:
    medians = {path: statistics.median(ts) for path, ts in times.items()}
    gib = nbytes / 2**30
    for path, median in medians.items():
        runs = " ".join(f"{t:.2f}" for t in times[path])
        print(f"{path:>14}: median {median:6.2f} s  {gib / median:5.2f} GiB/s  ({runs})")
    for path, median in medians.items():
        if path.startswith("new"):
            raw = "raw (gloo)" if path == "new (gloo)" else "raw"  # the same transport
            print(f"{raw}/{path}: {medians[raw] / median:.2f} (target >= 0.8)")
    if "old" in medians:
        print(f"old/new (hook): {medians['old'] / medians['new (hook)']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--model", default=None,
                        help="a known model's name (smollm2) or a model folder to push instead "
                             "of the built Llama of --layers layers")
    args = parser.parse_args()
    prepare_engine(args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            from rollout.kit.models import resolve

            model, what = Path(resolve(args.model)), args.model
        else:
            model, what = build_model(Path(tmp), args.layers), f"{args.layers} layers"
        nbytes = (model / "model.safetensors").stat().st_size
        print(f"model: {nbytes / 2**20:.0f} MiB, {what}; backend {args.backend}")
        report(BACKENDS[args.backend](model, args.repeats), nbytes)


if __name__ == "__main__":
    main()
