"""Every exception the converter raises on purpose, each with the exit code the CLI maps it to.

Messages are one line and name the file, shard or tensor at fault, so the CLI can print them verbatim.
"""


class ConverterError(Exception):
    """Base class: an expected failure with a one-line, actionable message."""

    exit_code = 70


class VerificationFailed(ConverterError):
    """The converted output is not equivalent to its source."""

    exit_code = 1


class UsageError(ConverterError):
    """The command line asks for something inconsistent."""

    exit_code = 2


class InputError(ConverterError):
    """The source checkpoint is missing, corrupt, or not something this tool converts."""

    exit_code = 3


class UnsupportedLayoutError(UsageError):
    """A layout name nobody registered."""


class OutputError(ConverterError):
    """The destination exists, is inside the source, is not writable or ran out of space."""

    exit_code = 4


class HubError(ConverterError):
    """A Hugging Face Hub call failed (token, repo, network)."""

    exit_code = 5
