"""CUDA IPC between two processes on one GPU (runs only where a GPU is; CPU CI skips it):
the receiver gets the sender's bytes, and owns them before it answers, so a sender that
reuses its buffer for the next bucket does not change what was received."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA IPC needs a GPU; this machine has none", allow_module_level=True)

from rollout.weights.transports.cuda_ipc import CudaIpcSender  # noqa: E402

# Keeps every bucket it received and answers the sums of all of them: a bucket that were
# still a view of the sender's buffer would change when the sender packs the next one.
RECEIVER = """
import json, sys
from rollout.weights.buckets import unpack
from rollout.weights.transports.cuda_ipc import receive_cuda_ipc
kept = []
for line in sys.stdin:
    kept.append(receive_cuda_ipc(json.loads(line)))
    print(json.dumps([{n: t.double().sum().item() for n, t in unpack(b)} for b in kept]),
          flush=True)
"""


def test_buckets_cross_processes_by_cuda_ipc_and_are_copied_out():
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        with CudaIpcSender() as sender:
            sent = []
            for seed in range(3):  # one buffer, overwritten by each bucket
                g = torch.Generator().manual_seed(seed)
                named = [("a", torch.randn(1000, generator=g)),
                         ("b", torch.randn(7, 3, generator=g).half())]
                sent.append({n: t.double().sum().item() for n, t in named})
                receiver.stdin.write(json.dumps(sender.put_tensors(named)) + "\n")
                receiver.stdin.flush()
                got = json.loads(receiver.stdout.readline())
                assert got == [pytest.approx(s) for s in sent]
        assert sent[0] != sent[1]
    finally:
        receiver.stdin.close()
        receiver.wait(60)
