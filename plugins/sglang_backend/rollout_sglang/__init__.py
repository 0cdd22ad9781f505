"""The SGLang backend for rollout: `sglang.Engine` in process, or SGLang's HTTP server as a
child process on loopback. SGLang and torch are imported when the backend is created."""

from rollout_sglang.backend import SGLangBackend

__all__ = ["SGLangBackend"]
