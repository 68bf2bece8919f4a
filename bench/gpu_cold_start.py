"""Cold start of the all-to-all, measured: from a fresh rank process to a first
dispatch+combine of a whole model. 2 GPUs.

Run on the two-GPU machine (README, "GPU tests", has the install line), from
the repository root::

    python3 bench/gpu_cold_start.py --out "$OUT"        # about 5 minutes
    python3 bench/gpu_cold_start.py --out "$OUT" --no-cold   # under 2 minutes

The model: DeepSeek-V3-shaped, hidden 7168, top_k 8, 256 experts, 61 NVFP4
MoE layers then a bf16 MTP layer (``--layers``), ``max_num_tokens`` 128 per
rank (``--max-tokens``), EP 2. Each case spawns 2 fresh rank processes
(``spawn``, gloo on 127.0.0.1, a watchdog, tracebacks sent to the parent;
``NCCL_NVLS_ENABLE=0``) and times, per rank, from the parent's spawn to: the
rank function's start (Python, torch, the gloo group), CUDA ready on its GPU,
FlashInfer imported, every layer's ``initialize()`` done (the all-to-all
module loaded or compiled, the builds), and a first dispatch+combine of the
NVFP4 layer and of the bf16 MTP layer on the final workspace. The cases, in
one call:

1. **cold cache**: an empty ``FLASHINFER_WORKSPACE_BASE``; the first build
   JIT-compiles ``mnnvl_moe_alltoall`` (one rank compiles, the other waits
   on FlashInfer's build lock). ``--no-cold`` skips it.
2. **prewarmed cache**: a cache made by ``moe-sidecar prewarm`` (run as a
   user runs it, ``CUDA_VISIBLE_DEVICES=``, this GPU's target), embedded
   mode: a build at layer 0, a rebuild at the MTP layer.
3. **prewarmed cache + a sidecar that remembers the plan**: a real sidecar
   process; a first run teaches it the model (reported as the teaching run),
   then a fresh run builds once, at the union, in round 1.
4. **vLLM's own order of events** (reference), prewarmed cache: the backend
   alone, a build at layer 0's size and another at the MTP layer's, the first
   never freed (vLLM keeps it; so does FlashInfer's workspace cache).

Every rank process hides the ahead-of-time module the GPU machine's install
line copies into ``flashinfer/data/aot`` (``tests.gpu.workers.use_jit_cache_only``),
and prewarm runs with ``--ignore-aot``: every case exercises FlashInfer's JIT
cache, as an install from PyPI would. By default the prewarm build runs while
the cold case runs (separate caches, other CPU cores), so the call fits in a
10-minute command; ``--serial`` runs it first.

Writes ``cold-start.json`` (every timestamp, per rank, per case) and
``cold-start.log`` (everything printed, the ranks' logs included: the
client's JIT-cache report lines) to ``--out``.
"""

from __future__ import annotations

import time

PROCESS_T0 = time.time()  # in a spawned rank: when this module began to load

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gpu import workers  # noqa: E402
from tests.gpu.workers import world  # noqa: E402
from tests.multiprocess.harness import run_ranks, running_sidecar  # noqa: E402

