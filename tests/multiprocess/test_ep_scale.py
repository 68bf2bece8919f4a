"""``bench/ep_scale.py`` on the CPU: its smoke mode, run as the GPU run is.

The script is run in a subprocess with the reference backend (a CPU copy of
FlashInfer's all-to-all over gloo): it starts a real sidecar, spawns its rank
processes per step, and must go through all four measurements with every
check passing. Its check functions are also fed made-up results, so a wrong
figure is shown to fail the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import ep_scale
from tests.multiprocess.harness import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = REPO / "bench" / "ep_scale.py"
TOKENS = 48
LAYERS = 62
ROUNDS = 40


def _run(*args: str, timeout: float = 270) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_") and k != "OUT"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "reference", "--ep", "2", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_smoke_run_makes_every_measurement_and_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(
        "--tokens",
        str(TOKENS),
        "--check-tokens",
        str(TOKENS - 8),
        "--layers",
        str(LAYERS),
        "--reuse-rounds",
        str(ROUNDS),
        "--out",
        str(out),
    )
    assert run.returncode == 0, f"{run.stdout[-8000:]}\n{run.stderr[-4000:]}"
    doc: dict[str, Any] = json.loads((out / "ep-scale.json").read_text())
    log = (out / "ep-scale.log").read_text()

    # The top of the log: the exact command, the machine, the versions.
    assert log.startswith("command: ")
    assert "--backend reference" in log.splitlines()[0]
    assert "machine (nvidia-smi -L):" in log and "versions: python" in log
    assert "moe-sidecar 0.1.0" in log
    for header in ("== 0.", "== 1.", "== 2.", "== 3.", "== 4.", "== headline"):
        assert header in log
    assert "[FAILED]" not in log
    assert (out / "ep-scale-sidecar.log").read_text()

    assert doc["exit_status"] == 0 and not doc["skipped"]
    assert doc["checks"] and all(c["ok"] for c in doc["checks"]), doc["checks"]
    assert {c["section"] for c in doc["checks"]} == {"1", "2", "3", "4"}
    sizes = ep_scale.expected_sizes(2, TOKENS)
    assert doc["expected"]["sizes"] == sizes
    ep8 = doc["expected"]["ep8_8192"]
    # The figures: 1.13 GiB NVFP4, 1.76 GiB union, 2.88 GiB both, per GPU.
    assert [round(ep8["nvfp4"] / 2**30, 2), round(ep8["union"] / 2**30, 2)] == [1.13, 1.76]
    assert round((ep8["nvfp4"] + ep8["union"]) / 2**30, 2) == 2.88

    sections = doc["sections"]
    grow = ["build"] + ["reuse"] * (LAYERS - 2) + ["rebuild"]
    for rank in sections["1"]["first_lifetime"]:
        assert rank["model"]["actions"] == grow
        assert [b["workspace"] for b in rank["model"]["builds"]] == [sizes["nvfp4"], sizes["union"]]
        checks = [c for b in rank["model"]["builds"] for c in b["checks"]]
        assert [c["format"] for c in checks] == ["NVFP4", "NVFP4", "BF16"]
        assert all(c["exact"] and c["received_tokens"] > 0 for c in checks)
    for rank in sections["1"]["restarted"]:
        assert rank["model"]["actions"] == ["build"] + ["reuse"] * (LAYERS - 1)
        assert rank["model"]["workspace"] == sizes["union"]
    assert sections["1"]["sidecar_group"]["lifetimes"] == 2

    memory = sections["2"]
    for vllm, ours in zip(memory["vllm-0.33"], memory["moe-sidecar"], strict=True):
        assert ours["after_growth"]["held"] == sizes["union"]
        assert vllm["after_growth"]["held"] == sizes["nvfp4"] + sizes["union"]
        assert ours["after_destroy"]["held"] == 0

    reuse = sections["3"]
    for key in ("bare_round", "sidecar_round", "embedded_round"):
        assert reuse[key]["n"] == ROUNDS and 0 < reuse[key]["p50"] <= reuse[key]["p99"]
    assert set(reuse["whole_model_init_s"]) == {"sidecar", "embedded", "none"}
    for rank in sections["1"]["first_lifetime"]:
        # Timed alike: every mode builds once and rebuilds once.
        assert {m: rank["init"][m]["builds"] for m in rank["init"]} == dict.fromkeys(
            ("none", "embedded", "sidecar"), 2
        )

    cold = sections["4"]
    remembered = cold["prewarmed + a sidecar that remembers the plan"]["summary"]
    assert remembered["builds"] == 1 and remembered["workspace"] == sizes["union"]
    embedded = cold["prewarmed, embedded (no sidecar)"]["summary"]
    assert embedded["builds"] == 2
    for case in (remembered, embedded):
        assert 0 < case["process_start_to_ready_s"] <= case["spawn_to_ready_s"]


def test_a_budget_too_small_skips_sections_and_exits_3(tmp_path: Path) -> None:
    run = _run("--tokens", "16", "--budget", "1", "--out", str(tmp_path), timeout=120)
    assert run.returncode == ep_scale.EXIT_BUDGET, run.stdout + run.stderr
    doc = json.loads((tmp_path / "ep-scale.json").read_text())
    assert doc["skipped"] == ["1", "2", "3", "4"]
    assert "SKIPPED (time budget)" in (tmp_path / "ep-scale.log").read_text()


def test_bad_flags_are_refused_naming_them(tmp_path: Path) -> None:
    run = _run("--ep", "3", "--out", str(tmp_path), timeout=120)
    assert run.returncode == 2 and "--ep 3" in run.stderr


# --- the checks, fed made-up results ----------------------------------------------


def _memory_side(side: str, held: int, allocated: int, entries: int | None) -> dict[str, Any]:
    sizes = ep_scale.expected_sizes(2, 8192)
    steps = [{"workspace": sizes["nvfp4"]}, {"workspace": sizes["union"]}]
    if side == "moe-sidecar":
        steps = [{**s, "manager_workspace": s["workspace"]} for s in steps]
    exact = [
        {"format": f, "exact": True, "max_error": 0.0, "bad_rows": 0} for f in ep_scale.FORMATS
    ]
    result: dict[str, Any] = {
        "rank": 0,
        "side": side,
        "granularity": 2 << 20,
        "steps": steps,
        "after_growth": {"held": held, "allocated": allocated, "cache_entries": entries},
        "exact_after_growth": exact,
    }
    if side == "moe-sidecar":
        result["after_destroy"] = {"held": 0, "allocated": 0}
        result["unreleased"] = 0
    return result


def test_memory_checks_pass_on_the_expected_figures_and_fail_otherwise() -> None:
    sizes = ep_scale.expected_sizes(2, 8192)
    unit = 2 << 20
    union = ep_scale.aligned(sizes["union"], unit)
    both = union + ep_scale.aligned(sizes["nvfp4"], unit)
    # cudaMemGetInfo may stray by a page-table page; FlashInfer's records may not.
    vllm = _memory_side("vllm-0.33", both + unit, both, 2)
    ours = _memory_side("moe-sidecar", union, union, 1)
    assert all(c.ok for c in ep_scale.memory_checks([vllm], [ours], sizes))

    # A manager that kept the superseded workspace holds what vLLM's sequence holds.
    leaky = _memory_side("moe-sidecar", both, both, 2)
    failed = {c.name for c in ep_scale.memory_checks([vllm], [leaky], sizes) if not c.ok}
    assert failed == {
        "GPU 0: moe-sidecar holds the union only (cudaMemGetInfo)",
        "GPU 0: moe-sidecar's FlashInfer allocations are the union only",
        "GPU 0: workspace cache entries (moe-sidecar, vLLM)",
    }


def test_regression_checks_fail_on_a_second_rebuild_and_an_inexact_step() -> None:
    sizes = ep_scale.expected_sizes(2, 64)
    trip = {"format": "NVFP4", "exact": True, "max_error": 0.0, "bad_rows": 0, "rows": 128}
    build = {"layer": 0, "workspace": sizes["nvfp4"], "flashinfer_workspace": sizes["nvfp4"]}
    rebuild = {"layer": 3, "workspace": sizes["union"], "flashinfer_workspace": sizes["union"]}
    good = {
        "model": {
            "actions": ["build", "reuse", "reuse", "rebuild"],
            "builds": [{**build, "checks": [trip]}, {**rebuild, "checks": [trip]}],
        }
    }
    group = {"workspace_bytes": sizes["union"], "lifetimes": 2}
    assert all(c.ok for c in ep_scale.regression_checks([good], [], sizes, 4, group))
    bad = {
        "model": {
            "actions": ["build", "rebuild", "reuse", "rebuild"],
            "builds": [{**build, "checks": [{**trip, "exact": False, "max_error": 2.0}]}],
        }
    }
    failed = [c for c in ep_scale.regression_checks([bad], [], sizes, 4, group) if not c.ok]
    assert len(failed) == 3 and "max_error 2.0" in failed[-1].detail


def test_exit_status() -> None:
    ok, bad = ep_scale.Check("1", "a", True), ep_scale.Check("1", "b", False)
    assert ep_scale.exit_status([ok], []) == 0
    assert ep_scale.exit_status([ok, bad], ["4"]) == ep_scale.EXIT_FAILED
    assert ep_scale.exit_status([ok], ["4"]) == ep_scale.EXIT_BUDGET
    assert ep_scale.exit_status([], []) == ep_scale.EXIT_FAILED
