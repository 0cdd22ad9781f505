"""The transformers backend for rollout. torch and transformers load with the backend."""

from rollout_hf.backend import HFBackend

__all__ = ["HFBackend"]
