"""``moe-sidecar prewarm``: its flags, and the run, loaded only when it starts (it needs torch)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from moe_sidecar import flashinfer

__all__ = ["PREWARM_DEFAULT_ARCHS", "add_command"]

PREWARM_DEFAULT_ARCHS = "9.0a,10.0a"
"""``archs.DEFAULT_ARCHS``, spelled here so ``--help`` imports no torch."""


_MODULES = ", ".join(
    f"{release.jit_module.name} with flashinfer-python {release.name}"
    for release in flashinfer.RELEASES
)
_EXTRAS = " or ".join(f"'.[client,{release.install_extra}]'" for release in flashinfer.RELEASES)

_DESCRIPTION = (
    "Compile FlashInfer's all-to-all module (the one the client's flashinfer backend "
    f"loads: {_MODULES}) into FlashInfer's JIT cache ahead of time, "
    "with nvcc and no GPU, so an inference process finds it instead of compiling it for "
    "minutes. A module already in the cache is not built again. Needs the client and a "
    f"flashinfer extra (from a checkout: pip install {_EXTRAS}), nvcc, ninja and "
    "a C++ compiler. Exit status: 0 built or already there, 1 a build failed, 2 a bad "
    "flag or a missing prerequisite, 130 interrupted."
)
"""What ``moe-sidecar prewarm --help`` says the command does."""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.add_argument(
        "--arch",
        action="append",
        default=[],
        metavar="ARCH",
        help="CUDA architecture to build for (9.0a, 10.0a, 10.3a, 90a, sm_100a; repeat the "
        "flag or separate with commas). Each is its own build: FlashInfer keeps one cache "
        "directory per set of architectures a process sees, so join with '+' (9.0a+10.0a) "
        "only for processes that see GPUs of several kinds at once. Default: "
        "$FLASHINFER_CUDA_ARCH_LIST as FlashInfer reads it (one set), else the visible "
        f"GPUs' (one set), else {PREWARM_DEFAULT_ARCHS} (Hopper and Blackwell, one build each)",
    )
    parser.add_argument(
        "--workspace-base",
        default=None,
        metavar="DIR",
        help="FlashInfer's FLASHINFER_WORKSPACE_BASE: the module goes to "
        "DIR/.cache/flashinfer/<version>/<archs>/cached_ops/. Default: "
        "$FLASHINFER_WORKSPACE_BASE, else $HOME, as FlashInfer. The inference processes "
        "must see the same directory at the same path",
    )
    parser.add_argument(
        "--ignore-aot",
        action="store_true",
        help="build into the cache even when FlashInfer ships the module ahead of time "
        "(flashinfer/data/aot), which it would load instead",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="run FlashInfer's build for modules already in the cache too: ninja recompiles "
        "only what changed (sources, compiler, flags)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and check the tools; build nothing"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="stop a build that runs longer than this (default 1800)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show ninja's and nvcc's output while building"
    )
    parser.add_argument(
        "--json", action="store_true", help="the result as JSON on stdout, the report on stderr"
    )


def _run(args: argparse.Namespace) -> int:
    """Runs the command; without torch, names the extras to install and returns 2.

    Raises:
        ModuleNotFoundError: a module of the project is missing (a broken install).
    """
    # This process never imports torch (only the build process does, through
    # FlashInfer), so its absence is checked, not caught: a build that could
    # only fail is not started.
    if importlib.util.find_spec("torch") is None:
        message = (
            "needs torch and flashinfer-python "
            + " or ".join(release.name for release in flashinfer.RELEASES)
            + f", i.e. the client and a flashinfer extra: from a checkout, pip install {_EXTRAS}"
        )
        print(f"moe-sidecar prewarm: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "exit_status": 2, "error": message}))
        return 2
    # Imported here: building the parser loads only the flags.
    from moe_sidecar.client.prewarm.run import run_cli

    return run_cli(args)


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``moe-sidecar prewarm`` (the ``moe_sidecar.commands`` entry point)."""
    parser = subparsers.add_parser(
        "prewarm",
        help="compile FlashInfer's all-to-all module into its JIT cache ahead of time (no GPU)",
        description="compile FlashInfer's all-to-all module into its JIT cache ahead of time (no GPU)",
    )
    _add_arguments(parser)
    parser.set_defaults(run=_run)
