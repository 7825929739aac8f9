"""Errors that reach users. Each message says what was expected, what was found, and what to do."""


class DFlashError(Exception):
    """Base class: CLIs print the message (no traceback) and exit with ``exit_code``."""

    exit_code = 2


class UsageError(DFlashError):
    """The command line names no known subcommand (or is otherwise not a command)."""


class ConfigError(DFlashError):
    """The config (file or ``--set`` overrides) is invalid."""


class CacheError(DFlashError):
    """A cache is missing, not a cache, corrupt or incompatible."""


class CacheNotFoundError(CacheError):
    pass


class NotACacheError(CacheError):
    pass


class CacheCorruptError(CacheError):
    """A committed part fails a check (checksum, shape, offsets, ids, finiteness)."""

    def __init__(self, message: str, part: str | None = None, array: str | None = None):
        super().__init__(message)
        self.part = part
        self.array = array


class SpecMismatchError(CacheError):
    """The cache was written with another spec (teacher, layers, template, codec ...)."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


class DataError(DFlashError):
    """Bad input data (names file:line or sample id)."""


class SampleNotFoundError(CacheError, KeyError):
    """A requested sample id is not in any committed part."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
