"""Exceptions kiln raises for mistakes a user can fix.

Each message names the field and the limit."""


class KilnError(Exception):
    """Base class for every error kiln raises on purpose."""


class InvalidRequestError(KilnError, ValueError):
    """A request or sampling parameter is out of range. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(KilnError, ValueError):
    """An engine configuration value is invalid or cannot be satisfied on this machine."""


class ModelLoadError(KilnError):
    """A model path, file, architecture or tensor shape is not what kiln expects."""


class EngineClosedError(KilnError):
    """A request reached an engine whose memory was already released by close()."""
