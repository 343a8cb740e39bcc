"""Errors the engine reports to its callers; each message says what to do instead."""


class TandemError(Exception):
    """Base class of every error Tandem raises on purpose."""


class ConfigError(TandemError):
    """A configuration that cannot work; raised before serving starts."""


class ModelLoadError(TandemError):
    """A model folder that cannot be loaded (missing files, unknown architecture, bad weights)."""


class InvalidRequestError(TandemError):
    """A request that is malformed or can never be served (the server maps it to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineUnhealthyError(TandemError):
    """The engine cannot serve right now (a step has run past the health deadline, a worker
    process is stopped); /health answers 503 while it lasts."""


class EngineDeadError(EngineUnhealthyError):
    """The engine's worker failed and can no longer serve."""


class EngineOverloadedError(TandemError):
    """Too much work is queued already; the caller should retry later (HTTP 503 with
    Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
