"""vLLM 0.34's ``scale_down`` recovering through moe-sidecar's masked path, timed on CPU.

Each trial is ``tests/vllm/test_scale_down.py``'s run, timed: a real sidecar
(one for the whole run), a real ``TCPStore`` (vLLM's recovery store), and
four fresh rank processes (``tests.vllm.scale_down_rank``: vLLM 0.34's plugin
loading, process groups, EPLB maps with 4 redundant experts, the reference
backend). Per trial: one exact step with every rank, then rank 3 SIGKILLed
and, on the survivors:

* **heard**: kill -> every survivor's ``query_fault()`` True (vLLM's check
  after a step, polled every 20 ms): the sidecar heard the session break and
  told the survivors' watchers;
* **scale_down**: the ``scale_down`` command sent -> vLLM 0.34's own
  ``WorkerSentinel.handle_command(FaultToleranceRequest("scale_down", ...))``
  returned on every survivor (``clean_buffers()`` adopting the view, the DP
  group re-formed over the store, ``update_mask(3)``, the expert
  redistribution);
* **first step**: the step command sent -> the first step at N-1 done on
  every survivor, exact against the full model (tokens re-routed to the
  replicas, none dropped);

and **total**: kill -> that first exact step. The times are the ranks' own
``time.monotonic()`` (one clock on one machine) and include the driver's
pipe round trips between the phases (milliseconds). The baseline of the same
run: one step with every rank before the kill (p50). Printed: p50 and p99 of
each phase over the trials, and total / baseline step.

    .venv-vllm034/bin/python bench/vllm_scale_down_recovery.py --trials 20 --out DIR

Needs vLLM 0.34 importable (``.venv-vllm034``, see docs/vllm.md). Exits 1 on
an inexact step or a trial that did not recover.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.multiprocess.harness import free_port, running_sidecar
from tests.multiprocess.test_peer_loss import STARTUP_S, Ranks

WORLD, KILLED, SURVIVORS = 4, 3, (0, 1, 2)


class _ScaleDownRanks(Ranks):
    command = (sys.executable, "-m", "tests.vllm.scale_down_rank")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _trial(index: int, target: str, store_port: int, directory: Path) -> dict[str, Any]:
    os.environ["FT_DP_PORT"] = str(free_port())
    group = f"bench-scale-down:bf16/tp1-ep4/trial{index}"
    with _ScaleDownRanks(directory / f"trial{index}", target, group, policy="mask") as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S + 120)
        sent = time.monotonic()
        ranks.send(range(WORLD), "steps 0 1")
        before = ranks.expect(range(WORLD), "stepped", 60)
        step_s = max(a["at"] for a in before.values()) - sent
        exact_before = all(s["error"] == 0.0 for a in before.values() for s in a["steps"])
        killed_at = ranks.kill(KILLED)
        ranks.send(SURVIVORS, "fault")
        heard = ranks.expect(SURVIVORS, "fault", 60)
        heard_at = max(a["at"] for a in heard.values())
        sent = time.monotonic()
        for position, rank in enumerate(SURVIVORS):
            ranks.send([rank], f"scale_down {position} {len(SURVIVORS)} {store_port} t{index}")
        scaled = ranks.expect(SURVIVORS, "scaled", 180)
        scaled_at = max(a["at"] for a in scaled.values())
        scale_down_s = scaled_at - sent
        sent = time.monotonic()
        ranks.send(SURVIVORS, "steps 1 1")
        after = ranks.expect(SURVIVORS, "stepped", 60)
        stepped_at = max(a["at"] for a in after.values())
        exact_after = all(s["error"] == 0.0 for a in after.values() for s in a["steps"])
        views = [a.get("view") for a in scaled.values()]
        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)
        ranks.exits(SURVIVORS, 30)
    return {
        "trial": index,
        "baseline_step_s": step_s,
        "heard_s": heard_at - killed_at,
        "scale_down_s": scale_down_s,
        "first_step_s": stepped_at - sent,
        "total_s": stepped_at - killed_at,
        "exact": exact_before and exact_after,
        "views": views,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from torch._C._distributed_c10d import TCPStore

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    trials: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        with running_sidecar(directory / "sidecar", round_timeout=60.0) as sidecar:
            for index in range(args.trials):
                trial = _trial(index, sidecar.target, store.port, directory)
                print(json.dumps(trial), flush=True)
                trials.append(trial)
    phases = ("baseline_step_s", "heard_s", "scale_down_s", "first_step_s", "total_s")
    summary: dict[str, Any] = {
        phase: {
            "p50": statistics.median(t[phase] for t in trials),
            "p99": _percentile([t[phase] for t in trials], 0.99),
        }
        for phase in phases
    }
    base = summary["baseline_step_s"]["p50"]
    summary["total_over_baseline_step_p50"] = summary["total_s"]["p50"] / base
    summary["trials"] = len(trials)
    summary["all_exact"] = all(t["exact"] for t in trials)
    for phase in phases:
        print(
            f"{phase:16s} p50 {summary[phase]['p50'] * 1000:9.1f} ms   "
            f"p99 {summary[phase]['p99'] * 1000:9.1f} ms"
        )
    print(
        f"kill -> first exact step at N-1: {summary['total_over_baseline_step_p50']:.1f}x "
        f"one step with every rank (p50, {len(trials)} trials, all exact: {summary['all_exact']})"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm-scale-down.json").write_text(
            json.dumps({"trials": trials, "summary": summary}, indent=2)
        )
    recovered = [[2, list(SURVIVORS)]] * len(SURVIVORS)
    ok = summary["all_exact"] and all(t["views"] == recovered for t in trials)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
