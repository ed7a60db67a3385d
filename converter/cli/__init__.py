"""`gemma4-convert`: one click group, one module per verb; only this package calls sys.exit."""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import threading
import traceback
import warnings

import click

from .. import __version__
from ..errors import ConverterError, OutputError

EXIT_INTERRUPTED = 130
EXIT_UNEXPECTED = 70
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away (`| head -1`)


# verb -> module of this package; a verb's module (and what it imports) loads only when that verb runs or --help
# lists them all, so `inspect` does not pay for convert's or verify's imports (and nothing here imports torch)
VERBS = {"inspect": "inspect", "convert": "convert", "check-pair": "check_pair", "verify": "verify", "upload": "upload",
         "compat": "compat"}


class StdoutFailed(Exception):
    """Writing standard output failed (a full device, a reader gone). Not an OSError, so that click's own handler
    (which turns a broken pipe into exit 1, the code `verify` gives a failed proof) lets it through to main."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.errno = error.errno


def _raised_writing_stdout(error: OSError) -> bool:
    return any(frame.f_code is click.utils.echo.__code__ and not frame.f_locals.get("err")
               for frame, _ in traceback.walk_tb(error.__traceback__))


class _VerbGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if _raised_writing_stdout(exc):
                raise StdoutFailed(exc) from exc
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        # a verb that fails to import raises here: a bug to see, not a verb to skip
        return importlib.import_module(f".{VERBS[name]}", __package__).command if name in VERBS else None


@click.group(cls=_VerbGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="gemma4-convert")
@click.option("--debug", is_flag=True, help="Show the Python traceback of unexpected errors.")
def cli(debug: bool) -> None:
    """Convert Gemma 4 target + MTP assistant checkpoints into layouts stock vLLM 0.21-0.33 serves correctly.

    \b
    Exit codes: 0 ok, 1 verification / pair check failed, 2 usage, 3 bad input checkpoint,
    4 output problem (exists, no space, permissions), 5 Hub error, 70 unexpected, 130 interrupted, 141 stdout closed.
    """


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _unexpected(exc: BaseException, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    first_line = (str(exc).splitlines() or [""])[0]
    click.echo(f"error: unexpected {type(exc).__name__}: {first_line} (rerun with --debug for the traceback)",
               err=True)
    sys.exit(EXIT_UNEXPECTED)


def _detach_stdout() -> None:
    """Points fd 1 at /dev/null so that the interpreter's own flush at exit does not fail (and print) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (tests' CliRunner, a closed fd)
        pass


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps every error to one line and an exit code."""
    debug = "--debug" in (argv if argv is not None else sys.argv) or bool(os.environ.get("GEMMA4_CONVERT_DEBUG"))
    # numpy is no requirement (the tool never needs it); torch's CPU wheel warns at import when it is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    previous_sigterm = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (kill, timeout, a batch scheduler) cleans up like Ctrl-C instead of dying mid-write
        previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cli.main(args=argv, prog_name="gemma4-convert", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("error: interrupted; nothing was left behind", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except ConverterError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except StdoutFailed as exc:
        _detach_stdout()
        if exc.errno == errno.EPIPE:  # quietly, as a writer killed by SIGPIPE would stop
            sys.exit(EXIT_BROKEN_PIPE)
        click.echo(f"error: cannot write to standard output ({exc}); an output being written was removed, one "
                   f"already renamed into place is complete", err=True)
        sys.exit(OutputError.exit_code)
    except Exception as exc:  # noqa: BLE001 - the one place that turns the unexpected into an exit code
        _unexpected(exc, debug)
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    sys.exit(0)
