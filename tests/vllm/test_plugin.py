"""The plugin as vLLM loads it: vLLM's own ``load_general_plugins()``, a fresh process each.

Each case runs :data:`SCRIPT` in a new interpreter (vLLM loads plugins once
per process) with vLLM's own logging set up as its processes set it up, and
reports what vLLM's module holds afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.client.engines.vllm.fault_tolerance import FT_BACKEND
from moe_sidecar.client.engines.vllm.plugin import (
    check_environment,
    detect_generation,
    manager_class,
    plugin_mode,
)
from moe_sidecar.client.engines.vllm.sizing import Generation
from moe_sidecar.core.errors import InvalidArgument
from tests.vllm.conftest import vllm_release

# Eight vLLM interpreters at once: 200 s measured on 2 shared cores.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MARK = "PLUGIN-RESULT "
SCRIPT = f"""
import json
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

configure_logging(LoggingConfig())  # what vLLM's processes do before loading plugins
import vllm.distributed.device_communicators.all2all as a2a

original = a2a.FlashInferNVLinkOneSidedManager
from vllm.plugins import load_general_plugins

error = None
try:
    load_general_plugins()
except Exception as e:
    error = f"{{type(e).__name__}}: {{e}}"
current = a2a.FlashInferNVLinkOneSidedManager
out = {{
    "replaced": current is not original,
    "subclass": issubclass(current, original),
    "name": current.__name__,
    "generation": getattr(getattr(current, "vllm_generation", None), "value", None),
    "error": error,
}}
if out["replaced"]:
    # Imported afterwards, as during model loading: it binds our class and
    # asserts isinstance against it.
    import vllm.model_executor.layers.fused_moe.prepare_finalize.flashinfer_nvlink_one_sided as pf

    out["prepare_finalize_binds_ours"] = pf.FlashInferNVLinkOneSidedManager is current
import sys
from types import SimpleNamespace

# Loaded only where the plugin extended it (sidecar mode, MOE_SIDECAR_ON_PEER_LOSS=mask).
sentinel = sys.modules.get("vllm.v1.worker.sentinel.gpu_worker_sentinel")
out["ft_backends"] = None if sentinel is None else sorted(sentinel.FT_BACKEND_SET)
if sentinel is not None:
    # vLLM's own check, as a worker constructs its sentinel (gpu_worker.py).
    settings = SimpleNamespace(
        data_parallel_rank=0,
        data_parallel_size=2,
        data_parallel_master_ip="127.0.0.1",
        all2all_backend="flashinfer_nvlink_one_sided",
        # vLLM 0.34's sentinel also refuses PCP > 1 and an MoE draft model:
        prefill_context_parallel_size=1,
    )
    sentinel.WorkerSentinel(
        SimpleNamespace(parallel_config=settings, vllm_config=SimpleNamespace(speculative_config=None))
    )
    out["sentinel_accepts_ours"] = True
