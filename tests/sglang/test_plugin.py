"""The entry point, loaded by SGLang's own plugin loader in a fresh process.

``sglang.srt.plugins.load_plugins()`` finds ``moe_sidecar`` in the
``sglang.srt.plugins`` group and runs it: off by default, on with
``MOE_SIDECAR_SGLANG=1`` (SGLang's class REPLACEd, the replacement
propagated to the factory's module), and a malformed switch changes nothing
and names itself in SGLang's log (SGLang logs a plugin's exception and goes on).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(240)]

_PROBE = """
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.moe.token_dispatcher import flashinfer
from sglang.srt.layers.moe.fused_moe_triton import layer
cls = flashinfer.FlashinferDispatcher
print("RESULT " + json.dumps({
    "replaced": bool(getattr(cls, "moe_sidecar_defers", False)),
    "factory_sees_it": layer.FlashinferDispatcher is cls,
}))
"""


def _probe(**env: str) -> tuple[dict[str, bool], str]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("MOE_SIDECAR_", "SGLANG_PLUGINS"))
    }
    environ |= env | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=environ,
        capture_output=True,
        text=True,
        timeout=200,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), done.stderr


def test_off_unless_enabled() -> None:
    result, _ = _probe()
    assert result == {"replaced": False, "factory_sees_it": True}


def test_enabled_replaces_sglang_dispatcher_everywhere() -> None:
    result, _ = _probe(MOE_SIDECAR_SGLANG="1")
    assert result == {"replaced": True, "factory_sees_it": True}


def test_malformed_switch_changes_nothing_and_names_itself() -> None:
    result, log = _probe(MOE_SIDECAR_SGLANG="perhaps")
    assert result == {"replaced": False, "factory_sees_it": True}
    assert "MOE_SIDECAR_SGLANG" in log and "'perhaps'" in log, log[-2000:]
