"""Hub failures as one-line ConverterErrors: every huggingface_hub, xet and network exception the Hub verbs can meet.

Every huggingface_hub failure becomes a one-line HubError (exit 5) in `describe_hub_error`; the context managers wrap
one Hub call (`hub_errors`) or one transfer (`transfer_errors`), so a message names the repo and what was moved.
"""

from __future__ import annotations

import errno
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import ConverterError, HubError, InputError, OutputError, UsageError

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError


def describe_hub_error(exc: BaseException, *, subject: str) -> ConverterError | None:
    """The one-line ConverterError for a huggingface_hub / network failure about `subject`; None if not one of ours.

    Order matters: GatedRepoError is a RepositoryNotFoundError, which is an HfHubHTTPError; IncompleteSnapshotError
    is a LocalEntryNotFoundError; OfflineModeIsEnabled is a ConnectionError.
    """
    httpx = hub_http_client()
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        LocalTokenNotFoundError,
        NotASafetensorsRepoError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
        SafetensorsParsingError,
    )

    if isinstance(exc, GatedRepoError):
        return HubError(f"{subject}: gated repo; accept its terms on https://huggingface.co/{_repo_of(subject)} and "
                        f"use a token of that account (HF_TOKEN or `hf auth login`)")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"{subject}: no such local path, and no such Hub repo (or it is private and the token, "
                        f"HF_TOKEN, has no access to it)")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{subject}: no such revision (branch, tag or commit) in that repo")
    if isinstance(exc, DisabledRepoError):
        return HubError(f"{subject}: the repo is disabled on the Hub")
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubError(f"{subject}: a file it needs is not in the repo ({_first_line(exc)})")
    if isinstance(exc, HfHubHTTPError):
        return HubError(_describe_status(exc, subject))
    if isinstance(exc, LocalTokenNotFoundError):
        return HubError(f"{subject}: no Hugging Face token; set HF_TOKEN or run `hf auth login`")
    if isinstance(exc, IncompleteSnapshotError):
        return HubError(f"{subject}: its cached snapshot is incomplete and the Hub was not reached "
                        f"({_offline_reason()}); rerun with network access to finish the download")
    if isinstance(exc, (RevisionResolutionError, LocalEntryNotFoundError)):
        return HubError(f"{subject}: not a local path, and not in the Hub cache ({constants.HF_HUB_CACHE}) while the "
                        f"Hub is not reachable ({_offline_reason()}); rerun with network access")
    if isinstance(exc, OfflineModeIsEnabled):
        return HubError(f"{subject}: HF_HUB_OFFLINE=1 but this needs the Hub; unset HF_HUB_OFFLINE")
    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return HubError(f"{subject}: cannot reach the Hub at {constants.ENDPOINT} ({type(exc).__name__}); "
                        f"check the network and rerun (completed transfers are kept)")
    if isinstance(exc, (NotASafetensorsRepoError, SafetensorsParsingError)):
        return InputError(f"{subject}: {_first_line(exc)}")
    if isinstance(exc, HFValidationError):
        return UsageError(f"{subject}: not a valid Hub repo id ({_first_line(exc)})")
    return None


def _describe_status(exc: HfHubHTTPError, subject: str) -> str:
    status = getattr(exc.response, "status_code", None)
    if status == 401:
        return f"{subject}: the Hub refused the token (401); set a valid HF_TOKEN or run `hf auth login`"
    if status == 403:
        return (f"{subject}: no permission (403); the token needs write access to this repo or namespace "
                f"(a fine-grained token must list it)")
    if status == 429:
        return f"{subject}: rate-limited by the Hub (429); wait a few minutes and rerun (it resumes)"
    if status is not None and status >= 500:
        return f"{subject}: the Hub failed ({status}); rerun later (it resumes)"
    return f"{subject}: Hub request failed ({status}): {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _offline_reason() -> str:
    from huggingface_hub import constants
    return "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "network down or Hub unreachable"


def _repo_of(subject: str) -> str:
    return subject.split(":", 1)[0].split("@", 1)[0]


