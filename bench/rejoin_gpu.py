"""A replacement rank rejoins on FlashInfer's all-to-all, through the manager
and a real sidecar, every combine checked exactly.

``--ranks`` rank processes (4: every rank on the one GPU, rank r on
``cuda:r % count``; a gloo group for the CPU side) each make an
``AlltoAllManager`` under ``MOE_SIDECAR_ON_PEER_LOSS=mask`` against a real
sidecar (``python -m moe_sidecar serve`` on a Unix socket) and initialize one
layer at DeepSeek-V3's shape (hidden 7168, bf16, top_k 8, 256 experts) on the
installed FlashInfer release's backend (``MoeAlltoAll`` for 0.7.2.post1,
stepped through ``manager.moe_alltoall``; 0.7.4's ``NVLinkOneSidedAlltoAll``,
stepped through ``manager.get_communication()``). The caller never passes a
mask: what the manager hands out passes the adopted view's. Then:

1. every rank steps ``UNMASKED_STEPS`` times;
2. the driver SIGKILLs the last rank; once their watchers heard it, the
   survivors adopt the sidecar's view without it and step ``--steps`` times
   masked (the dead rank's experts' share dropped);
3. a replacement process for that rank starts on a fresh rendezvous; the
   survivors re-form their gloo group with it there and call
   ``manager.rejoin()`` while it calls ``join_as_replacement()``: every rank
   rebuilds once at the stored plan under the next generation, and the join
   view (every rank) commits;
4. every rank steps ``--steps`` times with every rank's experts again.

Each rank computes locally what its combine must return
(``bench/masked_routing.py``, the CPU test's arithmetic) and reports the
largest difference (0.0: exact), and its manager's counters before and
after the join; the driver reads the sidecar's view of the group
(``GetGroup``) at the end.

0.7.4's ``moe_ep`` classes refuse a single GPU in their platform vote; with
one GPU visible every rank stands in for it (``bench/alltoall_steps.py``)
and says so (``vote_stood_in_for``). Functional only: no bandwidth or
latency figure comes from ranks sharing a GPU.

    python3 bench/rejoin_gpu.py --out DIR                  # the installed FlashInfer
    python3 bench/rejoin_gpu.py --backend reference --hidden 64 --tokens 16   # on CPU

Prints one JSON line per rank and the summary lines; writes every step's
figures to ``DIR/rejoin.json``; exits 1 on any inexact step, a rank that
failed or hung (each has a ``--watchdog``), a join that did not rebuild
every rank exactly once, or a sidecar view other than the join's.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import alltoall_steps as stepping
from bench import masked_routing as routing
from bench.masked_routing import Shape
from bench.rank_processes import RankProcesses, say
from bench.sidecar_process import unix_socket_sidecar

EVENT = "REJOIN "
"""The prefix of a rank's stdout lines the driver reads (FlashInfer prints too)."""
UNMASKED_STEPS = 2
FAULT_WAIT_S = 30.0
"""How long a survivor waits for its watcher to hear the death before adopting."""
LAYER = "model.layers.0.mlp"
VIEW_COMMITTED = 2
"""``VIEW_STATE_COMMITTED`` on the wire."""


def _say(event: str, **fields: Any) -> None:
    say(EVENT, event, at=time.monotonic(), **fields)


def _cpu_group(rank: int, world: int, init_method: str, timeout_s: float) -> Any:
    """A gloo group of every rank on ``init_method`` (the default group too)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.new_group(backend="gloo")


def _need(shape: Shape, world: int) -> Any:
    from moe_sidecar.client.layer_need import LayerNeed, Layout
    from moe_sidecar.client.sizing import layer_capacities

    hidden = shape.hidden
    capacities = layer_capacities(
        world, shape.tokens, shape.top_k, shape.num_experts, hidden, 2 * hidden, 0
    )
    return LayerNeed(capacities, Layout(hidden, None, None, 2 * hidden, 0), LAYER)


def _counters(manager: Any) -> dict[str, int]:
    c = manager.counters
    return {"builds": c.builds, "rebuilds": c.rebuilds, "releases": c.releases}


class Rank:
    """One rank's manager and how it steps it."""

    def __init__(self, manager: Any, stepper: stepping.Stepper) -> None:
        self.manager = manager
        self.stepper = stepper
        """Where and what it steps; ``stepped`` is fetched again at every step."""

    def step(self, seed: int, masked: set[int]) -> dict[str, Any]:
        """One checked step through what the manager hands out, passing no
        mask (the manager passes its view's); ``mask`` is the manager's."""
        manager = self.manager
        # Fetched at every step: a rebuild makes a new object.
        stepped = manager.get_communication() if self.stepper.moe_ep else manager.moe_alltoall
        stepper = dataclasses.replace(self.stepper, stepped=stepped)
        return {
            **stepping.checked_step(stepper, seed, masked, name_mask=False),
            "mask": manager.active_mask(),
        }


