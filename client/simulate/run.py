"""``moe-sidecar simulate``'s run: the configuration from the flags, the simulation, the summary.

Spawns one process per EP rank (gloo on 127.0.0.1), and in each runs the
model's MoE layer sequence through :class:`moe_sidecar.client.WorkspaceManager` with the
``reference`` backend, against a running sidecar (``--target``, default
``$MOE_SIDECAR_TARGET``), the sidecars it starts (``--nodes``) or, with no
target, the decision core inside the ranks (embedded mode). Run it twice
against one sidecar and the second run builds once (the warm restart); with
``--nodes`` too, although its sidecars start with empty state dirs: the plan
came back from etcd.

This module imports torch (the rank processes run the client), so
``moe-sidecar``'s command imports it only when ``simulate`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moe_sidecar.client.simulate.parent import run_simulation
from moe_sidecar.client.simulate.presets import MODELS
from moe_sidecar.client.simulate.records import SimulationConfig, resolve_target
from moe_sidecar.client.simulate.summary import format_summary, list_models

__all__ = ["run_cli"]

_DEFAULT_KILL_ROUND = 2
"""The round whose step ``--kill-rank`` kills in without ``--at-round``."""


def _kill_round(args: argparse.Namespace) -> int:
    """``--at-round``; 2 by default with ``--kill-rank``, 0 (none) without."""
    if args.at_round is not None:
        return int(args.at_round)
    return _DEFAULT_KILL_ROUND if args.kill_rank is not None else 0


def run_cli(args: argparse.Namespace) -> int:
    """The ``moe-sidecar simulate`` command, on flags parsed by ``moe_sidecar.cli``.

    Returns 0 when every rank finished and every check held, 1 on any
    failure (printed with the error), 2 for bad flags.
    """
    if args.list_models:
        sys.stdout.write(list_models())
        return 0
    model = MODELS.get(args.model)
    if model is None:
        print(
            f"moe-sidecar simulate: unknown --model {args.model!r}; presets: {', '.join(MODELS)}",
            file=sys.stderr,
        )
        return 2
    try:
        config = SimulationConfig(
            model=model,
            ranks=args.ranks,
            # The run's own sidecar: MOE_SIDECAR_TARGET is not asked (an explicit --target is refused).
            target=(args.target or None)
            if args.start_sidecar
            else resolve_target(args.target, os.environ),
            group=args.group or f"simulate:{model.name}/ep{args.ranks}/pp0",
            max_tokens=args.max_tokens,
            propose_timeout=args.propose_timeout,
            timeout=args.timeout,
            check=args.check,
            nodes=args.nodes,
            store=args.store or "",
            start_sidecar=args.start_sidecar,
            kill_rank=args.kill_rank,
            kill_round=_kill_round(args),
            on_peer_loss=args.on_peer_loss,
            loss_wait=args.loss_wait,
        )
    except ValueError as error:
        print(f"moe-sidecar simulate: {error}", file=sys.stderr)
        return 2
    progress = sys.stderr if args.json else sys.stdout
    try:
        result = run_simulation(config, progress=progress)
    except KeyboardInterrupt:
        print("moe-sidecar simulate: interrupted", file=sys.stderr)
        return 130
    ok = result.ok and result.nodes_agree
    for rank, text in sorted(result.stderr.items()):
        # What the ranks wrote on stderr (warnings, tracebacks), once the run is over.
        sys.stderr.write("".join(f"rank {rank}: {line}\n" for line in text.splitlines()))
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        if not ok:
            sys.stderr.write(format_summary(result))
    else:
        sys.stdout.write(format_summary(result))
    return 0 if ok else 1