def hub_http_client() -> Any:
    """The HTTP client module huggingface_hub raises from: httpx on 1.x, httpx2 on 2.x."""
    try:
        from huggingface_hub.utils import httpx  # the alias: huggingface_hub >= 1.32 (httpx2 on 2.x)
    except ImportError:  # huggingface_hub 1.26-1.31: always httpx
        import httpx
    return httpx


def _hub_failures() -> tuple[type[BaseException], ...]:
    """What hub_errors turns into ConverterErrors (an except clause evaluates this only when something is raised)."""
    httpx = hub_http_client()
    from huggingface_hub.errors import (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        LocalTokenNotFoundError, NotASafetensorsRepoError, RevisionResolutionError,
                                        SafetensorsParsingError)

    return (HfHubHTTPError, LocalTokenNotFoundError, RevisionResolutionError, LocalEntryNotFoundError,
            httpx.TransportError, ConnectionError, TimeoutError, NotASafetensorsRepoError,
            SafetensorsParsingError, HFValidationError)


@contextmanager
def hub_errors(subject: str) -> Iterator[None]:
    """Turns huggingface_hub and network exceptions raised inside into one-line ConverterErrors about `subject`."""
    try:
        yield
    except _hub_failures() as exc:
        error = describe_hub_error(exc, subject=subject)
        if error is None:  # pragma: no cover - every class in _HUB_FAILURES is described
            raise
        raise error from exc


def _xet_error(name: str) -> type[BaseException] | tuple[()]:
    """hf_xet's exception class `name`, imported when an except clause needs it (hf_xet is optional for
    huggingface_hub; without it no transfer can raise these, and the empty tuple matches nothing)."""
    try:
        import hf_xet
    except ImportError:  # pragma: no cover - installed with huggingface_hub on every platform we support
        return ()
    return getattr(hf_xet, name)


@contextmanager
def transfer_errors(subject: str, what: str, *, cache: Path | None = None) -> Iterator[None]:
    """Like hub_errors around ONE transfer call (a file download, a folder upload), naming `what` was moved.

    hf_xet raises XetAuthenticationError (a PermissionError), XetObjectNotFoundError (a FileNotFoundError) and,
    for everything else (network, CAS, reconstruction), a plain RuntimeError; the LFS path wraps its HTTP errors
    in a RuntimeError too (`raise RuntimeError(...) from exc`, _commit_api.py). Inside this one call a
    RuntimeError can only come from the transfer, so it is described by type and cause, never by its text.
    `cache`: where a download writes; no space or no permission there is an output problem (exit 4).
    """
    where = f"{subject}: {what}"
    try:
        yield
    except _xet_error("XetAuthenticationError") as exc:
        raise HubError(f"{where}: hf_xet storage refused the credentials ({_first_line(exc)}); the token "
                       f"(HF_TOKEN) needs access to this repo; rerun to resume") from exc
    except _xet_error("XetObjectNotFoundError") as exc:
        raise HubError(f"{where}: hf_xet storage has no such object ({_first_line(exc)}); rerun later "
                       f"(it resumes)") from exc
    except _hub_failures() as exc:
        error = describe_hub_error(exc, subject=where)
        if error is None:  # pragma: no cover - every class in _HUB_FAILURES is described
            raise
        raise error from exc
    except RuntimeError as exc:
        cause = exc.__cause__
        described = describe_hub_error(cause, subject=where) if cause is not None else None
        if described is not None:
            raise described from exc
        raise HubError(f"{where}: the transfer failed in {'hf_xet' if cause is None else type(cause).__name__} "
                       f"({type(exc).__name__}: {_first_line(exc)}); rerun to resume (finished files and "
                       f"chunks are kept)") from exc
    except OSError as exc:
        if cache is not None and exc.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS):
            raise OutputError(f"{where}: cannot write the Hub cache {cache} ({exc.strerror}); free space or set "
                              f"HF_HUB_CACHE to another disk, then rerun (it resumes)") from exc
        raise