def _await_peer_fault(manager: Any, timeout_s: float) -> None:
    """Waits (at most ``timeout_s`` s) until the watcher heard the death:
    adopting before the sidecar proposed the view without the dead rank
    would adopt the view it is still in."""
    deadline = time.monotonic() + timeout_s
    while not manager.peer_fault() and time.monotonic() < deadline:
        time.sleep(0.01)


def _view_event(event: str, rank: Rank, adopt: Any, started: float) -> None:
    """Runs ``adopt`` (an adoption or a join); says the view, or what was raised."""
    manager = rank.manager
    try:
        view = adopt()
    except Exception as error:
        traceback.print_exc()  # the stack, in the rank's stderr file
        _say("raised", error=f"{type(error).__name__}: {error}")
        return
    _say(
        event,
        number=view.number,
        members=list(view.members),
        mask=manager.active_mask(),
        generation=manager.generation,
        counters=_counters(manager),
        seconds=time.monotonic() - started,
    )


def rank_main(argv: list[str]) -> None:
    """One rank: ``rank world init group backend watchdog hidden top_k experts
    tokens [join_init]`` (with ``join_init``: the replacement, on that rendezvous)."""
    rank, world, init, group, backend = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    watchdog = float(argv[5])
    shape = Shape(*(int(a) for a in argv[6:10]))
    joins = argv[10] if len(argv) > 10 else None
    # The watchdog: a hung rank prints where it hangs (its stderr file) and exits.
    faulthandler.dump_traceback_later(watchdog, exit=True)
    device, stood_in = stepping.device(rank, backend)
    import torch.distributed as dist

    from moe_sidecar.client.manager import AlltoAllManager
    from moe_sidecar.client.rejoin import join_as_replacement

    manager = AlltoAllManager(
        _cpu_group(rank, world, joins or init, watchdog),
        group=group,
        target=os.environ["MOE_SIDECAR_TARGET"],
        backend=stepping.client_backend(backend),
        local_ranks=world,
    )
    moe_ep = stepping.is_moe_ep(backend)
    me = Rank(manager, stepping.Stepper(None, moe_ep, device, shape, rank, world))
    about = {"backend": manager.backend.name, "vote_stood_in_for": stood_in}
    started = time.monotonic()
    if joins is not None:
        _view_event(
            "joined", me, lambda: join_as_replacement(manager, _need(shape, world)), started
        )
    else:
        manager.initialize_layer(_need(shape, world))
        _say("ready", generation=manager.generation, counters=_counters(manager), **about)
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "steps":
            first, count = int(rest[0]), int(rest[1])
            masked = {int(r) for r in rest[2].split(",")} if len(rest) > 2 else set()
            steps = [me.step(seed, masked) for seed in range(first, first + count)]
            _say("stepped", steps=steps)
        elif command == "adopt":
            at = time.monotonic()
            _await_peer_fault(manager, FAULT_WAIT_S)
            _view_event("adopted", me, lambda: manager.adopt_view(timeout_s=60.0), at)
        elif command == "rejoin":
            at = time.monotonic()
            dist.destroy_process_group()  # the group with the dead rank
            cpu_group = _cpu_group(rank, world, rest[0], watchdog)
            _view_event(
                "joined", me, lambda group=cpu_group: manager.rejoin(group, timeout_s=120.0), at
            )
        elif command == "cleanup":
            manager.cleanup()
            _say("cleaned", counters=_counters(manager))
            break
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: a peer of the first group is gone


