"""The JIT-cache report the flashinfer backend logs before its first build.

What FlashInfer says is checked on the GPU machine (tests/gpu/test_prewarm.py);
here: the log lines, and that the module is loaded once per process, timed,
and that a FlashInfer that cannot be inspected (none here) never stops it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_sidecar.client.backends.jit_cache import JitCacheReport, ModuleLoad
from tests.dockerfile import REPO

pytestmark = pytest.mark.timeout(60)


def _report(tmp_path: Path, *, compiled: bool, aot: Path | None = None) -> JitCacheReport:
    jit_dir = tmp_path / ".cache" / "flashinfer" / "0.7.2.post1" / "90a" / "cached_ops"
    return JitCacheReport(
        module="mnnvl_moe_alltoall",
        flashinfer_version="0.7.2.post1",
        archs=("9.0a",),
        cache_dir=tmp_path / ".cache" / "flashinfer",
        jit_dir=jit_dir,
        library=jit_dir / "mnnvl_moe_alltoall" / "mnnvl_moe_alltoall.so",
        compiled=compiled,
        aot_library=aot,
    )


def test_the_log_line_names_the_cache_and_what_happens(tmp_path: Path) -> None:
    found = _report(tmp_path, compiled=True)
    assert found.source == "cache"
    assert str(found.jit_dir) in found.describe() and "found" in found.describe()
    missing = _report(tmp_path, compiled=False)
    assert missing.source == "compile"
    assert "not compiled for 9.0a" in missing.describe()
    assert "moe-sidecar prewarm" in missing.describe()
    shipped = _report(tmp_path, compiled=False, aot=tmp_path / "aot.so")
    assert shipped.source == "ahead-of-time" and "aot.so" in shipped.describe()
    assert "(compiled)" in ModuleLoad(191.0, True, missing).describe()
    assert "(loaded, not compiled)" in ModuleLoad(2.3, False, found).describe()
    assert "not inspected" in ModuleLoad(2.3, None, None).describe()


_PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from moe_sidecar.client.backends import jit_cache

calls = []
def failing():
    calls.append("failing")
    raise RuntimeError("Ninja build failed.")
def loader():
    calls.append("loader")

try:
    jit_cache.prepare_module(failing)
except RuntimeError as error:
    raised = str(error)
assert jit_cache.loaded_module() is None
first = jit_cache.prepare_module(loader)
second = jit_cache.prepare_module(loader)
print(json.dumps({
    "raised": raised,
    "calls": calls,
    "same": first is second and jit_cache.loaded_module() is first,
    "compiled": first.compiled,
    "report": first.report is not None,
    "seconds": first.seconds,
    "flashinfer_imported": "flashinfer" in sys.modules,
}))
"""


def test_module_is_loaded_once_per_process_and_a_failure_retries() -> None:
    # A fresh process: the load is process-wide state.
    run = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["raised"] == "Ninja build failed."
    assert result["calls"] == ["failing", "loader"], "failed once, then loaded once"
    assert result["same"] is True
    # No FlashInfer here: the report is unavailable and says so, the load goes on.
    assert result["report"] is False and result["compiled"] is None
    assert result["seconds"] >= 0.0 and result["flashinfer_imported"] is False
    assert "could not inspect FlashInfer's JIT cache" in run.stderr
    assert "ready in" in run.stderr and "cache not inspected" in run.stderr
