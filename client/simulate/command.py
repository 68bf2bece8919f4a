"""``moe-sidecar simulate``: its flags, and the run that imports torch only when it starts."""

from __future__ import annotations

import argparse
import sys

from moe_sidecar.core.defaults import ENV_TARGET, PEER_LOSS_POLICIES

__all__ = ["add_command"]


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs, and against which sidecars."""
    parser.add_argument(
        "--ranks", type=int, default=2, metavar="N", help="rank processes = EP size (default 2)"
    )
    parser.add_argument(
        "--model",
        default="deepseek-v3",
        metavar="PRESET",
        help="model preset (default deepseek-v3; --list-models prints them)",
    )
    parser.add_argument("--list-models", action="store_true", help="print the presets and exit")
    parser.add_argument(
        "--target",
        default=None,
        help=f"sidecar address (default ${ENV_TARGET}; unset, empty or 'embedded': no "
        "sidecar, the decision core runs inside the ranks)",
    )
    parser.add_argument(
        "--start-sidecar",
        action="store_true",
        help="start a throwaway sidecar for this run (its own socket and state dir, removed "
        "after): a sidecar to hand, as a death needs one to be heard",
    )
    parser.add_argument(
        "--group", default=None, help="EP group name (default simulate:<model>/ep<N>/pp0)"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="N",
        help="start N sidecars (node-a, node-b, ...) sharing plans through --store and split "
        "the ranks between them, so the EP group spans nodes (default 1: no sidecar started)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="with --nodes: the etcd the started sidecars share, "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX",
    )


def _add_death_arguments(parser: argparse.ArgumentParser) -> None:
    """A death asked for, and what the survivors do about it."""
    parser.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        metavar="R",
        help="kill rank R (SIGKILL) in the step of round --at-round, and show what each "
        "survivor did: the line its library printed, how long after the kill, and under "
        "mask the view committed and the steps run under it",
    )
    parser.add_argument(
        "--at-round",
        type=int,
        default=None,
        metavar="N",
        help="with --kill-rank: the round (1 = the first layer) whose step the kill falls in "
        "(default 2)",
    )
    parser.add_argument(
        "--on-peer-loss",
        choices=PEER_LOSS_POLICIES,
        default=None,
        help="MOE_SIDECAR_ON_PEER_LOSS in the ranks: what a survivor does when a peer dies "
        "(default: the environment's, else exit)",
    )
    parser.add_argument(
        "--loss-wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long the survivors of a death are given to act on it (default 10)",
    )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Sizes, timeouts, checks and the output's form."""
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="max_num_tokens of every layer (default 16: quick on CPU)",
    )
    parser.add_argument(
        "--propose-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a rank waits for one round (default $MOE_SIDECAR_PROPOSE_TIMEOUT, "
        "else 120); must exceed the sidecar's --round-timeout",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="stop the ranks and fail after this long (default 300)",
    )
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the dispatch+combine checks",
    )
    parser.add_argument(
        "--json", action="store_true", help="summary as JSON on stdout, progress on stderr"
    )


def _run(args: argparse.Namespace) -> int:
    """Runs the command; without torch, names the extra to install and returns 2.

    Raises:
        ModuleNotFoundError: another module than torch is missing (a broken install).
    """
    # Imported here: the demo needs torch (the client extra), serve and groups
    # must not (the sidecar image has no torch).
    try:
        from moe_sidecar.client.simulate.run import run_cli
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        print(
            "moe-sidecar simulate: needs torch, i.e. the client extra: "
            "from a checkout, python -m pip install torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/cpu && python -m pip install '.[client]' "
            "(see docs/user-guide.md)",
            file=sys.stderr,
        )
        return 2
    return run_cli(args)


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``moe-sidecar simulate`` (the ``moe_sidecar.commands`` entry point)."""
    parser = subparsers.add_parser(
        "simulate",
        help="run a model's MoE layers on N CPU ranks against a sidecar (needs the client extra)",
        description="run a model's MoE layers on N CPU ranks against a sidecar (needs the client extra)",
    )
    _add_run_arguments(parser)
    _add_death_arguments(parser)
    _add_limit_arguments(parser)
    parser.set_defaults(run=_run)
