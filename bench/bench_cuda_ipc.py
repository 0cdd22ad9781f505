"""Weight pushes on one GPU: CUDA IPC (rollout.weights.transports.cuda_ipc) against shared memory
(rollout.weights.transports.shm), from tensors on this process's GPU into another process.

raw: --gib GiB of bfloat16 tensors (64 MiB each) on the GPU, packed into buckets of
--bucket-mib and sent to a receiver child, which copies each bucket out before it answers
(as an engine's receiver does): over CUDA IPC (GPU -> GPU, the bytes never leave the GPU),
over shm with the child keeping the bytes in host memory, and over shm with the child then
moving them to the GPU (what an engine on the GPU needs: GPU -> host -> GPU). A warm-up
round first, then --repeats timed rounds; medians; a checksum round checks the bytes.

served: `ServedRollout.update_weights` into a `rollout serve` replica (HF backend, a Llama
of --layers x 768, float32) on the same GPU, transport="cuda_ipc" against "shm", the
trainer's state on the GPU; the replica's greedy output must be unchanged after.

Without a GPU only the shm paths run (a check of the code, not a measurement).

    python bench/bench_cuda_ipc.py [--gib 1] [--bucket-mib 512] [--repeats 3] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

RECEIVER = """
import json, sys, torch
from rollout.weights.transports.cuda_ipc import receive_cuda_ipc
from rollout.weights.transports.shm import receive_shm
to_gpu = sys.argv[1] == "shm-gpu"
for line in sys.stdin:
    message = json.loads(line)
    if message["transport"] == "cuda_ipc":
        data = receive_cuda_ipc(message).data
    else:
        data = receive_shm(message).data
        if to_gpu:
            data = data.to("cuda")
            torch.cuda.synchronize()
    answer = int(data.sum(dtype=torch.int64)) if message.get("checksum") else "ok"
    print(json.dumps(answer), flush=True)
"""


def groups_of(named: list, bucket_bytes: int) -> list[list]:
    groups, current, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    return groups + [current] if current else groups


def one_round(sender, groups, child, checksum: bool = False) -> tuple[float, list]:
    answers = []
    started = time.perf_counter()
    for group in groups:
        message = sender.put_tensors(group)
        if checksum:
            message["checksum"] = True
        child.stdin.write(json.dumps(message) + "\n")
        child.stdin.flush()
        answers.append(json.loads(child.stdout.readline()))
    return time.perf_counter() - started, answers


def raw(named: list, bucket_bytes: int, repeats: int, cuda: bool) -> dict[str, list[float]]:
    from rollout.weights.transports.shm import ShmSender

    groups = groups_of(named, bucket_bytes)
    expected = [sum(int(t.contiguous().view(torch.uint8).sum(dtype=torch.int64))
                    for _, t in g) for g in groups]
    paths = {"shm (child keeps host copy)": ("shm", ShmSender)}
    if cuda:
        from rollout.weights.transports.cuda_ipc import CudaIpcSender

        paths = {"cuda_ipc (GPU->GPU)": ("cuda_ipc", CudaIpcSender),
                 **paths, "shm + child .to(cuda)": ("shm-gpu", ShmSender)}
    times = {}
    for path, (mode, make_sender) in paths.items():
        child = subprocess.Popen([sys.executable, "-c", RECEIVER, mode], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            with make_sender() as sender:
                one_round(sender, groups, child)  # warm-up: CUDA context, first mapping
                times[path] = [one_round(sender, groups, child)[0] for _ in range(repeats)]
                _, sums = one_round(sender, groups, child, checksum=True)
                assert sums == expected, f"{path}: checksums {sums} != {expected}"
        finally:
            child.stdin.close()
            child.wait(60)
    return times


def served(layers: int, repeats: int, cuda: bool) -> dict[str, list[float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from bench_weight_sync import build_model, load_state

    from rollout.service.served import ServedRollout

    probe = [{"prompt": "the ka lo", "sampling": {"temperature": 0.0, "max_tokens": 8}}]
    transports = ["cuda_ipc", "shm"] if cuda else ["shm"]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), layers)
        nbytes = (model / "model.safetensors").stat().st_size
        state = {n: t.to("cuda") if cuda else t for n, t in load_state(model).items()}
        rollout = ServedRollout.start("hf", str(model))
        try:
            before = [c.unwrap()[0].token_ids for c in rollout.generate(probe)]
            for transport in transports:  # warm-up
                rollout.update_weights(state.items(), transport=transport)
            times: dict[str, list[float]] = {f"served {t}": [] for t in transports}
            for _ in range(repeats):
                for transport in transports:
                    started = time.perf_counter()
                    rollout.update_weights(state.items(), transport=transport)
                    times[f"served {transport}"].append(time.perf_counter() - started)
            after = [c.unwrap()[0].token_ids for c in rollout.generate(probe)]
            assert after == before, "greedy output changed after pushing the same weights"
        finally:
            rollout.close()
    print(f"served model: {nbytes / 2**20:.0f} MiB ({layers} x 768, float32); "
          f"greedy output unchanged after the pushes")
    return {path: [t for t in ts] for path, ts in times.items()}, nbytes


def report(times: dict[str, list[float]], nbytes: int) -> None:
    medians = {path: statistics.median(ts) for path, ts in times.items()}
    for path, median in medians.items():
        runs = " ".join(f"{t * 1000:.0f}" for t in times[path])
        print(f"  {path:>30}: median {median * 1000:8.1f} ms  {nbytes / median / 1e9:7.2f} GB/s"
              f"  {nbytes / median / 2**30:7.2f} GiB/s  (ms: {runs})")
    first = next(iter(medians))
    for path, median in list(medians.items())[1:]:
        print(f"  {first} vs {path}: {median / medians[first]:.2f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12, help="0: skip the served bench")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (no GPU: shm only)'}")
    per = 32 * 2**20  # bf16 elements: 64 MiB a tensor
    count = max(1, round(args.gib * 2**30 / (per * 2)))
    g = torch.Generator(device=device).manual_seed(0)
    named = [(f"layer.{i}.weight", torch.randn(per, generator=g, device=device,
                                               dtype=torch.bfloat16)) for i in range(count)]
    nbytes = count * per * 2
    print(f"raw: {count} bf16 tensors, {nbytes / 2**30:.2f} GiB, buckets of "
          f"{args.bucket_mib} MiB, {args.repeats} timed rounds after a warm-up, then a checksum round")
    ok = True
    try:
        report(raw(named, args.bucket_mib * 2**20, args.repeats, cuda), nbytes)
    except Exception:
        ok = False
        traceback.print_exc()
    del named
    if args.layers:
        try:
            times, model_bytes = served(args.layers, args.repeats, cuda)
            report(times, model_bytes)
        except Exception:
            ok = False
            traceback.print_exc()
    print("IPC BENCH:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
