"""``moe-sidecar simulate``, run as a user runs it: the console script in a
subprocess, its rank processes spawned for real, against a real sidecar
process or in embedded mode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.client.simulate import MODELS
from moe_sidecar.client.sizing import layer_capacities
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes
from tests.etcd_server import EtcdServer
from tests.multiprocess.harness import Sidecar

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

RANKS = 2
TOKENS = 16
DEEPSEEK = MODELS["deepseek-v3"]
MTP_LAYER = "model.layers.61.mlp"


def _command() -> list[str]:
    script = shutil.which("moe-sidecar", path=str(Path(sys.executable).parent))
    assert script is not None, "the moe-sidecar console script is not installed in this venv"
    return [script]


def simulate(*args: str, target: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    if target is not None:
        env["MOE_SIDECAR_TARGET"] = target
    return subprocess.run(
        [*_command(), "simulate", "--ranks", str(RANKS), "--max-tokens", str(TOKENS), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def _needs(layer_quant: str, ranks: int = RANKS) -> int:
    layer = next(layer for layer in DEEPSEEK.layers if layer.quant == layer_quant)
    capacities = layer_capacities(
        ranks,
        TOKENS,
        layer.top_k,
        layer.num_experts,
        layer.hidden_size,
        layer.x_bytes_per_token,
        layer.x_sf_bytes_per_token,
    )
    return capacities_workspace_bytes(capacities, ranks)


def _json(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, f"simulate failed:\n{run.stdout}\n{run.stderr}"
    document: dict[str, Any] = json.loads(run.stdout)
    return document


def test_simulate_twice_against_a_sidecar_second_run_builds_once(sidecar: Sidecar) -> None:
    nvfp4, union = _needs("nvfp4"), _needs("bf16")
    assert nvfp4 < union, "the bf16 MTP layer must need more than the NVFP4 layers"
    group = f"simulate:deepseek-v3/ep{RANKS}/pp0"

    # The target comes from MOE_SIDECAR_TARGET, as in an inference container.
    first = _json(simulate("--json", target=sidecar.target))
    assert first["ok"] and first["group"] == group
    assert len(first["rounds"]) == len(DEEPSEEK.layers) == 59
    assert (first["builds"], first["rebuilds"]) == (1, 1)
    grown = [(r["round"], r["layer"], r["workspace_bytes"]) for r in first["rounds"]]
    assert grown[0] == (1, "model.layers.3.mlp", nvfp4)
    assert grown[-1] == (59, MTP_LAYER, union)
    assert [r["action"] for r in first["rounds"]] == ["build"] + ["reuse"] * 57 + ["rebuild"]
    assert [(r["workspace_bytes"], r["generation"]) for r in first["reports"]] == [(union, 2)] * 2
    assert all(r["checked_layers"] for r in first["reports"])
    assert [(h["plan"]["generation"], h["layer"]) for h in first["sidecar_history"]] == [
        (1, "model.layers.3.mlp"),
        (2, MTP_LAYER),
    ]

    # The inference server restarts: the sidecar remembers the union, one build.
    second_run = simulate("--target", sidecar.target)
    assert second_run.returncode == 0, second_run.stdout + second_run.stderr
    text = second_run.stdout
    assert "rounds: 59   builds: 1   rebuilds: 0   reuses: 58" in text
    assert "round  1/59  model.layers.3.mlp     nvfp4  BUILD    workspace" in text
    assert "round 1 model.layers.3.mlp (nvfp4): built 901.1 KiB, generation 2" in text
    assert "warm restart" in text and "(2 lifetime(s))" in text
    assert f"rank 1: 901.1 KiB ({union} B), max_num_tokens {TOKENS}, generation 2" in text
    assert text.rstrip().endswith("OK")
    stored = sidecar.get_group(group)
    assert (stored.plan.workspace_bytes, stored.plan.generation, stored.lifetimes) == (union, 2, 2)
    assert [r.committed_generation for r in stored.ranks if r.current] == [2, 2]

    # Another model under the same group name: refused, named, non-zero exit.
    refused = simulate("--model", "qwen3-30b-a3b", "--group", group, "--target", sidecar.target)
    assert refused.returncode == 1
    assert "FAILED: rank 0: PreconditionFailed: heterogeneous MoE layers" in refused.stdout
    assert "num_experts=128" in refused.stdout and "num_experts=256" in refused.stdout
    assert refused.stdout.rstrip().endswith("FAILED")


def test_simulate_embedded_reaches_the_same_plan() -> None:
    run = simulate("--json")  # no --target, no MOE_SIDECAR_TARGET: embedded mode
    result = _json(run)
    assert result["ok"] and result["target"] is None
    assert (result["builds"], result["rebuilds"]) == (1, 1)
    assert [(r["workspace_bytes"], r["generation"]) for r in result["reports"]] == [
        (_needs("bf16"), 2)
    ] * RANKS
    # Embedded: no RPC; an agreement (one all-gather) and a barrier in each of
    # the two rounds that build; the covered rounds between agree on nothing
    # (the ranks' own cores answer REUSE).
    assert [(r["rpcs"], r["collectives"]) for r in result["reports"]] == [(0, 4)] * RANKS
    assert result["sidecar_history"] == []
    assert "decided by embedded mode" in run.stderr  # progress goes to stderr with --json


def test_simulate_homogeneous_model_on_three_ranks_builds_once() -> None:
    # 128 experts over 3 ranks: an uneven expert partition in the checks.
    run = subprocess.run(
        [*_command(), "simulate", "--ranks", "3", "--model", "qwen3-30b-a3b", "--max-tokens", "8"],
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rounds: 48   builds: 1   rebuilds: 0   reuses: 47" in run.stdout
    assert run.stdout.count("REUSE") == 47


def test_simulate_reports_an_unreachable_sidecar(tmp_path: Path) -> None:
    run = simulate("--target", f"unix://{tmp_path}/absent.sock")
    assert run.returncode == 1
    assert f"FAILED: cannot reach the sidecar at unix://{tmp_path}/absent.sock" in run.stdout
    assert "UNAVAILABLE" in run.stdout


def test_simulate_flags() -> None:
    listed = subprocess.run(
        [*_command(), "simulate", "--list-models"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0
    assert [line.split(":")[0] for line in listed.stdout.splitlines()] == list(MODELS)
    unknown = simulate("--model", "gpt-5")
    assert unknown.returncode == 2
    assert "unknown --model 'gpt-5'; presets: deepseek-v3, qwen3-30b-a3b" in unknown.stderr
    too_many = simulate("--ranks", "65")
    assert too_many.returncode == 2 and "--ranks 65: must be in [1, 64]" in too_many.stderr


@pytest.mark.etcd
def test_simulate_two_nodes_on_one_etcd_second_run_builds_once(etcd_server: EtcdServer) -> None:
    # 4 ranks: 2 on node-a's sidecar, 2 on node-b's (a later --ranks wins over simulate()'s).
    two_nodes = ("--ranks", "4", "--nodes", "2", "--store", f"etcd://{etcd_server.endpoint}/sim")
    first = _json(simulate(*two_nodes, "--json"))
    assert first["ok"] and first["nodes_agree"]
    assert (first["builds"], first["rebuilds"]) == (1, 1)
    # The group spans the nodes: every round adds the cross-node all-gather,
    # and the lifetime's first round the broadcast of the group's proof (and
    # its Arrive, one more RPC).
    assert {(r["rpcs"], r["collectives"]) for r in first["reports"]} == {(62, 62)}
    assert [v["node"] for v in first["nodes"]] == ["node-a", "node-b"]
    assert {h["node"] for h in first["sidecar_history"]} == {"node-a", "node-b"}
    assert {r["workspace_bytes"] for r in first["reports"]} == {_needs("bf16", ranks=4)}
    # New sidecars with empty state dirs: the plan comes back from etcd, one build.
    second_run = simulate(*two_nodes)
    assert second_run.returncode == 0, second_run.stdout + second_run.stderr
    text = second_run.stdout
    assert "rounds: 59   builds: 1   rebuilds: 0   reuses: 58" in text
    assert "warm start from etcd" in text and "the nodes agree on the plan" in text
    assert text.rstrip().endswith("OK")


def test_simulate_nodes_needs_an_etcd_store() -> None:
    run = simulate("--nodes", "2")
    assert run.returncode == 2 and "--nodes 2 needs --store etcd://" in run.stderr


def test_simulate_one_rank_counts_in_the_singular(sidecar: Sidecar) -> None:
    # One rank against a sidecar: its only collective is the post-build barrier.
    run = subprocess.run(
        [
            *_command(),
            "simulate",
            "--ranks",
            "1",
            "--model",
            "qwen3-30b-a3b",
            "--max-tokens",
            "8",
            "--no-check",
            "--target",
            sidecar.target,
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "generation 1; 49 RPCs, 1 collective\n" in run.stdout, run.stdout
    assert "collectives" not in run.stdout
    # A group of one rank has no peer to lose: no watcher waits for a group the
    # sidecar learns of only at the rank's first proposal (5 s and a warning).
    assert "peer-loss watcher" not in run.stderr, run.stderr
