"""Masked steps on FlashInfer's all-to-all: a rank ends between steps and the
others go on without it, every combine checked exactly.

``--ranks`` rank processes (4: every rank on the one GPU, rank r on
``cuda:r % count``; a gloo group for the CPU side) build the all-to-all of
the installed FlashInfer release (the backend the client picks:
``MoeAlltoAll`` for 0.7.2.post1, ``moe_ep``'s ``NVLinkOneSidedAlltoAll`` for
0.7.4, stepped through its own object) with ``enable_rank_mask=True``, at
DeepSeek-V3's shape (hidden 7168, bf16, top_k 8, 256 experts). They run 2
unmasked steps with every rank; the driver SIGKILLs the last rank once it
reported its second step, waits for it to be gone, then lets the others run
``--steps`` steps under the mask without it. The seeded routing
(``bench/masked_routing.py``, the arithmetic of the CPU test of masked
steps) sends tokens to every rank, the dead one included: each survivor's
combined output must equal, exactly (every value is exact in bf16), the sum
over its tokens' experts with the dead rank's experts' share dropped.

0.7.4's ``moe_ep`` classes refuse a single GPU in their platform vote
(``nvlink_platform_supported``: no NVLink peers); with one GPU visible (every
rank on it) this script stands in for that vote (``bench/alltoall_steps.py``,
shared with ``bench/peer_loss_gpu.py``), under both names 0.7.4
reads it, and says so in each rank's line (``vote_stood_in_for``).
Functional only: no bandwidth or latency figure comes from ranks sharing a GPU.

    python3 bench/masked_steps_gpu.py --ranks 4 --steps 20 --out DIR
    python3 bench/masked_steps_gpu.py --backend reference --hidden 64 --tokens 16   # on CPU

Prints one JSON line per rank and ``masked steps: N of N exact on ranks [0, 1, 2]``;
writes every step's figures to ``DIR/masked-steps.json``; exits 1 on any
mismatch, a rank that failed or hung (each has a ``--watchdog``), or a
leaver not ended by the kill.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import alltoall_steps as stepping
from bench import masked_routing as routing
from bench.masked_routing import Shape
from bench.rank_processes import RankProcesses, say

REPO = Path(__file__).resolve().parents[1]
EVENT = "MASKED-STEPS "
"""The prefix of a rank's stdout lines the driver reads (FlashInfer prints too)."""
UNMASKED_STEPS = 2


def _build(rank: int, world: int, backend_name: str, shape: Shape) -> tuple[Any, Any, Any]:
    """(backend, all-to-all, the object stepped: the all-to-all or its moe_ep object)."""
    import torch.distributed as dist

    from moe_sidecar.client.backends import BuildSpec, CommunicationSpec, backend_for
    from moe_sidecar.client.sizing import layer_capacities

    group = dist.group.WORLD
    assert group is not None
    backend = backend_for(stepping.client_backend(backend_name), group)
    hidden, top_k, experts, tokens = shape.hidden, shape.top_k, shape.num_experts, shape.tokens
    capacities = layer_capacities(world, tokens, top_k, experts, hidden, 2 * hidden, 0)
    size = backend.workspace_bytes(capacities, world)
    a2a = backend.build(BuildSpec(world, rank, capacities, size, enable_rank_mask=True))
    if not stepping.is_moe_ep(backend_name):
        return backend, a2a, a2a
    spec = CommunicationSpec(world, rank, experts, top_k, tokens, hidden, None, None, 0, False)
    return backend, a2a, backend.communication(a2a, spec)


