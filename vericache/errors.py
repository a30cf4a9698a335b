"""Typed errors of the core. Each boundary (CLI, gRPC, HTTP) maps them once."""


class VeriCacheError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidArgument(VeriCacheError, ValueError):
    """A caller passed a value the core cannot use; `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownName(InvalidArgument):
    """A name looked up in a registry does not exist; the message lists the valid ones."""


class ContextTooLong(InvalidArgument):
    """The prompt plus the requested tokens do not fit the model's context window."""


class NotFound(VeriCacheError, KeyError):
    """A session, chunk or model that was asked for does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(VeriCacheError):
    """A memory budget, queue or capacity limit is full."""


class Unavailable(VeriCacheError):
    """A backend (store, drafter, verifier) cannot be reached right now."""


class DeadlineExceeded(Unavailable):
    """A call to a backend passed its deadline: unlike a refused connection, it may have run."""


class ModelLoadError(VeriCacheError):
    """The model path does not hold a model this runner can load."""
