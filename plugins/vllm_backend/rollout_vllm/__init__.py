"""The vLLM backend for rollout: vLLM's engine in this process, or its OpenAI server as a
child process. vLLM is imported when the backend is created, not before."""

from rollout_vllm.backend import VLLMBackend

__all__ = ["VLLMBackend"]