def rank_main(argv: list[str]) -> None:
    """One rank: ``rank world init backend watchdog steps hidden top_k experts tokens``."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world, init, backend_name = int(argv[0]), int(argv[1]), argv[2], argv[3]
    watchdog, steps = float(argv[4]), int(argv[5])
    shape = Shape(*(int(a) for a in argv[6:10]))
    # The watchdog: a hung rank prints where it hangs (its stderr file) and exits.
    faulthandler.dump_traceback_later(watchdog, exit=True)
    device, stood_in = stepping.device(rank, backend_name)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=watchdog)
    )
    leaver = world - 1
    survivors = dist.new_group(list(range(leaver)), backend="gloo")  # collective: before the kill
    backend, a2a, stepped = _build(rank, world, backend_name, shape)
    stepper = stepping.Stepper(
        stepped, stepping.is_moe_ep(backend_name), device, shape, rank, world
    )
    result: dict[str, Any] = {"rank": rank, "backend": backend.name, "vote_stood_in_for": stood_in}
    result["unmasked"] = [
        stepping.checked_step(stepper, seed, set()) for seed in range(1, 1 + UNMASKED_STEPS)
    ]
    say(EVENT, "unmasked", **result)
    if rank == leaver:
        sys.stdin.readline()  # the driver kills it here; its watchdog ends it otherwise
        os._exit(3)
    sys.stdin.readline()  # "go": the leaver is gone
    first = 1 + UNMASKED_STEPS
    result["masked"] = [
        stepping.checked_step(stepper, seed, {leaver}) for seed in range(first, first + steps)
    ]
    dist.barrier(group=survivors)  # no survivor frees its workspace while a peer may read it
    backend.release(a2a)
    say(EVENT, "masked", **result)
    # No destroy_process_group: the world group has a dead member.
    os._exit(0)


def _start(args: argparse.Namespace, backend: str) -> RankProcesses:
    init = f"file://{Path(tempfile.mkdtemp(prefix='masked-steps-')) / 'rendezvous'}"
    shape = [args.hidden, args.top_k, args.experts, args.tokens]
    ranks = RankProcesses(args.out, EVENT)
    for rank in range(args.ranks):
        command = [sys.executable, __file__, "rank", str(rank), str(args.ranks), init, backend]
        ranks.start(
            rank, [*command, str(args.watchdog), str(args.steps), *map(str, shape)], f"rank{rank}"
        )
    return ranks


def run(args: argparse.Namespace, backend: str) -> dict[int, dict[str, Any]]:
    """Spawns the ranks, kills the leaver after its unmasked steps, lets the
    survivors step under the mask; every rank's outcome."""
    ranks = _start(args, backend)
    leaver = args.ranks - 1
    deadline = time.monotonic() + args.watchdog + 30
    reported = ranks.wait_for(
        lambda: "unmasked" in ranks.events[leaver] or ranks.ended(leaver), args.watchdog + 30
    )
    # Killed after it reported its unmasked steps, or (it hung) killed anyway
    # and the run fails: either way gone before the survivors step without it.
    killed = reported and not ranks.ended(leaver)
    leaving = ranks.processes[leaver]
    if leaving.poll() is None:
        os.kill(leaving.pid, signal.SIGKILL)
    leaving.wait(timeout=30)
    ranks.send(range(leaver), "go")
    outcomes: dict[int, dict[str, Any]] = {}
    for rank, process in ranks.processes.items():
        try:
            status = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait(timeout=30)
        lines = (args.out / f"rank{rank}.stderr").read_text().strip().splitlines()
        with ranks.changed:
            reports = dict(ranks.events[rank])
        outcomes[rank] = {
            "status": status,
            "killed": killed if rank == leaver else False,
            "last_line": lines[-1] if lines else "",
            **reports.get("masked", reports.get("unmasked", {})),
        }
    return outcomes


def _exact(step: dict[str, Any]) -> bool:
    return bool(step["combine_error"] == 0.0)


def summarize(args: argparse.Namespace, outcomes: dict[int, dict[str, Any]]) -> bool:
    """Prints one JSON line per rank and the summary lines; whether every step was exact."""
    leaver = args.ranks - 1
    survivors = list(range(leaver))
    for rank, outcome in outcomes.items():
        line = {"rank": rank} | {
            k: v for k, v in outcome.items() if k not in ("unmasked", "masked")
        }
        for kind in ("unmasked", "masked"):
            steps = outcome.get(kind, [])
            line[f"{kind}_exact"] = sum(map(_exact, steps))
            line[f"{kind}_steps"] = len(steps)
            line[f"{kind}_max_error"] = max((s["combine_error"] for s in steps), default=None)
        print(json.dumps(line))
    unmasked = [
        all(_exact(o["unmasked"][i]) for o in outcomes.values() if len(o.get("unmasked", [])) > i)
        and all(len(o.get("unmasked", [])) > i for o in outcomes.values())
        for i in range(UNMASKED_STEPS)
    ]
    masked = [
        all(
            len(outcomes[r].get("masked", [])) > i and _exact(outcomes[r]["masked"][i])
            for r in survivors
        )
        for i in range(args.steps)
    ]
    reached = all(s["dropped_share"] > 0 for r in survivors for s in outcomes[r].get("masked", []))
    print(f"unmasked steps: {sum(unmasked)} of {UNMASKED_STEPS} exact on ranks {list(outcomes)}")
    print(f"masked steps: {sum(masked)} of {args.steps} exact on ranks {survivors}")
    ended = outcomes[leaver]["killed"] and outcomes[leaver]["status"] == -signal.SIGKILL
    clean = all(outcomes[r]["status"] == 0 for r in survivors)
    print(
        f"rank {leaver} ended by SIGKILL: {ended}; survivors exited 0: {clean}; every masked step dropped a share: {reached}"
    )
    return all(unmasked) and all(masked) and reached and ended and clean


def main(argv: list[str]) -> int:
    if argv and argv[0] == "rank":
        rank_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--ranks", type=int, default=4, help="EP ranks; the last one leaves (default 4)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="masked steps after it left (default 20)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where logs and masked-steps.json go"
    )
    parser.add_argument("--backend", choices=stepping.BACKENDS, default="auto")
    parser.add_argument(
        "--watchdog", type=float, default=240.0, help="seconds a rank may take in all"
    )
    routing.add_shape_arguments(parser)
    args = parser.parse_args(argv)
    shape = routing.shape_from(parser, args)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="masked-steps-"))
    args.out.mkdir(parents=True, exist_ok=True)
    backend = stepping.resolve(args.backend)
    outcomes = run(args, backend)
    record = {"backend": backend, "shape": asdict(shape), "ranks": args.ranks, "outcomes": outcomes}
    (args.out / "masked-steps.json").write_text(json.dumps(record, indent=2))
    return 0 if summarize(args, outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
