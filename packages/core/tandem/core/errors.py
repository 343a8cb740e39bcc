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


class EngineDeadError(TandemError):
    """The engine's worker failed and can no longer serve."""
