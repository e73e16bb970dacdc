"""One exception tree. The library raises these; only cluster/cli/ turns them into exit codes."""
from __future__ import annotations

# Exit codes, documented in docs/cli.md.
EXIT_OK = 0
EXIT_FAILED = 1  # a node failed a command or a check found a blocking problem
EXIT_USAGE = 2  # bad input: inventory, arguments
EXIT_UNREACHABLE = 3  # at least one node could not be reached or was not trusted
EXIT_ENVIRONMENT = 4  # this machine cannot do it (e.g. the lab needs root and netns)
EXIT_INTERNAL = 70  # a bug in clusterctl (EX_SOFTWARE): an exception that is not a ClusterError
EXIT_INTERRUPTED = 130  # Ctrl-C


class ClusterError(Exception):
    """Base of every error clusterctl raises on purpose; carries the fix to show the user.

    The class sets the exit code; `exit_code=` overrides it for one error, e.g. a launch refused
    because a node is unreachable: `LaunchRefused(msg, fix, exit_code=EXIT_UNREACHABLE)`.
    """

    exit_code = EXIT_FAILED

    def __init__(self, message: str, fix: str | None = None, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.fix}" if self.fix else self.message


class UsageError(ClusterError):
    exit_code = EXIT_USAGE


class InventoryError(ClusterError):
    """Bad inventory input, located by file, line and dotted field path."""

    exit_code = EXIT_USAGE

    def __init__(
        self, file: str, line: int | None, field: str | None, message: str, fix: str | None = None
    ) -> None:
        where = f"{file}:{line}" if line else file
        head = f"{where}: {field}: {message}" if field else f"{where}: {message}"
        super().__init__(head, fix)
        self.file, self.line, self.field, self.detail = file, line, field, message


class TransportError(ClusterError):
    """A node could not be reached or talked to. `problem` is a short machine-readable code."""

    exit_code = EXIT_UNREACHABLE
    problem = "unreachable"

    def __init__(self, message: str, fix: str | None = None, problem: str | None = None) -> None:
        super().__init__(message, fix)
        if problem:
            self.problem = problem


class HostKeyError(TransportError):
    """The node's host key is unknown or differs from the recorded one (never auto-accepted)."""

    def __init__(
        self, message: str, fix: str, problem: str, fingerprint: str, expected: str | None = None
    ) -> None:
        super().__init__(message, fix, problem)
        self.fingerprint = fingerprint
        self.expected = expected


class CommandTimeout(ClusterError):
    """A command ran past its per-command timeout; the node itself was reachable."""


class LabError(ClusterError):
    exit_code = EXIT_ENVIRONMENT
