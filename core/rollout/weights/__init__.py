"""Weights into engines: one place for a weight update, from the trainer's tensors to the
engine's loaded weights.

- `update`: the protocol a service offers for an update (begin, a message per bucket,
  end, cancel), its pause modes and the checks of its fields;
- `send`: the trainer's side, `push_weights`: tensors into buckets, bytes by a transport;
- `fanout`: one update over every replica of a pool, each over HTTP, and the pool's kept
  copy;
- `receive`: the serving side: buckets off a transport into `Rollout.update_weights`;
- `buckets`: tensors packed into buckets and back; `transports/`: shared memory,
  collective groups (gloo, NCCL), CUDA IPC, and which node a process runs on.

Importing it is light: the names below load their module on first use.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "BUCKET_WAIT_S": "update", "PAUSES": "update", "TRANSPORTS": "update",
    "CHOICES": "update", "WeightUpdate": "update", "check_update": "update",
    "check_update_options": "update", "check_group": "update",
    "push_weights": "send", "choose_transport": "send", "require_transport": "send",
    "LocalUpdate": "receive", "OpenUpdates": "receive", "KeptWeights": "fanout",
    "KeepingUpdate": "fanout", "PoolUpdate": "fanout", "RemoteUpdate": "fanout",
    "Bucket": "buckets", "DEFAULT_BUCKET_BYTES": "buckets",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"rollout.weights.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rollout.weights' has no attribute {name!r}")
