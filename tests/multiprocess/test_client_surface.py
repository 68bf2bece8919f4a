"""The client's surface on a CPU machine: ``BackendError`` when FlashInfer is
missing, and vLLM's ``get_handle()`` (README, "Using the client")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.multiprocess import workers
from tests.multiprocess.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None,
    reason="FlashInfer is installed here; the claim is about machines without it",
)
def test_backend_error_without_flashinfer_and_get_handle(tmp_path: Path) -> None:
    [out] = run_ranks(workers.client_surface_worker, 1, timeout=60, tmp_path=tmp_path)
    assert out["error"] is not None, "initialize() did not raise BackendError"
    message, cause = out["error"]
    assert "flashinfer-python 0.7.2.post1" in message and "backend='reference'" in message
    assert cause == "ModuleNotFoundError"
    # Nothing was built.
    assert out["after_failure"] == (False, None, 0)
    # get_handle() is the manager itself, as vLLM's manager returns itself.
    assert out["handle_before_build"] is True and out["handle_is_manager"] is True
    assert out["handle_serves_the_layer"] == 0.0


def test_a_bad_sidecar_target_in_the_environment_fails_the_manager(tmp_path: Path) -> None:
    [out] = run_ranks(
        workers.bad_target_worker,
        1,
        timeout=60,
        tmp_path=tmp_path,
        envs=[{"MOE_SIDECAR_TARGET": "localhost"}],
    )
    assert out["type"] == "InvalidArgument", out
    assert out["field"] == "MOE_SIDECAR_TARGET"
    assert out["message"].startswith("MOE_SIDECAR_TARGET='localhost': expected "), out
    assert "'host:port'" in out["message"]
