"""Typed errors. Every error a user can cause names what was wrong and what is allowed."""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of every error raised by rollout and its backends."""

    kind = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message}


class InvalidRequestError(RolloutError, ValueError):
    """A request (or a setting) has a bad value: `field` is its dotted path, `detail` what
    is wrong with it, `allowed` what it may be. `message` joins the three for people."""

    kind = "invalid_request"

    def __init__(self, field: str, detail: str, allowed: str | None = None):
        text = f"{field}: {detail}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)
        self.field = field
        self.detail = detail
        self.allowed = allowed

    def __reduce__(self):  # pickled with its fields (Ray and process pools send errors)
        return type(self), (self.field, self.detail, self.allowed)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "field": self.field, "detail": self.detail,
                "allowed": self.allowed}


class UnknownImageError(InvalidRequestError):
    """An image named by its uuid alone that the engine's side does not hold (never sent
    there, or evicted since): send it again with its pixels."""

    kind = "unknown_image"


class UnknownBackendError(RolloutError, LookupError):
    kind = "unknown_backend"


class PluginLoadError(RolloutError, ImportError):
    kind = "plugin_load"


class BackendContractError(RolloutError, TypeError):
    """A backend's hook implementations do not match the hook specifications."""

    kind = "backend_contract"


class UnsupportedError(RolloutError, NotImplementedError):
    """The backend cannot offer this capability here; `reason` says why."""

    kind = "unsupported"

    def __init__(self, capability: str, reason: str):
        super().__init__(f"{capability} is not supported: {reason}")
        self.capability = capability
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.capability, self.reason)


class BackendReleasedError(RolloutError, RuntimeError):
    """The backend's weights or KV cache are released; call resume() first."""

    kind = "released"


class EngineDeadError(RolloutError, RuntimeError):
    """The engine (a process or server) stopped; the message carries the end of its log."""

    kind = "engine_dead"


class WeightsDirtyError(RolloutError, RuntimeError):
    """A weight update failed midway: the engine may hold a mix of old and new weights, so
    it takes no request until a full update succeeds (or it is restarted)."""

    kind = "weights_dirty"


class NoReplicaError(RolloutError, RuntimeError):
    """No healthy replica is left to serve a request."""

    kind = "no_replica"


class OverloadedError(RolloutError, RuntimeError):
    """The server holds as much waiting work as it may: try again after `retry_after`
    seconds (HTTP 429 with Retry-After). Nothing of the request ran."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):
        return type(self), (self.message, self.retry_after)


class RolloutTimeoutError(RolloutError, TimeoutError):
    kind = "timeout"


class GenerationError(RolloutError, RuntimeError):
    """The engine failed on one request; the others of its batch are unaffected."""

    kind = "generation"


def error_class(kind: str | None) -> type[RolloutError]:
    """The error class of a kind (RolloutError for one not known here)."""
    return next((cls for cls in _subclasses(RolloutError) if cls.kind == kind), RolloutError)


def from_dict(data: dict) -> RolloutError:
    """Rebuild an error sent as `to_dict()` (over HTTP or in a results file)."""
    cls = error_class(data.get("kind"))
    message = data.get("message", "")
    if issubclass(cls, InvalidRequestError):
        error = cls(data.get("field") or "request", data.get("detail") or "",
                    data.get("allowed"))
    elif cls is UnsupportedError:
        error = UnsupportedError.__new__(cls)
        RolloutError.__init__(error, message)
    else:
        error = cls(message)
    error.message = message
    error.args = (message,)
    return error


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