HIDDEN = 7168
TOP_K = 8
NUM_EXPERTS = 256
NVFP4 = (HIDDEN // 2, HIDDEN // 16)  # x bytes, scale bytes per token
BF16 = (HIDDEN * 2, 0)
GROUP = "cold-start:deepseek-v3-fp4/ep2/pp0"


# --- rank side -----------------------------------------------------------------------------


def _layers(count: int) -> list[tuple[str, tuple[int, int]]]:
    nvfp4 = [(f"model.layers.{i}.mlp", NVFP4) for i in range(count - 1)]
    return [*nvfp4, (f"model.layers.{count - 1}.mlp (mtp, bf16)", BF16)]


def _round_trip(a2a: Any, payload: tuple[int, int], rank: int, ep_size: int, tokens: int) -> None:
    """One dispatch + combine of ``tokens`` tokens with a layer's payloads, synchronised."""
    import torch

    device = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(1000 + rank)
    experts = torch.rand(tokens, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
    experts = experts.to(torch.int32).to(device)
    weights = torch.full((tokens, TOP_K), 1.0 / TOP_K, dtype=torch.float32, device=device)
    x_bytes, sf_bytes = payload
    if sf_bytes:
        x = torch.randint(0, 256, (tokens, x_bytes), dtype=torch.uint8, device=device)
        sf = torch.randint(0, 256, (tokens, sf_bytes), dtype=torch.uint8, device=device)
        payloads = [x, sf, experts, weights]
    else:
        payloads = [torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16), experts, weights]
    received = a2a.dispatch(experts, payloads, tokens)
    assert tuple(received[0].shape[:2]) == (ep_size, tokens), received[0].shape
    expert_out = torch.ones(ep_size, tokens, HIDDEN, dtype=torch.bfloat16, device=device)
    out = a2a.combine(expert_out, tokens)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (tokens, HIDDEN), out.shape


def _rank_model(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """One rank of one case: the model's layers, then a first dispatch+combine."""
    t: dict[str, float] = {"module_start": PROCESS_T0, "fn_start": time.time()}
    logging.basicConfig(
        level=logging.INFO,
        format=f"  [{case['name']} rank {rank}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    torch.zeros(1, device=torch.device("cuda", rank)).add_(1)
    torch.cuda.synchronize()
    t["cuda_ready"] = time.time()

    workers.use_jit_cache_only()  # imports flashinfer; see the module docstring
    import flashinfer.comm.trtllm_moe_alltoall  # noqa: F401

    t["flashinfer_imported"] = time.time()

    from moe_sidecar.client import WorkspaceManager, sizing
    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.flashinfer import FlashInferBackend

    tokens = int(case["max_tokens"])
    layers = _layers(int(case["layers"]))
    out: dict[str, Any] = {"rank": rank}
    backend: Any
    if case["mode"] == "vllm":
        # vLLM's FlashInferNVLinkOneSidedManager (with the growth fix): a new
        # MoeAlltoAll whenever a layer needs more, the old one kept.
        backend = FlashInferBackend(world())
        held: list[Any] = []
        built_bytes = 0
        for _, (x_bytes, sf_bytes) in layers:
            need = sizing.layer_capacities(
                world_size, tokens, TOP_K, NUM_EXPERTS, HIDDEN, x_bytes, sf_bytes
            )
            need_bytes = backend.workspace_bytes(need, world_size)
            if need_bytes > built_bytes:
                held.append(backend.build(BuildSpec(world_size, rank, need, need_bytes)))
                built_bytes = need_bytes
        a2a = held[-1]
        out.update(builds=len(held), rebuilds=0, releases=0, workspace_bytes=built_bytes)
    else:
        manager = WorkspaceManager(
            world(),
            group=case["group"],
            target=case.get("target"),
            backend="flashinfer",
            local_ranks=world_size if case.get("target") else None,
        )
        for label, (x_bytes, sf_bytes) in layers:
            manager.initialize(tokens, TOP_K, NUM_EXPERTS, HIDDEN, x_bytes, sf_bytes, layer=label)
        counters = manager.counters
        a2a = manager.moe_alltoall
        backend = manager.backend
        out.update(
            builds=counters.builds + counters.rebuilds,
            rebuilds=counters.rebuilds,
            releases=counters.releases,
            rpcs=counters.rpcs,
            collectives=counters.collectives,
            workspace_bytes=manager.workspace_size,
        )
    t["layers_done"] = time.time()
    _round_trip(a2a, NVFP4, rank, world_size, tokens)
    t["first_nvfp4_done"] = time.time()
    _round_trip(a2a, BF16, rank, world_size, tokens)
    t["ready"] = time.time()

    load = getattr(backend, "module_load", None)
    out["module"] = (
        {
            "seconds": load.seconds,
            "compiled": load.compiled,
            "source": load.report.source if load.report else None,
            "library": str(load.report.library) if load.report else None,
            "jit_dir": str(load.report.jit_dir) if load.report else None,
        }
        if load is not None
        else None
    )
    out["first_build_s"] = getattr(backend, "first_build_seconds", None)
    out["t"] = t
    dist.barrier()
    if case["mode"] != "vllm":
        manager.cleanup()
        dist.barrier()
    return out


# --- parent side ---------------------------------------------------------------------------


class _FdTee:
    """Copies everything written to fd 1 and 2, this process's and its
    children's (the ranks, the sidecar, prewarm), to the terminal and a log."""

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = os.dup(1), os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while chunk := os.read(self._read, 65536):
            os.write(self._saved[0], chunk)
            self._log.write(chunk)
            self._log.flush()

    def close(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        self._thread.join(timeout=10)  # EOF once every child holding the pipe is gone
        os.close(self._read)
        self._log.close()


def _prewarm_command(arch: str, base: Path) -> list[str]:
    # `moe-sidecar prewarm` through the interpreter: the GPU machine installs
    # with --target, so the console script is not on PATH. Imported here, not
    # at the top: the spawned ranks re-import this module.
    from moe_sidecar import cli

    return [
        sys.executable,
        "-c",
        f"import sys; from {cli.__name__} import main; sys.exit(main())",
        "prewarm",
        "--arch",
        arch,
        "--workspace-base",
        str(base),
        "--ignore-aot",
        "--timeout",
        "500",
        "--json",
    ]


def _start_prewarm(arch: str, base: Path, json_out: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_CUDA_ARCH_LIST"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    with open(json_out, "wb") as out:
        return subprocess.Popen(_prewarm_command(arch, base), cwd=ROOT, env=env, stdout=out)


def _finish_prewarm(
    process: subprocess.Popen[bytes], json_out: Path, started: float
) -> dict[str, Any]:
    code = process.wait(timeout=560)
    wall = time.monotonic() - started
    try:
        document: dict[str, Any] = json.loads(json_out.read_text())
    except json.JSONDecodeError:
        raise SystemExit(
            f"moe-sidecar prewarm exited {code} without its JSON:\n{json_out.read_text()}"
        ) from None
    document["wall_s"] = wall
    if code != 0 or not document.get("ok"):
        raise SystemExit(f"moe-sidecar prewarm failed ({code}): {document.get('error')}")
    print(
        f"prewarm: {[(t['label'], t['outcome'], round(t['seconds'], 1)) for t in document['targets']]}"
    )
    return document


def _run_case(
    name: str, case: dict[str, Any], base: Path, tmp: Path, timeout: float
) -> dict[str, Any]:
    case = {**case, "name": name}
    env = {"FLASHINFER_WORKSPACE_BASE": str(base), "NCCL_NVLS_ENABLE": "0"}
    print(f"\n== {name} (FLASHINFER_WORKSPACE_BASE={base})", flush=True)
    spawned = time.time()
    try:
        ranks = run_ranks(
            _rank_model,
            2,
            timeout=timeout,
            tmp_path=tmp / name.replace(" ", "-"),
            args=(case,),
            envs=[env, env],
        )
    except AssertionError as error:
        print(f"   FAILED: {error}", flush=True)
        return {"case": case, "spawned": spawned, "error": str(error)}
    summary = _summarise(spawned, ranks)
    print(f"   {json.dumps(summary)}", flush=True)
    return {"case": case, "spawned": spawned, "ranks": ranks, "summary": summary}


def _summarise(spawned: float, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = ranks[0]
    t0 = r0["t"]
    module = r0["module"] or {}
    return {
        "spawn_to_ready_s": max(r["t"]["ready"] for r in ranks) - spawned,
        "cuda_ready_to_ready_s": max(r["t"]["ready"] - r["t"]["cuda_ready"] for r in ranks),
        "spawn_to_fn_s": t0["fn_start"] - spawned,
        "cuda_init_s": t0["cuda_ready"] - t0["fn_start"],
        "flashinfer_import_s": t0["flashinfer_imported"] - t0["cuda_ready"],
        "layers_s": t0["layers_done"] - t0["flashinfer_imported"],
        "first_dispatch_combine_s": t0["ready"] - t0["layers_done"],
        "module_s": module.get("seconds"),
        "module_compiled": [(r["module"] or {}).get("compiled") for r in ranks],
        "module_source": module.get("source"),
        "first_build_s": r0["first_build_s"],
        "builds": r0["builds"],
        "workspace_bytes": r0["workspace_bytes"],
    }


def _table(results: dict[str, dict[str, Any]]) -> str:
    header = (
        "| case | module | builds | spawn -> ready (s) | CUDA ready -> ready (s) | "
        "Python+torch+gloo (s) | CUDA init (s) | import FlashInfer (s) | "
        "all layers' initialize() (s) | first dispatch+combine x2 (ms) | workspace/rank |"
    )
    lines = [header, "| " + " | ".join(["---"] * 11) + " |"]
    for name, result in results.items():
        s = result.get("summary")
        if s is None:
            lines.append(f"| {name} | FAILED | | | | | | | | | |")
            continue
        compiled = any(c for c in s["module_compiled"])
        module = (
            f"{'compiled' if compiled else 'loaded'} {s['module_s']:.2f} s"
            if s["module_s"] is not None
            else "(no report)"
        )
        lines.append(
            f"| {name} | {module} | {s['builds']} | {s['spawn_to_ready_s']:.2f} | "
            f"{s['cuda_ready_to_ready_s']:.2f} | {s['spawn_to_fn_s']:.2f} | "
            f"{s['cuda_init_s']:.2f} | {s['flashinfer_import_s']:.2f} | {s['layers_s']:.2f} | "
            f"{s['first_dispatch_combine_s'] * 1e3:.1f} | {s['workspace_bytes']:,} B |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _tee(out: Path) -> Iterator[None]:
    tee = _FdTee(out / "cold-start.log")
    try:
        yield
    finally:
        tee.close()


def _machine() -> dict[str, Any]:
    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    nvcc = shutil.which("nvcc")
    nvcc_version = None
    if nvcc:
        lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        nvcc_version = lines.strip().splitlines()[-1] if lines.strip() else None
    return {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "flashinfer": version("flashinfer-python"),
        "apache-tvm-ffi": version("apache-tvm-ffi"),
        "grpcio": version("grpcio"),
        "nvcc": nvcc_version,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="directory for cold-start.json and cold-start.log (default $OUT)",
    )
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache case")
    parser.add_argument(
        "--serial", action="store_true", help="run prewarm before the cold case, not beside it"
    )
    parser.add_argument("--layers", type=int, default=62, help="MoE layers, the last bf16 MTP")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_num_tokens per rank")
    args = parser.parse_args()
    if args.out is None:
        parser.error("--out DIR (or $OUT) is required")
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from moe_sidecar.client.prewarm import (
        ToolMissing,
        find_cuda_toolkit,
        find_flashinfer,
        normalize_capability,
    )

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    try:
        cuda_version = find_cuda_toolkit(os.environ).version
    except ToolMissing:
        cuda_version = None
    arch = normalize_capability(*torch.cuda.get_device_capability(0), cuda_version).label
    aot = find_flashinfer().aot_library()

    with _tee(args.out), tempfile.TemporaryDirectory(prefix="cold-start-") as tmp_name:
        tmp = Path(tmp_name)
        command = " ".join([Path(sys.executable).name, *sys.argv])
        machine = _machine()
        print(f"command: {command}")
        print(f"machine: {json.dumps(machine)}")
        print(
            f"model: {args.layers} MoE layers ({args.layers - 1} NVFP4 + 1 bf16 MTP), hidden "
            f"{HIDDEN}, top_k {TOP_K}, {NUM_EXPERTS} experts, max_num_tokens {args.max_tokens}, "
            f"EP 2; target {arch}"
        )
        print(
            f"ahead-of-time module {aot}: "
            + ("present, hidden in every rank process" if aot.exists() else "absent")
        )
        common = {"layers": args.layers, "max_tokens": args.max_tokens}
        warm = tmp / "warm"
        prewarm_json = tmp / "prewarm.json"
        results: dict[str, dict[str, Any]] = {}

        prewarm_started = time.monotonic()
        prewarm = None
        if args.serial or args.no_cold:
            print(f"\n== prewarm: {' '.join(_prewarm_command(arch, warm)[3:])}", flush=True)
            prewarm_doc = _finish_prewarm(
                _start_prewarm(arch, warm, prewarm_json), prewarm_json, prewarm_started
            )
        else:
            print(
                f"\n== prewarm, beside the cold case: {' '.join(_prewarm_command(arch, warm)[3:])}",
                flush=True,
            )
            prewarm = _start_prewarm(arch, warm, prewarm_json)
        try:
            if not args.no_cold:
                results["cold cache"] = _run_case(
                    "cold cache",
                    {**common, "mode": "embedded", "group": f"{GROUP}/cold"},
                    tmp / "cold",
                    tmp,
                    timeout=480,
                )
        finally:
            if prewarm is not None:
                prewarm_doc = _finish_prewarm(prewarm, prewarm_json, prewarm_started)
        prewarm_doc["concurrent_with_cold_case"] = prewarm is not None

        results["prewarmed cache"] = _run_case(
            "prewarmed cache",
            {**common, "mode": "embedded", "group": f"{GROUP}/embedded"},
            warm,
            tmp,
            timeout=180,
        )
        with running_sidecar(tmp / "sidecar") as sidecar:
            case = {**common, "mode": "sidecar", "group": GROUP, "target": sidecar.target}
            results["prewarmed + sidecar, teaching run"] = _run_case(
                "prewarmed + sidecar, teaching run", case, warm, tmp, timeout=180
            )
            results["prewarmed + sidecar that remembers the plan"] = _run_case(
                "prewarmed + sidecar that remembers the plan", case, warm, tmp, timeout=180
            )
            sidecar_log = sidecar.log.read_text()
        results["vLLM order (build per growth, no freeing)"] = _run_case(
            "vLLM order (build per growth, no freeing)",
            {**common, "mode": "vllm"},
            warm,
            tmp,
            timeout=180,
        )

        table = _table(results)
        print(f"\n{table}\n")
        prewarm_target = prewarm_doc["targets"][0]
        print(
            f"prewarm (no GPU visible): {prewarm_target['outcome']} in "
            f"{prewarm_target['seconds']:.1f} s"
            + (" (beside the cold case)" if prewarm_doc["concurrent_with_cold_case"] else "")
        )
        document = {
            "command": command,
            "machine": machine,
            "arch": arch,
            "aot_present_and_hidden": aot.exists(),
            "model": {**common, "hidden": HIDDEN, "top_k": TOP_K, "num_experts": NUM_EXPERTS},
            "prewarm": prewarm_doc,
            "cases": results,
            "table": table,
            "sidecar_log": sidecar_log,
        }
        (args.out / "cold-start.json").write_text(json.dumps(document, indent=2, default=str))
        print(f"wrote {args.out / 'cold-start.json'} and {args.out / 'cold-start.log'}")
    failed = [name for name, result in results.items() if "summary" not in result]
    if failed:
        raise SystemExit(f"failed cases: {failed}")


if __name__ == "__main__":
    main()
