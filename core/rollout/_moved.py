"""Modules that moved in 0.2, still importable by their old names until 0.3.

An old name gives the new module itself (not a copy), with a DeprecationWarning naming the
new place, so code that patches or compares its objects keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "rollout.apps.serving.service": "rollout.service.service",
    "rollout.apps.serving.client": "rollout.service.client",
    "rollout.apps.serving.pool": "rollout.service.pool",
    "rollout.apps.serving.remote": "rollout.service.served",
    "rollout.apps.serving.connect": "rollout.service.connect",
    "rollout.apps.serving.replicas": "rollout.service.replicas",
    "rollout.apps.serving.ray_placement": "rollout.service.ray_placement",
    "rollout.apps.serving.admission": "rollout.service.admission",
    "rollout.apps.serving.backoff": "rollout.service.backoff",
    "rollout.apps.serving.metrics": "rollout.apps.serving.prometheus",
    "rollout.apps.serving.weights": "rollout.weights",
    "rollout.apps.metrics": "rollout.apps.pass_at_k",
    "rollout.kit.buckets": "rollout.weights.buckets",
    "rollout.kit.checkpoint": "rollout.weights.checkpoint",
    "rollout.kit.transfer": "rollout.weights.transports",
    "rollout.kit.transfer.shm": "rollout.weights.transports.shm",
    "rollout.kit.transfer.collective": "rollout.weights.transports.collective",
    "rollout.kit.transfer.cuda_ipc": "rollout.weights.transports.cuda_ipc",
    "rollout.kit.transfer.nodes": "rollout.weights.transports.nodes",
    "rollout.testing.serving": "rollout.testing.server_contract",
    "rollout.testing.served": "rollout.testing.serve_child",
    "rollout.testing.models": "rollout.testing.model_folders",
    "rollout.apps.job": "rollout.apps.jobs.generate",
    "rollout.apps.agents.job": "rollout.apps.jobs.agents",
    "rollout.apps.ray_data_job": "rollout.apps.jobs.ray_data",
    # 0.2.x: one module name, one job (three schemas.py, two runner.py before).
    "rollout.testing.schemas": "rollout.testing.strict_tools",
    "rollout.apps.judges.schemas": "rollout.apps.judges.verdicts",
    "rollout.apps.jobs.runner": "rollout.apps.jobs.chunked",
    "rollout.testing.weights": "rollout.testing.weight_streams",
    # 0.2.x: the fan-out of an update in one place.
    "rollout.weights.remote": "rollout.weights.fanout",
    # 0.2.x: the hooks above the kit and the weights whose types they name.
    "rollout.contract.hookspecs": "rollout.hookspecs",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old name goes in rollout 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the new module is already loaded


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
