"""The example backend's tests: the contract suite on transformers."""

pytest_plugins = ["rollout.testing.fixtures"]
