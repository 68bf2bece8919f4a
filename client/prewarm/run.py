"""``moe-sidecar prewarm``'s run: the plan from the flags, the builds, and the report.

Exit status of :func:`run_cli`: 0 when every target is compiled (now or
before) or shipped ahead of time; 1 when a build failed or timed out; 2 for a
bad flag or a missing prerequisite (torch, a flashinfer-python release of
:data:`moe_sidecar.flashinfer.RELEASES`, nvcc, ninja, a C++ compiler); 130
when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from moe_sidecar.client.prewarm.archs import (
    DEFAULT_ARCHS,
    ENV_ARCH_LIST,
    CudaArch,
    parse_arch_flags,
    parse_flashinfer_arch_list,
    visible_gpu_archs,
)
from moe_sidecar.client.prewarm.build_plan import ArchSource, BuildPlan, make_plan
from moe_sidecar.client.prewarm.builder import TargetResult, build_target
from moe_sidecar.client.prewarm.cache import BUILD_ENV, ENV_WORKSPACE_BASE, workspace_base
from moe_sidecar.client.prewarm.errors import BuildFailed, PrewarmError, ToolMissing
from moe_sidecar.client.prewarm.install import find_flashinfer
from moe_sidecar.client.prewarm.toolchain import (
    CudaToolkit,
    env_warnings,
    find_build_tools,
    find_cuda_toolkit,
)

__all__ = ["run_cli"]


def _targets_and_source(
    args: argparse.Namespace, env: Mapping[str, str], cuda_version: tuple[int, int] | None
) -> tuple[tuple[frozenset[CudaArch], ...], ArchSource]:
    if args.arch:
        return parse_arch_flags(args.arch, cuda_version=cuda_version), "--arch"
    if ENV_ARCH_LIST in env:
        listed = parse_flashinfer_arch_list(env[ENV_ARCH_LIST], cuda_version=cuda_version)
        return (listed,), "FLASHINFER_CUDA_ARCH_LIST"
    gpus = visible_gpu_archs(cuda_version)
    if gpus:
        return (gpus,), "visible GPUs"
    return parse_arch_flags(DEFAULT_ARCHS, cuda_version=cuda_version), "default list"


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB"


def _describe_plan(plan: BuildPlan, out: IO[str]) -> None:
    out.write(
        f"FlashInfer {plan.flashinfer_version}, module {plan.module} ({plan.jit_module.role})\n"
    )
    out.write(f"  cache: {plan.cache_dir} ")
    out.write(f"({ENV_WORKSPACE_BASE}={plan.base})\n")
    out.write(f"  targets ({plan.arch_source}): {', '.join(t.label for t in plan.targets)}\n")
    for warning in plan.warnings:
        out.write(f"  warning: {warning}\n")
    if plan.aot_library is not None:
        if all(t.status == "ahead-of-time" for t in plan.targets):
            out.write(
                f"  FlashInfer ships this module ahead of time ({plan.aot_library}) and loads it "
                "instead of the cache: nothing to build (--ignore-aot builds the cache anyway)\n"
            )
        else:
            out.write(
                f"  note: FlashInfer loads the ahead-of-time copy {plan.aot_library} instead of "
                "the cache built here (--ignore-aot)\n"
            )


def _result_line(result: TargetResult) -> str:
    paths = result.target.paths
    label = f"{result.target.label:<10}"
    if result.outcome == "built":
        return (
            f"  {label} built in {result.seconds:.1f} s "
            f"({_human_bytes(result.library_bytes)}): {paths.library}"
        )
    if result.outcome == "up-to-date":
        return f"  {label} up to date (checked in {result.seconds:.1f} s): {paths.library}"
    if result.outcome == "already-built":
        return f"  {label} already built: {paths.library}"
    if result.outcome == "ahead-of-time":
        return f"  {label} shipped ahead of time: nothing to build"
    return f"  {label} FAILED after {result.seconds:.1f} s"


def _prepare(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[BuildPlan, dict[str, str], CudaToolkit | None]:
    """The plan, the worker's extra environment and the toolkit (None if not needed).

    Raises:
        PrewarmError: a bad architecture or a missing prerequisite.
    """
    try:
        toolkit: CudaToolkit | None = find_cuda_toolkit(env)
    except ToolMissing:
        toolkit = None  # needed only if something is to be built: checked below
    cuda_version = toolkit.version if toolkit is not None else None
    # Flags first: a bad --arch is reported before a missing FlashInfer.
    targets, source = _targets_and_source(args, env, cuda_version)
    install = find_flashinfer()
    base = Path(args.workspace_base) if args.workspace_base else workspace_base(env)
    plan = make_plan(
        targets,
        base=base.absolute(),
        version=install.version,
        arch_source=source,
        aot_library=install.aot_library(),
        ignore_aot=args.ignore_aot,
        refresh=args.refresh,
        jit_module=install.jit_module,
        warnings=env_warnings(env),
        package_dir=install.package_dir,
    )
    if not plan.to_build:
        return plan, {}, None
    if toolkit is None:
        toolkit = find_cuda_toolkit(env)  # raises ToolMissing, saying why
    extra_env, tool_warnings = find_build_tools(env)
    plan = replace(plan, warnings=(*plan.warnings, *toolkit.warnings, *tool_warnings))
    return plan, extra_env, toolkit


def _build_targets(
    plan: BuildPlan, args: argparse.Namespace, env: Mapping[str, str], text: IO[str]
) -> tuple[list[TargetResult], BuildFailed | None]:
    """Builds (or, with ``--dry-run``, names) what the plan says, up to the first failure.

    Raises:
        KeyboardInterrupt: interrupted; the build running was stopped.
    """
    results: list[TargetResult] = []
    failed: BuildFailed | None = None
    for target in plan.targets:
        if target.status == "ahead-of-time":
            result = TargetResult(target=target, outcome="ahead-of-time")
        elif target.status == "already-built":
            result = TargetResult(target=target, outcome="already-built")
        elif args.dry_run:
            text.write(f"  {target.label:<10} would build into {target.paths.module_dir}\n")
            continue
        else:
            text.write(f"  {target.label:<10} building into {target.paths.module_dir}\n")
            text.flush()
            try:
                result = build_target(
                    target,
                    env=env,
                    verbose=args.verbose,
                    timeout=args.timeout,
                    progress=sys.stderr,
                    package_dir=plan.package_dir,
                )
            except BuildFailed as error:
                failed = error
                result = TargetResult(target=target, outcome="failed", error=str(error))
        results.append(result)
        text.write(_result_line(result) + "\n")
        for note in result.notes:
            text.write(f"    note: {note}\n")
        text.flush()
        if failed is not None:
            break
    return results, failed


def _summary(results: list[TargetResult]) -> str:
    counts = {o: sum(1 for r in results if r.outcome == o) for o in ("built", "up-to-date")}
    counts["already built"] = sum(1 for r in results if r.outcome == "already-built")
    return ", ".join(f"{n} {what}" for what, n in counts.items() if n) or "nothing built"


def _json_document(
    plan: BuildPlan,
    args: argparse.Namespace,
    env: Mapping[str, str],
    results: list[TargetResult],
    failed: BuildFailed | None,
    seconds: float,
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "ok": failed is None,
        "exit_status": failed.exit_status if failed is not None else 0,
        "flashinfer": plan.flashinfer_version,
        "module": plan.module,
        "workspace_base": str(plan.base),
        "cache_dir": str(plan.cache_dir),
        "arch_source": plan.arch_source,
        "aot_library": str(plan.aot_library) if plan.aot_library else None,
        "dry_run": bool(args.dry_run),
        "targets": [r.as_json() for r in results],
        "planned": [
            {"label": t.label, "status": t.status, "library": str(t.paths.library)}
            for t in plan.targets
        ],
        "warnings": list(plan.warnings),
        "build_env": {k: env[k] for k in BUILD_ENV if k in env},
        "seconds": round(seconds, 3),
    }
    if failed is not None:
        document["error"] = str(failed)
    return document


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``moe-sidecar prewarm`` with parsed ``args``; returns the exit status.

    Human-readable lines go to stdout (with ``--json``: to stderr, and one
    JSON document to stdout); the progress line goes to stderr.
    """
    env = dict(os.environ)
    text = sys.stderr if args.json else sys.stdout
    started = time.monotonic()
    try:
        plan, extra_env, toolkit = _prepare(args, env)
    except PrewarmError as error:
        print(f"moe-sidecar prewarm: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "exit_status": error.exit_status, "error": str(error)}))
        return error.exit_status
    _describe_plan(plan, text)
    if toolkit is not None and plan.to_build:
        version = ".".join(map(str, toolkit.version)) if toolkit.version else "unknown version"
        text.write(f"  compiler: {toolkit.nvcc} (CUDA {version})\n")
    text.flush()
    try:
        results, failed = _build_targets(plan, args, {**env, **extra_env}, text)
    except KeyboardInterrupt:
        print("moe-sidecar prewarm: interrupted; the build was stopped", file=sys.stderr)
        return 130
    total = time.monotonic() - started
    if failed is not None:
        print(f"moe-sidecar prewarm: {failed}", file=sys.stderr)
    else:
        text.write(f"done in {total:.1f} s: {_summary(results)}\n")
    if args.json:
        print(json.dumps(_json_document(plan, args, env, results, failed, total), indent=2))
    return failed.exit_status if failed is not None else 0
