"""Every Hub failure becomes one line naming the repo or file and what to do, exit 5.

No network: tests/_hub_fakes.py (a real offline cache, a fake HfApi, no sockets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ResolvedRevision
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    LocalTokenNotFoundError,
    NotASafetensorsRepoError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)

from converter.errors import HubError, InputError, UsageError
from converter.hub.failures import describe_hub_error

from _hub_fakes import RemoteRepo, http_error, httpx, use_api

pytestmark = pytest.mark.usefixtures("offline_hub")


# ---------------------------------------------------------------------------------------------------------- error table


@pytest.mark.parametrize("exc, kind, fragment", [
    (http_error(GatedRepoError, 403), HubError, "gated repo; accept its terms on https://huggingface.co/acme/m"),
    (http_error(RepositoryNotFoundError, 404), HubError, "no such Hub repo (or it is private"),
    (http_error(RevisionNotFoundError, 404), HubError, "no such revision"),
    (http_error(HfHubHTTPError, 401), HubError, "refused the token (401)"),
    (http_error(HfHubHTTPError, 403), HubError, "no permission (403)"),
    (http_error(HfHubHTTPError, 429), HubError, "rate-limited by the Hub (429)"),
    (http_error(HfHubHTTPError, 503), HubError, "the Hub failed (503); rerun later"),
    (http_error(HfHubHTTPError, 409), HubError, "Hub request failed (409): 409 Client Error"),
    (LocalTokenNotFoundError("no token"), HubError, "no Hugging Face token; set HF_TOKEN"),
    (RevisionResolutionError("x"), HubError, "not in the Hub cache"),
    (LocalEntryNotFoundError("x"), HubError, "not in the Hub cache"),
    (IncompleteSnapshotError("x", snapshot_path="/s"), HubError, "cached snapshot is incomplete"),
    (OfflineModeIsEnabled("x"), HubError, "HF_HUB_OFFLINE=1 but this needs the Hub"),
    (httpx.ConnectError("refused"), HubError, "cannot reach the Hub"),
    (httpx.ReadTimeout("slow"), HubError, "cannot reach the Hub"),
    (ConnectionResetError("reset"), HubError, "cannot reach the Hub"),
    (NotASafetensorsRepoError("'acme/m' is not a safetensors repo."), InputError, "not a safetensors repo"),
    (HFValidationError("Repo id must be ..."), UsageError, "not a valid Hub repo id"),
])
def test_hub_errors_become_one_line_messages(exc, kind, fragment):
    error = describe_hub_error(exc, subject="acme/m@main")
    assert type(error) is kind and fragment in str(error)
    assert str(error).startswith("acme/m@main: ") and "\n" not in str(error)


def test_a_hub_failure_exits_5_with_one_line(monkeypatch, run_cli):
    class Missing(RemoteRepo):
        def resolve_revision(self, repo_id: str, *, revision: str | None = None, **kwargs: Any) -> ResolvedRevision:
            raise http_error(RepositoryNotFoundError, 404)

    use_api(monkeypatch, Missing({}, Path("/nonexistent")))
    result = run_cli("inspect", "acme/missing")
    assert result.code == 5
    assert result.err == "error: acme/missing: no such local path, and no such Hub repo (or it is private and the " \
                         "token, HF_TOKEN, has no access to it)\n"
