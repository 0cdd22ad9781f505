"""release(["weights", "kv_cache"]) and resume() on the HF backend: how much GPU memory each
frees and takes back, and that generation still gives the same greedy tokens afterwards.

Two models: the tiny one (rollout.kit.tiny_model, a few MB) and a Llama of --layers x 768
(bench_weight_sync.build_model; 12 layers: 86M parameters, 327 MiB in float32), so the
weights' share is visible. On CPU (no GPU) it runs the same steps and prints no memory.

    python bench/bench_release_memory.py [--layers 12] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import torch  # noqa: E402

import rollout  # noqa: E402

PROBE = [{"prompt": p, "sampling": {"temperature": 0.0, "max_tokens": 16}}
         for p in ("the ka lo mi", "def return print", "x y su ta ri po")]
LOAD = [{"prompt": "the ka " * (i % 7 + 1), "sampling": {"temperature": 1.0, "max_tokens": 128,
                                                          "ignore_eos": True}}
        for i in range(64)]


def mem(cuda: bool) -> str:
    if not cuda:
        return "n/a (cpu)"
    torch.cuda.synchronize()
    return (f"allocated {torch.cuda.memory_allocated() / 2**20:8.1f} MiB, "
            f"reserved {torch.cuda.memory_reserved() / 2**20:8.1f} MiB")


def greedy(backend) -> list:
    return [c.unwrap()[0].token_ids for c in backend.generate(PROBE)]


def check(name: str, model: str, device: str | None) -> bool:
    backend = rollout.load_backend("hf", model=model, device=device, batch_size=64)
    cuda = backend._backend.device.type == "cuda"
    print(f"== {name} on {backend._backend.device}")
    print(f"  after load                 : {mem(cuda)}")
    before = greedy(backend)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    backend.generate(LOAD)  # 64 rows x 128 tokens: a KV cache worth freeing
    peak = f", peak during generate {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" \
        if cuda else ""
    print(f"  after generate (64x128)    : {mem(cuda)}{peak}")
    started = time.perf_counter()
    backend.release(["weights", "kv_cache"])
    released_s = time.perf_counter() - started
    print(f"  after release(weights, kv) : {mem(cuda)}  ({released_s * 1000:.0f} ms)")
    started = time.perf_counter()
    backend.resume(["weights", "kv_cache"])
    resumed_s = time.perf_counter() - started
    print(f"  after resume               : {mem(cuda)}  ({resumed_s * 1000:.0f} ms)")
    after = greedy(backend)
    backend.generate(LOAD[:8])
    same = before == after
    print(f"  generate after resume: ok; greedy tokens {'identical' if same else 'DIFFER'}")
    backend.close()
    return same


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    from bench_weight_sync import build_model

    from rollout.kit.tiny_model import build_tiny_model

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        ok &= check("tiny model", str(build_tiny_model(Path(tmp) / "tiny")), args.device)
        if args.layers:
            model = build_model(Path(tmp) / "llama", args.layers)
            size = (model / "model.safetensors").stat().st_size / 2**20
            ok &= check(f"Llama {args.layers}x768 ({size:.0f} MiB float32)", str(model),
                        args.device)
    print("RELEASE CHECK:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