class Driver(RankProcesses):
    """The rank processes of one run, what they said, and what failed."""

    def __init__(self, args: argparse.Namespace, backend: str, target: str, group: str) -> None:
        super().__init__(args.out, EVENT)
        self.args, self.backend, self.target, self.group = args, backend, target, group
        self.failures: list[str] = []

    def start_rank(self, rank: int, init: str, joins: str | None = None) -> None:
        """Starts rank ``rank`` on the rendezvous ``init`` (with ``joins``:
        the replacement, joining on that rendezvous)."""
        args = self.args
        shape = [args.hidden, args.top_k, args.experts, args.tokens]
        command = [sys.executable, __file__, "rank", str(rank), str(args.ranks), init, self.group]
        command += [self.backend, str(args.watchdog), *map(str, shape)] + ([joins] if joins else [])
        env = {**os.environ, "MOE_SIDECAR_TARGET": self.target, "MOE_SIDECAR_ON_PEER_LOSS": "mask"}
        self.start(rank, command, f"rank{rank}" + ("-replacement" if joins else ""), env)

    def expect(self, ranks: list[int], event: str, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Each rank's ``event`` (consumed), once every rank said it; a rank
        that raised, exited or ran past ``timeout_s`` is recorded as a failure
        and left out. After a failure nothing is awaited: the run stops there."""
        if self.failures:
            return {}

        def settled(rank: int) -> bool:
            said = self.events[rank]
            return event in said or "raised" in said or self.ended(rank)

        self.wait_for(lambda: all(settled(r) for r in ranks), timeout_s)
        with self.changed:
            said = {r: self.events[r].pop(event) for r in ranks if event in self.events[r]}
        for rank in ranks:
            if rank not in said:
                raised = self.events[rank].get("raised")
                why = (
                    f"raised {raised['error']}"
                    if raised
                    else f"status {self.processes[rank].poll()}"
                )
                self.failures.append(f"rank {rank} gave no {event!r} event ({why})")
        return said

    def kill(self, rank: int) -> int:
        os.kill(self.processes[rank].pid, signal.SIGKILL)
        return self.processes[rank].wait(timeout=30)

    def finish(self) -> dict[int, int | None]:
        """Each rank's exit status (None: killed at the end); after a failure
        the ranks still running are killed first."""
        statuses: dict[int, int | None] = {}
        for process in self.processes.values():
            if self.failures and process.poll() is None:
                process.kill()
        for rank, process in self.processes.items():
            try:
                statuses[rank] = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                statuses[rank] = None
        return statuses


def _exact(steps: list[dict[str, Any]], mask: int, dropped: bool) -> int:
    """How many of ``steps`` were exact under ``mask`` (and dropped a share when ``dropped``)."""
    return sum(
        s["combine_error"] == 0.0 and s["mask"] == mask and (s["dropped_share"] > 0) == dropped
        for s in steps
    )


def run(args: argparse.Namespace, backend: str) -> tuple[dict[str, Any], list[str]]:
    """The whole flow; its record and the failures seen.

    Raises:
        SystemExit: the sidecar did not start.
    """
    directory = Path(tempfile.mkdtemp(prefix="rejoin-"))
    every, leaver = list(range(args.ranks)), args.ranks - 1
    survivors = every[:leaver]
    everyone_mask = (1 << args.ranks) - 1
    survivors_mask = everyone_mask & ~(1 << leaver)
    group = f"rejoin:bf16/tp1-ep{args.ranks}/pp0"
    record: dict[str, Any] = {"backend": backend, "ranks": args.ranks}
    with unix_socket_sidecar(directory) as (_, target):
        driver = Driver(args, backend, target, group)
        for rank in every:
            driver.start_rank(rank, f"file://{directory / 'rendezvous'}")
        record["ready"] = driver.expect(every, "ready", args.watchdog)
        first = 1
        driver.send(every, f"steps {first} {UNMASKED_STEPS}")
        record["unmasked"] = driver.expect(every, "stepped", args.watchdog)
        first += UNMASKED_STEPS

        record["leaver_status"] = driver.kill(leaver)
        driver.send(survivors, "adopt")
        record["adopted"] = driver.expect(survivors, "adopted", 120)
        driver.send(survivors, f"steps {first} {args.steps} {leaver}")
        record["masked"] = driver.expect(survivors, "stepped", args.watchdog)
        first += args.steps

        rejoin = f"file://{directory / 'rejoin-rendezvous'}"
        driver.start_rank(leaver, rejoin, joins=rejoin)
        driver.send(survivors, f"rejoin {rejoin}")
        record["joined"] = driver.expect(every, "joined", args.watchdog)
        driver.send(every, f"steps {first} {args.steps}")
        record["after_join"] = driver.expect(every, "stepped", args.watchdog)

        record["sidecar_view"] = _sidecar_view(target, group)
        driver.send(every, "cleanup")
        record["cleaned"] = driver.expect(every, "cleaned", 120)
        record["statuses"] = driver.finish()
    # The socket's directory is short-named (a socket path has a length limit); its log goes along.
    shutil.copy(directory / "sidecar.log", args.out / "sidecar.log")
    record["masks"] = {"everyone": everyone_mask, "survivors": survivors_mask}
    return record, driver.failures


def _sidecar_view(target: str, group: str) -> dict[str, Any]:
    """The group's view as the sidecar shows it (``GetGroup``)."""
    import grpc

    from moe_workspace.v1 import coordinator_pb2 as pb
    from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        shown = pb_grpc.WorkspaceCoordinatorStub(channel).GetGroup(
            pb.GetGroupRequest(group=group), timeout=10.0
        )
    view = shown.view
    return {
        "number": view.number,
        "members": list(view.members),
        "generation": view.generation,
        "state": view.state,
        "cause": view.cause,
    }


def summarize(args: argparse.Namespace, record: dict[str, Any], failures: list[str]) -> bool:
    """Prints one JSON line per rank and the summary lines; whether it all held."""
    every, leaver = list(range(args.ranks)), args.ranks - 1
    survivors = every[:leaver]
    masks = record["masks"]
    ready = record["ready"]
    generation = max((r["generation"] for r in ready.values()), default=-1)
    joined = record["joined"]
    checks: dict[str, bool] = {}
    unmasked = [
        _exact(record["unmasked"].get(r, {}).get("steps", []), masks["everyone"], False)
        for r in every
    ]
    masked = [
        _exact(record["masked"].get(r, {}).get("steps", []), masks["survivors"], True)
        for r in survivors
    ]
    after = [
        _exact(record["after_join"].get(r, {}).get("steps", []), masks["everyone"], False)
        for r in every
    ]
    for rank in every:
        line = {
            "rank": rank,
            "ready": ready.get(rank),
            "joined": joined.get(rank),
            "status": record["statuses"].get(rank),
            "unmasked_exact": unmasked[rank],
            "masked_exact": masked[rank] if rank in survivors else None,
            "after_join_exact": after[rank],
        }
        print(json.dumps(line))
    checks["unmasked"] = min(unmasked) == UNMASKED_STEPS
    adopted = record["adopted"]
    checks["view 2"] = len(adopted) == len(survivors) and all(
        v["members"] == survivors and v["mask"] == masks["survivors"] for v in adopted.values()
    )
    checks["masked"] = min(masked) == args.steps
    # Each survivor rebuilt once and freed its old workspace once; the
    # replacement built once (the join's REBUILD): all at the next generation.
    once = len(joined) == args.ranks and all(
        j["generation"] == generation + 1
        and j["members"] == every
        and j["mask"] == masks["everyone"]
        and j["counters"]["rebuilds"] - (ready[r]["counters"]["rebuilds"] if r in survivors else 0)
        == 1
        and j["counters"]["builds"] == (1 if r in survivors else 0)
        for r, j in joined.items()
    )
    checks["rebuilt once"] = once
    checks["after join"] = min(after) == args.steps
    view = record["sidecar_view"]
    checks["sidecar view"] = (
        view["members"] == every
        and view["state"] == VIEW_COMMITTED
        and view["generation"] == generation + 1
        and f"rank {leaver} rejoined" in view["cause"]
    )
    checks["clean exits"] = (
        all(record["statuses"].get(r) == 0 for r in every)
        and record["leaver_status"] == -signal.SIGKILL
    )
    survivor_s = [j["seconds"] for r, j in joined.items() if r in survivors]
    newcomer_s = joined[leaver]["seconds"] if leaver in joined else float("nan")
    print(f"unmasked steps: {min(unmasked)} of {UNMASKED_STEPS} exact on ranks {every}")
    print(
        f"masked steps (view 2, rank {leaver} SIGKILLed): {min(masked)} of {args.steps} exact on ranks {survivors}"
    )
    print(
        f"join: view {view['number']} members {view['members']} state {view['state']} generation "
        f"{view['generation']} (was {generation}); every rank rebuilt once: {once}; "
        f"the survivors' rejoin() took up to {max(survivor_s, default=float('nan')):.2f} s "
        f"(the replacement's start included), its join_as_replacement() {newcomer_s:.2f} s"
    )
    print(f"steps after the join: {min(after)} of {args.steps} exact on ranks {every}")
    for failure in failures:
        print(f"failure: {failure}")
    failed = [name for name, ok in checks.items() if not ok]
    print(
        f"rejoin on {record['backend']}: {'passed' if not failed and not failures else 'FAILED ' + str(failed)}"
    )
    return not failed and not failures


def main(argv: list[str]) -> int:
    if argv and argv[0] == "rank":
        rank_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--ranks", type=int, default=4, help="EP ranks; the last one is replaced (default 4)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="masked steps, and steps after the join (default 20)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where logs and rejoin.json go")
    parser.add_argument("--backend", choices=stepping.BACKENDS, default="auto")
    parser.add_argument(
        "--watchdog", type=float, default=300.0, help="seconds a rank may take in all"
    )
    routing.add_shape_arguments(parser)
    args = parser.parse_args(argv)
    shape = routing.shape_from(parser, args)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="rejoin-"))
    args.out.mkdir(parents=True, exist_ok=True)
    backend = stepping.resolve(args.backend)
    record, failures = run(args, backend)
    record["shape"] = asdict(shape)
    record["failures"] = failures
    (args.out / "rejoin.json").write_text(json.dumps(record, indent=2))
    return 0 if summarize(args, record, failures) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