print("{MARK}" + json.dumps(out), flush=True)
"""

CASES: dict[str, dict[str, str]] = {
    "unset": {},
    "embedded": {"MOE_SIDECAR_VLLM": "1", "VLLM_PLUGINS": "moe_sidecar"},
    "sidecar": {"MOE_SIDECAR_TARGET": "unix:///run/moe-sidecar/sidecar.sock"},
    "sidecar-mask": {
        "MOE_SIDECAR_TARGET": "unix:///run/moe-sidecar/sidecar.sock",
        "MOE_SIDECAR_ON_PEER_LOSS": "mask",
    },
    "switched-off": {"MOE_SIDECAR_TARGET": "127.0.0.1:50051", "MOE_SIDECAR_VLLM": "0"},
    "not-selected": {"MOE_SIDECAR_VLLM": "1", "VLLM_PLUGINS": "some_other_plugin"},
    "malformed": {"MOE_SIDECAR_VLLM": "maybe"},
    "malformed-target": {"MOE_SIDECAR_TARGET": "localhost"},
}


def _run_case(name: str, env: dict[str, str], directory: Path) -> tuple[dict[str, Any], str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MOE_SIDECAR_") and k != "VLLM_PLUGINS"
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            cwd=directory,  # not the repository: no vllm/ or tests/ on the path
            env={**base, **env, "VLLM_LOGGING_LEVEL": "INFO"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        text, code = f"{expired.stdout!r}{expired.stderr!r}", None
    lines = [line for line in text.splitlines() if line.startswith(MARK)]
    assert lines, f"case {name}: no result (exit {code}):\n{text[-4000:]}"
    return json.loads(lines[-1][len(MARK) :]), text


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    """Every case (as many at once as there are cores): (its result, its output)."""
    directory = tmp_path_factory.mktemp("plugin")
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1)) as pool:
        futures = {
            name: pool.submit(_run_case, name, env, directory) for name, env in CASES.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _line(text: str) -> list[str]:
    return [line for line in text.splitlines() if "moe-sidecar: vLLM 0" in line]


def _ft_line(text: str) -> list[str]:
    return [line for line in text.splitlines() if "moe-sidecar: vLLM fault tolerance" in line]


@pytest.mark.parametrize(("case", "mode"), [("embedded", "embedded"), ("sidecar", "sidecar")])
def test_enabled_replaces_the_class_with_a_subclass_and_logs_one_line(
    outcomes: dict[str, tuple[dict[str, Any], str]], case: str, mode: str
) -> None:
    result, text = outcomes[case]
    assert result["error"] is None, text
    assert result["replaced"] and result["subclass"], result
    assert result["name"] == "MoeSidecarOneSidedManager"
    assert result["generation"] == "vLLM 0.33"
    assert result["prepare_finalize_binds_ours"]
    [line] = _line(text)
    assert (
        f"vLLM {vllm_release()}'s FlashInferNVLinkOneSidedManager replaced by moe_sidecar's" in line
    )
    assert (
        "initialize() takes dispatch_format and extra_payload_bytes_per_token, as since vLLM 0.33"
        in line
    )
    assert f"{mode} mode" in line
    assert "INFO" in line  # vLLM's own format: it went through vLLM's handler
    if mode == "sidecar":
        assert "MOE_SIDECAR_TARGET=unix:///run/moe-sidecar/sidecar.sock" in line


def test_sidecar_mode_with_masks_extends_vllms_fault_tolerance_backends_with_one_line(
    outcomes: dict[str, tuple[dict[str, Any], str]],
) -> None:
    result, text = outcomes["sidecar-mask"]
    assert result["error"] is None and result["replaced"], text
    assert result["ft_backends"] == ["deepep_low_latency", FT_BACKEND, "nixl_ep"], result
    assert result["sentinel_accepts_ours"], result
    [line] = _ft_line(text)
    assert f"accepts --all2all-backend {FT_BACKEND}" in line and "INFO" in line, line
    assert len(_line(text)) == 1, text


@pytest.mark.parametrize("case", ["sidecar", "embedded", "unset"])
def test_without_sidecar_masks_vllms_fault_tolerance_backends_are_untouched(
    outcomes: dict[str, tuple[dict[str, Any], str]], case: str
) -> None:
    result, text = outcomes[case]
    assert result["error"] is None, text
    assert result["ft_backends"] is None, result  # not even imported
    assert _ft_line(text) == []


@pytest.mark.parametrize("case", ["unset", "switched-off", "not-selected"])
def test_otherwise_it_changes_nothing(
    outcomes: dict[str, tuple[dict[str, Any], str]], case: str
) -> None:
    result, text = outcomes[case]
    assert result["error"] is None and not result["replaced"], text
    assert result["name"] == "FlashInferNVLinkOneSidedManager"
    assert _line(text) == []


def test_a_malformed_switch_stops_vllm_with_a_named_error(
    outcomes: dict[str, tuple[dict[str, Any], str]],
) -> None:
    result, text = outcomes["malformed"]
    assert not result["replaced"], text
    assert result["error"].startswith("InvalidArgument: MOE_SIDECAR_VLLM='maybe'"), result


def test_a_malformed_target_stops_vllm_when_the_plugin_loads(
    outcomes: dict[str, tuple[dict[str, Any], str]],
) -> None:
    result, text = outcomes["malformed-target"]
    assert not result["replaced"], text
    assert result["error"].startswith("InvalidArgument: MOE_SIDECAR_TARGET='localhost'"), result
    assert "host:port" in result["error"], result


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"MOE_SIDECAR_TARGET": " "}, None),
        ({"MOE_SIDECAR_TARGET": "unix:///s.sock"}, "sidecar"),
        ({"MOE_SIDECAR_TARGET": "embedded"}, "embedded"),
        ({"MOE_SIDECAR_VLLM": "1"}, "embedded"),
        ({"MOE_SIDECAR_VLLM": "1", "MOE_SIDECAR_TARGET": "127.0.0.1:1"}, "sidecar"),
        ({"MOE_SIDECAR_VLLM": "0", "MOE_SIDECAR_TARGET": "127.0.0.1:1"}, None),
        # The one boolean rule of every variable (moe_sidecar.defaults.parse_bool).
        ({"MOE_SIDECAR_VLLM": "true"}, "embedded"),
        ({"MOE_SIDECAR_VLLM": " Yes "}, "embedded"),
        ({"MOE_SIDECAR_VLLM": "on"}, "embedded"),
        ({"MOE_SIDECAR_VLLM": "off", "MOE_SIDECAR_TARGET": "127.0.0.1:1"}, None),
        ({"MOE_SIDECAR_VLLM": "False", "MOE_SIDECAR_TARGET": "127.0.0.1:1"}, None),
    ],
)
def test_plugin_mode(environ: dict[str, str], expected: str | None) -> None:
    assert plugin_mode(environ) == expected


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_plugin_mode_refuses_other_values(value: str) -> None:
    with pytest.raises(InvalidArgument, match=f"MOE_SIDECAR_VLLM='{value}': must be 1/0, true"):
        plugin_mode({"MOE_SIDECAR_VLLM": value})


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"MOE_SIDECAR_TARGET": "localhost"}, "MOE_SIDECAR_TARGET='localhost': expected"),
        ({"MOE_SIDECAR_TARGET": "unix://x.sock"}, "MOE_SIDECAR_TARGET='unix://x.sock'"),
        ({"MOE_SIDECAR_LOCAL_RANKS": "eight"}, "MOE_SIDECAR_LOCAL_RANKS='eight': must be"),
        ({"MOE_SIDECAR_LOCAL_RANKS": "0"}, "MOE_SIDECAR_LOCAL_RANKS='0': must be"),
        ({"MOE_SIDECAR_PROPOSE_TIMEOUT": "2m"}, "MOE_SIDECAR_PROPOSE_TIMEOUT='2m': must be"),
        ({"MOE_SIDECAR_PROPOSE_TIMEOUT": "-1"}, "MOE_SIDECAR_PROPOSE_TIMEOUT='-1': must be"),
        ({"MOE_SIDECAR_BACKEND": "nccl"}, "MOE_SIDECAR_BACKEND='nccl': must be one of"),
        ({"MOE_SIDECAR_GROUP": "a\tb"}, "MOE_SIDECAR_GROUP='a\\tb': must hold printable"),
    ],
)
def test_the_variables_are_checked_when_the_plugin_loads(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_environment(environ)
    assert str(raised.value).startswith(message), raised.value


def test_well_formed_variables_pass_the_check() -> None:
    check_environment(
        {
            "MOE_SIDECAR_TARGET": "unix:///run/moe-sidecar/sidecar.sock",
            "MOE_SIDECAR_LOCAL_RANKS": "8",
            "MOE_SIDECAR_PROPOSE_TIMEOUT": "120",
            "MOE_SIDECAR_BACKEND": "reference",
            "MOE_SIDECAR_GROUP": "deepseek-v3:fp4/tp1-ep8/pp0",
        }
    )
    check_environment({"MOE_SIDECAR_TARGET": "embedded"})


def test_generations_are_read_from_the_signature() -> None:
    # vLLM 0.33's own class: the subprocess cases above ("generation").
    class PR42976:
        def initialize(
            self,
            max_num_tokens: int,
            top_k: int,
            num_experts: int,
            hidden_size: int,
            dispatch_dtype_bytes_per_elem: int = 0,
            dispatch_scale_bytes_per_token: int = 0,
        ) -> None: ...

    class V030:
        def initialize(
            self,
            max_num_tokens: int,
            top_k: int,
            num_experts: int,
            hidden_size: int,
            x_bytes_per_token: int,
            x_sf_bytes_per_token: int,
        ) -> None: ...

    class Future:
        def initialize(self, max_num_tokens: int, layout: object) -> None: ...

    assert detect_generation(PR42976) is Generation.PR42976
    assert detect_generation(V030) is Generation.V0_30
    with pytest.raises(RuntimeError, match="matches none of the signatures"):
        detect_generation(Future)
    ours = manager_class(V030)
    assert issubclass(ours, V030) and ours.vllm_generation is Generation.V0_30
