"""``moe-sidecar prewarm`` for real: built with no GPU visible, loaded by a GPU process.

1. ``prewarm --arch <this GPU's target>`` with ``CUDA_VISIBLE_DEVICES=`` into
   an empty ``--workspace-base``: FlashInfer's own build of
   ``mnnvl_moe_alltoall`` (about 3 minutes on an H200 host), at the path
   FlashInfer will look in. ``--ignore-aot``: the GPU machine's install copies
   an ahead-of-time module into FlashInfer, which would make the build moot.
2. The same command again: "already built", nothing compiled, the library untouched.
3. A GPU process with ``FLASHINFER_WORKSPACE_BASE`` at that cache (and the AOT
   copy hidden, see ``workers.use_jit_cache_only``) loads the module through
   the backend's JIT-cache report (``moe_sidecar.client.backends.jit_cache``): the report
   says "found in the cache", the load does not compile (the library is not
   rewritten; FlashInfer's ninja finds it up to date), and the module answers.

The compile dominates (one per run); everything else takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_sidecar import cli
from moe_sidecar.client.backends.flashinfer import SUPPORTED_FLASHINFER
from moe_sidecar.client.prewarm import (
    ToolMissing,
    cache_paths,
    find_cuda_toolkit,
    normalize_capability,
    parse_arch,
)
from tests.dockerfile import REPO

pytestmark = [pytest.mark.gpu(gpus=1, flashinfer="0.7.2.post1"), pytest.mark.timeout(720)]

# The console script may not be on PATH (the GPU machine installs with
# --target): run the same entry point through the interpreter.
MOE_SIDECAR = [
    sys.executable,
    "-c",
    f"import sys; from {cli.__name__} import main; sys.exit(main())",
]

_GPU_PROBE = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import torch
torch.cuda.set_device(0)
from tests.gpu.workers import use_jit_cache_only
use_jit_cache_only()
import flashinfer.comm.trtllm_moe_alltoall as alltoall
from moe_sidecar.client.backends.jit_cache import prepare_module
load = prepare_module(alltoall.get_moe_alltoall_module)
module = alltoall.get_moe_alltoall_module()
names, values = module.moe_a2a_get_metainfo_index_pairs()
report = load.report
print(json.dumps({
    "source": report.source if report else None,
    "library": str(report.library) if report else None,
    "archs": list(report.archs) if report else None,
    "compiled": load.compiled,
    "seconds": load.seconds,
    "metainfo": [str(n) for n in names],
    "aux_bytes": int(module.moe_a2a_get_aux_data_size(2, 128)),
}))
"""


def _this_gpu_target() -> str:
    import torch

    try:
        cuda_version = find_cuda_toolkit(os.environ).version
    except ToolMissing:
        cuda_version = None  # only 12.x targets need it
    return normalize_capability(*torch.cuda.get_device_capability(0), cuda_version).label


def _env(**overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FLASHINFER_CUDA_ARCH_LIST", "FLASHINFER_DISABLE_JIT")
    }
    env.update(overrides)
    return env


def _prewarm(args: list[str], timeout: float) -> tuple[dict[str, Any], str]:
    run = subprocess.run(
        [*MOE_SIDECAR, "prewarm", *args, "--json"],
        cwd=REPO,
        env=_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, f"prewarm failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return json.loads(run.stdout), run.stderr


def test_prewarm_without_a_gpu_then_a_gpu_process_loads_it_without_compiling(
    tmp_path: Path,
) -> None:
    target = _this_gpu_target()
    base = tmp_path / "fi"
    expected = cache_paths(base, SUPPORTED_FLASHINFER, [parse_arch(target)]).library
    args = ["--arch", target, "--workspace-base", str(base), "--ignore-aot", "--timeout", "640"]

    first, report = _prewarm(args, timeout=680)
    [built] = first["targets"]
    assert built["outcome"] == "built", (first, report)
    assert Path(built["library"]) == expected and expected.is_file()
    assert built["library_bytes"] == expected.stat().st_size > 1_000_000
    assert first["arch_source"] == "--arch" and first["ok"] is True
    stamp = (expected.stat().st_mtime_ns, expected.stat().st_size)
    print(f"prewarm built {expected} in {built['seconds']:.1f} s\n{report}")

    second, report = _prewarm(args, timeout=120)
    [again] = second["targets"]
    assert again["outcome"] == "already-built", (second, report)
    assert second["seconds"] < 60
    assert (expected.stat().st_mtime_ns, expected.stat().st_size) == stamp

    probe = subprocess.run(
        [sys.executable, "-c", _GPU_PROBE],
        cwd=REPO,
        env=_env(FLASHINFER_WORKSPACE_BASE=str(base), NCCL_NVLS_ENABLE="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, f"GPU process failed:\n{probe.stdout}\n{probe.stderr}"
    loaded = json.loads(probe.stdout.strip().splitlines()[-1])
    print(f"GPU process: {loaded}\n{probe.stderr}")
    assert loaded["source"] == "cache", loaded
    assert Path(loaded["library"]) == expected
    assert loaded["archs"] == [target]
    assert loaded["compiled"] is False, "the GPU process compiled the module again"
    assert (expected.stat().st_mtime_ns, expected.stat().st_size) == stamp
    assert loaded["seconds"] < 60, loaded
    assert "SEND_COUNTERS_OFFSET_INDEX" in " ".join(loaded["metainfo"])
    assert loaded["aux_bytes"] > 0
    assert "found" in probe.stderr and "loaded, not compiled" in probe.stderr
