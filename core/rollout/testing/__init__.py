"""The contract suite every backend runs against itself, on the real engine.

A backend's test module subclasses `BackendContract` and overrides one fixture::

    from rollout.testing import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture(scope="class")
        def make_backend(self):
            return lambda model: rollout.load_backend("mine", model=model)

Needs hypothesis, pytest, torch, safetensors and transformers (`rollout-core[testing]`).
"""

from rollout.testing.contract import BackendContract, ContractMachine, WeightTestsOnly
from rollout.testing.on_policy import OnPolicyOnly
from rollout.testing.model_folders import perturbed_copy, tiny_model_dir
from rollout.testing.strategies import invalid_requests, requests, sampling_params

__all__ = [
    "BackendContract",
    "WeightTestsOnly",
    "OnPolicyOnly",
    "ContractMachine",
    "invalid_requests",
    "perturbed_copy",
    "requests",
    "sampling_params",
    "tiny_model_dir",
]
