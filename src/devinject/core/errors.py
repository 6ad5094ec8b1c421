"""Error types that cross the library boundary. Leaf module: imports nothing from devinject."""

from __future__ import annotations


class DevinjectError(Exception):
    """Base of every error the CLI turns into a one-line message and a non-zero exit."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(DevinjectError):
    """Bad flags, profiles or configuration files."""


class UsageError(ConfigError):
    """A flag's value that cannot be used (a wrong path, a value out of range): the command line's mistake,
    exit 2 as click's own usage errors; a failure at run time is exit 1."""

    exit_code = 2


class DiscoveryError(DevinjectError):
    """The host could not be read the way discovery needs."""


class LdCacheError(DiscoveryError):
    """An ld.so.cache file is truncated or not in a known format."""


class SpecError(DevinjectError):
    """A CDI spec could not be parsed or written."""


class SpecValidationError(SpecError):
    """A CDI spec broke the schema or a semantic rule; carries every problem found."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems[0] if len(problems) == 1 else f"{len(problems)} problems: {problems[0]}")
        self.problems = problems


class ResolveError(DevinjectError):
    """A requested CDI device is unknown or ambiguous."""


class UnsafePathError(DevinjectError):
    """A container path would leave the container's root filesystem."""


class HookError(DevinjectError):
    """The OCI hook could not complete; it rolled back what it did."""


class LedgerError(DevinjectError):
    """The device ledger refused an allocation or could not be read."""
