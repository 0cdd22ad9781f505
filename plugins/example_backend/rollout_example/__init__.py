"""The example backend of docs/writing-a-backend.md, run through the contract suite in CI."""

from rollout_example.backend import ExampleBackend

__all__ = ["ExampleBackend"]
