"""EP N on one node, the deployment shape, measured: four measurements in one run.

DeepSeek-V3's shapes (hidden 7168, top_k 8, 256 experts): ``--layers`` MoE
layers (default 62: 61 NVFP4 layers, then the bf16 MTP layer), every rank
dispatching up to ``--tokens`` tokens (default 8192), at EP ``--ep`` (default:
every visible GPU; with more ranks than GPUs, rank r runs on GPU r % count,
a functional run whose section 2 is refused), in vLLM 0.33's call style (``initialize(...,
dispatch_format=QuantFormat.NVFP4 | BF16)``, then ``get_communication()``).
One real sidecar process (``python -m moe_sidecar`` on a Unix socket) serves
the whole run; rank processes are spawned per step (``spawn``, gloo on
127.0.0.1, a watchdog per rank, tracebacks sent back; ``NCCL_NVLS_ENABLE=0``).

0. **FlashInfer's module**: ``moe-sidecar prewarm`` (no GPU visible, this
   GPU's target, the cache of ``FLASHINFER_WORKSPACE_BASE``): nothing to do
   when the module is compiled (or shipped ahead of time), else it compiles
   it (about 190 s on an H200 host).
1. **The regression through the sidecar**: the model's layers, dispatch +
   combine of ``--check-tokens`` tokens per rank (at the full ``--tokens``
   runtime maximum, so the whole workspace layout is in play) checked
   exactly after each build (``tests/exchange.py``); expected: one build
   (layer 0, the NVFP4 size), one rebuild (the MTP layer, the union). Then
   fresh rank processes (restarted ranks) against the same sidecar: one
   build, at the union, in round 1; exact for both layer kinds.
2. **Device memory after growth, per GPU**: vLLM 0.33's own sequence
   (``bench/vllm_gpu_bench.py``'s ``Vllm033Manager``: ``destroy()`` then
   ``create_communication()`` on growth, FlashInfer keeping the superseded
   workspace) against moe-sidecar's manager (through the sidecar), the same
   layers, each side in its own rank processes: ``cudaMemGetInfo`` minus
   PyTorch's reserved bytes, FlashInfer's own allocation records
   (``MnnvlMemory.allocated_map``) and workspace sizes, against the computed
   expectations (union only; union + superseded).
3. **REUSE round latency and whole-model initialisation**, in section 1's
   first rank processes: ``--reuse-rounds`` REUSE rounds through the sidecar
   (the session stream, the transport's default), the same in embedded mode,
   and the bare decision (``policy.propose`` for the N ranks of a round, in
   process); p50/p99. Whole-model initialisation, measured alike for every
   mode: a fresh group, every rank released together by one barrier, no
   checks in the timed part; the figure is the slowest rank's time in
   ``initialize()`` over the model plus its first ``get_communication()``
   (where a rank reads the answers still outstanding), through the sidecar,
   embedded, and with no coordination at all (``bench/uncoordinated.py``:
   the same sizing, union and builds, nothing proposed or agreed).
4. **Cold start, cache prewarmed**: fresh rank processes from their start
   to a ready all-to-all (a first dispatch + combine of each layer kind at
   ``--tokens``), through the sidecar that remembers the plan, and embedded.

Run on a GPU machine with the project, torch and flashinfer-python installed
(``bench/gpu_runs/common.sh`` installs them from carried wheels), from the
repository root::

    python3 bench/ep_scale.py --out "$OUT"             # EP = every visible GPU
    python3 bench/ep_scale.py --ep 2 --tokens 2048 --layers 16 --out "$OUT"   # shrunk

CPU smoke run of the same logic (reference backend, gloo; CI runs it)::

    python bench/ep_scale.py --backend reference --ep 2 --tokens 64 --out /tmp/ep

Writes ``ep-scale.json`` (every figure, per rank, every check),
``ep-scale.log`` (everything printed, the ranks' logs included) and
``ep-scale-sidecar.log`` to ``--out``. Exit status: 0 when every check
passed, 1 when one failed (or a section could not run), 3 when none failed
but the time budget (``--budget``) cut sections short.
"""

from __future__ import annotations

import time

PROCESS_T0 = time.time()  # in a spawned rank: when this module began to load

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from multiprocessing import resource_tracker  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_bench import _percentile  # noqa: E402
from bench.gpu_cold_start import _FdTee  # noqa: E402
from bench.uncoordinated import UncoordinatedRank  # noqa: E402
from bench.vllm_gpu_bench import Vllm033Manager  # noqa: E402
from moe_sidecar import flashinfer as _flashinfer  # noqa: E402
from moe_sidecar.client.backends.base import BuildSpec  # noqa: E402
from moe_sidecar.client.backends.reference import (  # noqa: E402
    ReferenceAlltoAll,
    ReferenceCommParams,
    ReferenceCommunication,
    ReferenceOneSidedConfig,
    live_workspace_bytes,
)
from moe_sidecar.client.engines.vllm.sizing import classify_call  # noqa: E402
from moe_sidecar.core import limits as _limits  # noqa: E402
from moe_sidecar.core.plan import Capacities, join_capacities  # noqa: E402
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes  # noqa: E402
from tests.exchange import round_trip  # noqa: E402
from tests.gpu import workers  # noqa: E402
from tests.gpu.workers import world  # noqa: E402
from tests.multiprocess.harness import Sidecar, run_ranks, running_sidecar  # noqa: E402

CEILING = _limits.WorkspaceCeiling(_limits.DEFAULT_MAX_WORKSPACE_BYTES, _flashinfer.workspace_size)

HIDDEN = 7168
TOP_K = 8
NUM_EXPERTS = 256
FORMATS = ("NVFP4", "BF16")
"""The layer kinds: the base model's NVFP4 MoE layers and the bf16 MTP layer."""
GROUP = "ep-scale:deepseek-v3-nvfp4+mtp/ep{ep}/pp0"
MiB = 1 << 20
GiB = 1 << 30
RANK_MARGIN_S = 20.0
"""The parent waits a rank timeout plus 15 s; a section needs this much budget beyond it."""
MIN_SECTION_S = 30.0
EXIT_FAILED = 1
EXIT_BUDGET = 3


# --- sizes (pure) --------------------------------------------------------------------------


def model_layers(count: int) -> list[tuple[str, str]]:
    """``count - 1`` NVFP4 MoE layers, then the bf16 MTP layer (DeepSeek-V3's layer 61)."""
    nvfp4 = [(f"model.layers.{i}.mlp", "NVFP4") for i in range(count - 1)]
    return [*nvfp4, (f"model.layers.{count - 1}.mlp (mtp, bf16)", "BF16")]


def layer_capacities(ep: int, tokens: int, fmt: str) -> Capacities:
    """What one layer needs, by vLLM 0.33's rule (the manager's own sizing)."""
    call = classify_call(
        ep,
        tokens,
        TOP_K,
        NUM_EXPERTS,
        HIDDEN,
        (),
        {"dispatch_format": fmt, "extra_payload_bytes_per_token": 0},
    )
    return call.capacities


def expected_sizes(ep: int, tokens: int) -> dict[str, int]:
    """Per-rank workspace bytes FlashInfer 0.7.2.post1 needs: the NVFP4 layer's,
    the bf16 MTP layer's and their union's (what the manager builds)."""
    nvfp4 = layer_capacities(ep, tokens, "NVFP4")
    bf16 = layer_capacities(ep, tokens, "BF16")
    return {
        "nvfp4": capacities_workspace_bytes(nvfp4, ep),
        "bf16": capacities_workspace_bytes(bf16, ep),
        "union": capacities_workspace_bytes(join_capacities(nvfp4, bf16), ep),
    }


def aligned(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit if unit > 1 else n


def tolerance(expected: int, granularity: int) -> int:
    """How far a ``cudaMemGetInfo`` reading may stray from an expectation: two
    allocation units plus 0.5 % (page tables, lazily loaded kernels); 0 for
    the reference backend, whose accounting is exact."""
    return 0 if granularity <= 1 else 2 * granularity + expected // 200


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def _runs(actions: Sequence[str]) -> str:
    """``build@0, reuse x60, rebuild@61``."""
    parts: list[str] = []
    i = 0
    while i < len(actions):
        j = i
        while j < len(actions) and actions[j] == actions[i]:
            j += 1
        parts.append(f"{actions[i]}@{i}" if j - i == 1 else f"{actions[i]} x{j - i}")
        i = j
    return ", ".join(parts)


# --- rank side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankConfig:
    """What every rank of one step needs (pickled to the spawned ranks)."""

    backend: str
    ep: int
    tokens: int
    check_tokens: int
    layers: int
    reuse_rounds: int
    group: str
    target: str | None
    jit_cache_only: bool
    tag: str = ""


def _initialize(manager: Any, cfg: RankConfig, dispatch_format: object, layer: str | None) -> float:
    """One MoE layer in vLLM 0.33's call style (``layer=`` where the manager
    takes one: vLLM 0.33's own manager does not); returns the seconds it took."""
    started = time.perf_counter()
    manager.initialize(
        max_num_tokens=cfg.tokens,
        top_k=TOP_K,
        num_experts=NUM_EXPERTS,
        hidden_size=HIDDEN,
        dispatch_format=dispatch_format,
        extra_payload_bytes_per_token=0,
        **({} if layer is None else {"layer": layer}),
    )
    return time.perf_counter() - started


def _device(cfg: RankConfig, rank: int) -> torch.device:
    # Rank r on GPU r % count: with fewer GPUs than ranks, ranks share them.
    if cfg.backend != "flashinfer":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _synchronize(cfg: RankConfig) -> None:
    if cfg.backend == "flashinfer":
        torch.cuda.synchronize()


def _start_rank(rank: int, cfg: RankConfig) -> tuple[dict[str, float], dict[str, Any] | None]:
    """Logging, this rank's GPU, FlashInfer and its all-to-all module, each timestamped."""
    t = {"module_start": PROCESS_T0, "fn_start": time.time()}
    logging.basicConfig(
        level=logging.INFO,
        format=f"  [{cfg.tag} rank {rank}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # N ranks share the host's cores (the exact checks' CPU side is heavy at 8192 tokens).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.ep))
    if cfg.backend != "flashinfer":
        t["cuda_ready"] = t["flashinfer_imported"] = t["module_ready"] = time.time()
        return t, None
    workers.warm_up_cuda(rank)  # its GPU (rank % count) set first
    t["cuda_ready"] = time.time()
    if cfg.jit_cache_only:
        workers.use_jit_cache_only()
    alltoall = importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")
    t["flashinfer_imported"] = time.time()
    from moe_sidecar.client.backends.jit_cache import prepare_module

    load = prepare_module(alltoall.get_moe_alltoall_module)
    t["module_ready"] = time.time()
    report = load.report
    module = {
        "seconds": load.seconds,
        "compiled": load.compiled,
        "source": report.source if report else None,
        "library": str(report.aot_library or report.library) if report else None,
    }
    return t, module


def _formats(cfg: RankConfig) -> dict[str, object]:
    """``dispatch_format`` per layer kind: FlashInfer's own ``QuantFormat`` on
    the GPU (as vLLM 0.33 passes it), its name with the reference backend."""
    if cfg.backend != "flashinfer":
        return {name: name for name in FORMATS}
    # Imported here, before any memory mark: moe_ep is what get_communication()
    # and vLLM 0.33's sequence build on.
    importlib.import_module("flashinfer.moe_ep")
    quant_format = importlib.import_module("flashinfer.fused_moe").QuantFormat
    return {name: quant_format[name] for name in FORMATS}


def _exact(communication: Any, rank: int, cfg: RankConfig, fmt: str, seed: int) -> dict[str, Any]:
    """One dispatch + combine of ``fmt``'s payloads, every row and value checked
    against the CPU's prediction; collective."""
    started = time.perf_counter()
    result = round_trip(
        communication,
        rank=rank,
        ep_size=cfg.ep,
        hidden=HIDDEN,
        top_k=TOP_K,
        num_experts=NUM_EXPERTS,
        tokens=cfg.check_tokens,
        quantized=fmt == "NVFP4",
        device=_device(cfg, rank),
        seed=seed,
        max_tokens_per_rank=cfg.tokens,
    )
    result["format"] = fmt
    result["seconds"] = time.perf_counter() - started
    result["exact"] = (
        result["max_error"] == 0.0
        and result["bad_rows"] == 0
        and result["rows"] == cfg.ep * cfg.tokens
        and result["received_tokens"] > 0
    )
    return result


def _action(before: Any, after: Any) -> str:
    if after.builds > before.builds:
        return "build"
    if after.rebuilds > before.rebuilds:
        return "rebuild"
    return "reuse"


def _counters(manager: Any) -> dict[str, Any]:
    c = manager.counters
    return {
        "builds": c.builds,
        "rebuilds": c.rebuilds,
        "reuses": c.reuses,
        "releases": c.releases,
        "rpcs": c.rpcs,
        "collectives": c.collectives,
        "first_build_seconds": c.first_build_seconds,
    }


def _run_model(
    manager: Any,
    cfg: RankConfig,
    formats: dict[str, object],
    rank: int,
    *,
    check: bool,
    check_every_kind: bool = False,
) -> dict[str, Any]:
    """Every layer's ``initialize()``, timed; after each build, exact round trips
    of every layer kind initialized so far (``check_every_kind``: of both)."""
    seconds: list[float] = []
    actions: list[str] = []
    builds: list[dict[str, Any]] = []
    seen: list[str] = []
    for i, (label, fmt) in enumerate(model_layers(cfg.layers)):
        before = manager.counters
        seconds.append(_initialize(manager, cfg, formats[fmt], label))
        action = _action(before, manager.counters)
        actions.append(action)
        if fmt not in seen:
            seen.append(fmt)
        if action == "reuse":
            continue
        communication = manager.get_communication()
        build: dict[str, Any] = {
            "layer": i,
            "label": label,
            "action": action,
            "seconds": seconds[-1],
            "workspace": manager.workspace_size,
            "flashinfer_workspace": int(communication.alltoall.workspace_size_per_rank),
            "generation": manager.generation,
        }
        if check:
            kinds = list(FORMATS) if check_every_kind else list(seen)
            build["checks"] = [
                _exact(communication, rank, cfg, kind, seed=10 * i + j)
                for j, kind in enumerate(kinds)
            ]
        builds.append(build)
    return {
        "actions": actions,
        "builds": builds,
        "layer_seconds": seconds,
        "init_s": sum(seconds),
        "counters": _counters(manager),
        "workspace": manager.workspace_size,
        "generation": manager.generation,
    }


INIT_MODES = ("none", "embedded", "sidecar")
"""The whole-model initialisations timed alike, in this order."""


def _timed_inits(cfg: RankConfig, formats: dict[str, object]) -> dict[str, dict[str, Any]]:
    """The model's initialisation in every mode of :data:`INIT_MODES`, alike:
    a fresh group name, one barrier on the EP group before it, nothing but
    ``initialize()`` (and the first ``get_communication()``) in the timed part."""
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    out: dict[str, dict[str, Any]] = {}
    for mode in INIT_MODES:
        rank_object: Any = (
            UncoordinatedRank(world(), backend=cfg.backend)
            if mode == "none"
            else WorkspaceManager(
                world(),
                group=f"{cfg.group}/timed-{mode}",
                target=cfg.target if mode == "sidecar" else "embedded",
                backend=cfg.backend,
            )
        )
        dist.barrier()  # every rank starts the model together
        seconds: list[float] = []
        for label, fmt in model_layers(cfg.layers):
            seconds.append(_initialize(rank_object, cfg, formats[fmt], label))
        started = time.perf_counter()
        if mode != "none":
            rank_object.get_communication()  # reads every answer still outstanding
        settle = time.perf_counter() - started
        _synchronize(cfg)
        out[mode] = {
            "layer_seconds": seconds,
            "settle_s": settle,
            "init_s": sum(seconds) + settle,
            "builds": rank_object.builds
            if mode == "none"
            else rank_object.counters.builds + rank_object.counters.rebuilds,
        }
        rank_object.cleanup()
        dist.barrier()
    return out


def _reuse_rounds(manager: Any, cfg: RankConfig, formats: dict[str, object]) -> dict[str, Any]:
    """``cfg.reuse_rounds`` REUSE rounds (an NVFP4 layer, covered), every rank
    released together by a barrier, each timed on this rank."""
    import torch.distributed as dist

    before = manager.counters
    samples = []
    for i in range(cfg.reuse_rounds):
        dist.barrier()  # start every round together, as layers do
        layer = f"model.layers.{i % max(1, cfg.layers - 1)}.mlp"
        samples.append(_initialize(manager, cfg, formats["NVFP4"], layer))
    after = manager.counters
    rounds = max(1, cfg.reuse_rounds)
    return {
        "samples": samples,
        "reuses": after.reuses - before.reuses,
        "built": after.builds + after.rebuilds - before.builds - before.rebuilds,
        "rpcs_per_round": (after.rpcs - before.rpcs) / rounds,
        "collectives_per_round": (after.collectives - before.collectives) / rounds,
    }


def _bare_rounds(cfg: RankConfig) -> dict[str, Any]:
    """The bare decision: ``policy.propose`` for each of the N ranks of a round,
    in this process (the sidecar's core without gRPC, asyncio or a store)."""
    from moe_sidecar.core import policy
    from moe_sidecar.core.group import Decision, GroupState, Proposal, Requirement

    requirement = Requirement(layer_capacities(cfg.ep, cfg.tokens, "NVFP4"), "model.layers.0.mlp")
    state: GroupState | None = None
    samples: list[float] = []
    others: list[str] = []
    for n in range(1, cfg.reuse_rounds + 2):  # round 1 builds; the rest are timed
        reply: Any = None
        started = time.perf_counter()
        for r in range(cfg.ep):
            proposal = Proposal("ep-scale:bare", cfg.ep, r, cfg.ep, f"bare-{r}", n, requirement)
            step = policy.propose(state, proposal, float(n), 60.0, ceiling=CEILING)
            state, reply = step.state, step.reply
        elapsed = time.perf_counter() - started
        if not isinstance(reply, Decision):
            raise AssertionError(f"round {n} of the bare core did not close: {reply!r}")
        if n > 1:
            samples.append(elapsed)
            if reply.action.value != "reuse":
                others.append(reply.action.value)
    return {"samples": samples, "not_reuse": others}


def lifetime_rank(
    rank: int, world_size: int, cfg: RankConfig, restarted: bool, reuse: bool
) -> dict[str, Any]:
    """Section 1 (a lifetime of the model through the sidecar) and, in the first
    lifetime with ``reuse``, section 3 (REUSE rounds, embedded mode, bare core)."""
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    t, module = _start_rank(rank, cfg)
    formats = _formats(cfg)
    manager = WorkspaceManager(world(), group=cfg.group, target=cfg.target, backend=cfg.backend)
    out: dict[str, Any] = {"rank": rank, "module": module, "local_ranks": manager.local_ranks}
    out["model"] = _run_model(manager, cfg, formats, rank, check=True, check_every_kind=restarted)
    t["layers_done"] = time.time()
    if reuse:
        out["reuse_sidecar"] = _reuse_rounds(manager, cfg, formats)
        # The transport's default; False would mean it fell back to unary calls.
        out["session_stream"] = bool(getattr(manager._transport, "session", False))
    manager.cleanup()
    dist.barrier()
    if reuse:
        out["init"] = _timed_inits(cfg, formats)
        embedded = WorkspaceManager(
            world(), group=f"{cfg.group}/embedded", target="embedded", backend=cfg.backend
        )
        out["embedded_model"] = _run_model(embedded, cfg, formats, rank, check=False)
        out["reuse_embedded"] = _reuse_rounds(embedded, cfg, formats)
        embedded.cleanup()
        dist.barrier()
        if rank == 0:
            out["bare"] = _bare_rounds(cfg)
        dist.barrier()
    out["t"] = t
    return out


@dataclass(frozen=True)
class _Bootstrap:
    """The fields of FlashInfer's ``BootstrapConfig`` that vLLM 0.33 sets."""

    world_size: int
    rank: int
    device: int | None = None
    process_group: Any = None


class ReferenceMoeEp:
    """``flashinfer.moe_ep``'s names over the reference backend, so the CPU smoke
    run drives :class:`Vllm033Manager` through vLLM 0.33's whole sequence.

    ``create_communication`` sizes the workspace as FlashInfer's
    ``NVLinkOneSidedAlltoAll.__init__`` does (activations + int32 ids + float32
    weights + extra; bf16 combine rows) and keeps every workspace it made in a
    process-wide cache keyed as ``MoeAlltoAll._WORKSPACE_CACHE`` is, never
    freed: FlashInfer 0.7.2.post1's ``destroy()`` frees nothing either.
    """

    BootstrapConfig = _Bootstrap
    MoEEpCommParams = ReferenceCommParams
    NVLinkOneSidedConfig = ReferenceOneSidedConfig
    NVLinkOneSidedAlltoAll = ReferenceCommunication

    def __init__(self) -> None:
        self.cache: dict[tuple[int, ...], ReferenceAlltoAll] = {}

    def create_communication(
        self, bootstrap: _Bootstrap, params: ReferenceCommParams, backend: ReferenceOneSidedConfig
    ) -> ReferenceCommunication:
        dispatch = (
            params.dispatch_bytes_per_token
            + params.top_k * 4
            + params.top_k * 4
            + backend.extra_payload_bytes_per_token
        )
        combine = params.hidden_size * max(params.token_dtype.itemsize, 2)
        capacities = Capacities(
            max_tokens=params.max_tokens_per_rank,
            dispatch_bytes_per_token=dispatch,
            combine_bytes_per_token=combine,
            top_k=params.top_k,
            num_experts=params.num_experts,
        )
        size = capacities_workspace_bytes(capacities, bootstrap.world_size)
        key = (size, bootstrap.rank, bootstrap.world_size, params.max_tokens_per_rank, 0)
        if key not in self.cache:
            spec = BuildSpec(bootstrap.world_size, bootstrap.rank, capacities, size)
            self.cache[key] = ReferenceAlltoAll(bootstrap.process_group, spec)
        return ReferenceCommunication(self.cache[key], params, backend)


class _Memory:
    """What this rank's all-to-all holds on its device, from a mark taken now."""

    def __init__(self, cfg: RankConfig) -> None:
        self.flashinfer = cfg.backend == "flashinfer"
        if self.flashinfer:
            self.granularity = workers.granularity()
            self._allocated_at_mark = self._allocated()
            self._mark = workers.memory_mark()
        else:
            self.granularity = 1
            self._live_at_mark = live_workspace_bytes()

    @staticmethod
    def _allocated() -> int:
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        return sum(int(r.aligned_size) for r in mnnvl.MnnvlMemory.allocated_map.values())

    def read(self, cache_entries: int | None = None) -> dict[str, Any]:
        """``held``: device bytes taken since the mark outside PyTorch's caching
        allocator (``cudaMemGetInfo``); ``allocated``: FlashInfer's own records
        of its MNNVL allocations on this rank (the reference: its live bytes)."""
        if not self.flashinfer:
            live = live_workspace_bytes() - self._live_at_mark
            return {"held": live, "allocated": live, "cache_entries": cache_entries}
        alltoall = importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")
        return {
            "held": workers.held_bytes_change(self._mark),
            "allocated": self._allocated() - self._allocated_at_mark,
            "cache_entries": len(alltoall.MoeAlltoAll._WORKSPACE_CACHE),
        }


def memory_rank(rank: int, world_size: int, cfg: RankConfig, side: str) -> dict[str, Any]:
    """Section 2: the model's layers on one side (``vllm-0.33`` or
    ``moe-sidecar``), the memory held after each build and after growth, then
    one exact round trip of each layer kind on the grown workspace."""
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    _start_rank(rank, cfg)
    formats = _formats(cfg)  # FlashInfer's moe_ep imported before the mark
    memory = _Memory(cfg)
    steps: list[dict[str, Any]] = []
    manager: Any
    stand_in = ReferenceMoeEp() if cfg.backend != "flashinfer" and side == "vllm-0.33" else None

    def entries() -> int | None:
        return len(stand_in.cache) if stand_in is not None else None

    if side == "vllm-0.33":
        manager = Vllm033Manager(world(), moe_ep=stand_in)
    else:
        manager = WorkspaceManager(world(), group=cfg.group, target=cfg.target, backend=cfg.backend)
    for i, (label, fmt) in enumerate(model_layers(cfg.layers)):
        previous = manager.get_communication() if manager.communication is not None else None
        _initialize(manager, cfg, formats[fmt], label if side == "moe-sidecar" else None)
        communication = manager.get_communication()
        if communication is previous:
            continue
        step = {
            "layer": i,
            "label": label,
            "workspace": int(communication.alltoall.workspace_size_per_rank),
            **memory.read(entries()),
        }
        if side == "moe-sidecar":
            step["manager_workspace"] = manager.workspace_size
        steps.append(step)
    grown = memory.read(entries())
    communication = manager.get_communication()
    exact = [_exact(communication, rank, cfg, kind, seed=100 + j) for j, kind in enumerate(FORMATS)]
    out: dict[str, Any] = {
        "rank": rank,
        "side": side,
        "device": torch.cuda.get_device_name(rank) if cfg.backend == "flashinfer" else "cpu",
        "granularity": memory.granularity,
        "steps": steps,
        "after_growth": grown,
        "exact_after_growth": exact,
    }
    if side == "moe-sidecar":
        out["unreleased"] = int(getattr(manager.backend, "unreleased", 0))
        manager.destroy()
        out["after_destroy"] = memory.read(entries())
    dist.barrier()
    return out


def _plain_round_trip(communication: Any, rank: int, cfg: RankConfig, fmt: str) -> None:
    """One dispatch + combine of ``cfg.tokens`` tokens (unchecked), synchronised."""
    device = _device(cfg, rank)
    tokens = cfg.tokens
    ids = torch.rand(tokens, NUM_EXPERTS, device=device).argsort(dim=1)[:, :TOP_K]
    ids = ids.to(torch.int32)
    weights = torch.full((tokens, TOP_K), 1.0 / TOP_K, dtype=torch.float32, device=device)
    if fmt == "NVFP4":
        x = torch.zeros(tokens, HIDDEN // 2, dtype=torch.uint8, device=device)
        scale: torch.Tensor | None = torch.zeros(
            tokens, HIDDEN // 16, dtype=torch.uint8, device=device
        )
    else:
        x = torch.ones(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        scale = None
    received = communication.dispatch(
        x, ids, weights, hidden_states_scale=scale, max_tokens_per_rank=tokens
    )
    rows = received.hidden_states.shape[0]
    expert_output = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=device)
    output = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
    communication.combine(expert_output, output=output)
    _synchronize(cfg)


def cold_rank(rank: int, world_size: int, cfg: RankConfig) -> dict[str, Any]:
    """Section 4: a fresh rank process from its start to a ready all-to-all."""
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    t, module = _start_rank(rank, cfg)
    formats = _formats(cfg)
    manager = WorkspaceManager(world(), group=cfg.group, target=cfg.target, backend=cfg.backend)
    actions = []
    for label, fmt in model_layers(cfg.layers):
        before = manager.counters
        _initialize(manager, cfg, formats[fmt], label)
        actions.append(_action(before, manager.counters))
    t["layers_done"] = time.time()
    communication = manager.get_communication()
    _plain_round_trip(communication, rank, cfg, "NVFP4")
    t["first_nvfp4_done"] = time.time()
    _plain_round_trip(communication, rank, cfg, "BF16")
    t["ready"] = time.time()
    out = {
        "rank": rank,
        "t": t,
        "module": module,
        "actions": actions,
        "counters": _counters(manager),
        "workspace": manager.workspace_size,
    }
    dist.barrier()
    manager.cleanup()
    dist.barrier()
    return out


# --- checks (pure: the CPU tests call them with made-up results) --------------------------


@dataclass(frozen=True)
class Check:
    section: str
    name: str
    ok: bool
    detail: str = ""


def _all_exact(builds: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    bad = [
        f"layer {b['layer']} {c['format']}: max_error {c['max_error']}, bad rows {c['bad_rows']}, "
        f"rows {c['rows']}"
        for b in builds
        for c in b.get("checks", [])
        if not c["exact"]
    ]
    count = sum(len(b.get("checks", [])) for b in builds)
    return (not bad and count > 0), "; ".join(bad) or f"{count} round trips exact"


def regression_checks(
    first: Sequence[dict[str, Any]] | None,
    restarted: Sequence[dict[str, Any]] | None,
    sizes: dict[str, int],
    layers: int,
    group: dict[str, Any] | None,
) -> list[Check]:
    """Section 1: one build at the NVFP4 size, one rebuild at the union, exact
    after each; restarted ranks: one build, at the union, exact; the sidecar
    stores the union and saw both lifetimes."""
    s = "1"
    checks: list[Check] = []
    grow = ["build"] + ["reuse"] * (layers - 2) + ["rebuild"]
    warm = ["build"] + ["reuse"] * (layers - 1)
    for rank, r in enumerate(first or []):
        m = r["model"]
        where = f"rank {rank}"
        checks.append(
            Check(
                s,
                f"{where}: one build (layer 0), one rebuild (the MTP layer)",
                m["actions"] == grow,
                _runs(m["actions"]),
            )
        )
        got = [(b["workspace"], b["flashinfer_workspace"]) for b in m["builds"]]
        want = [(sizes["nvfp4"], sizes["nvfp4"]), (sizes["union"], sizes["union"])]
        checks.append(
            Check(
                s,
                f"{where}: built the NVFP4 size, then the union (FlashInfer's sizes)",
                got == want,
                f"{got}",
            )
        )
        ok, detail = _all_exact(m["builds"])
        checks.append(Check(s, f"{where}: dispatch + combine exact after each build", ok, detail))
    for rank, r in enumerate(restarted or []):
        m = r["model"]
        where = f"restarted rank {rank}"
        checks.append(
            Check(
                s,
                f"{where}: one build, in round 1, no rebuild",
                m["actions"] == warm,
                _runs(m["actions"]),
            )
        )
        sizes_built = [b["workspace"] for b in m["builds"]] + [
            b["flashinfer_workspace"] for b in m["builds"]
        ]
        checks.append(
            Check(
                s,
                f"{where}: built at the union",
                sizes_built == [sizes["union"]] * 2,
                f"{sizes_built}",
            )
        )
        ok, detail = _all_exact(m["builds"])
        checks.append(Check(s, f"{where}: NVFP4 and bf16 exact on the first build", ok, detail))
    if group is not None:
        checks.append(
            Check(
                s,
                "the sidecar stores the union",
                group["workspace_bytes"] == sizes["union"],
                f"{group['workspace_bytes']:,} B",
            )
        )
        checks.append(
            Check(
                s, "the sidecar saw two lifetimes", group["lifetimes"] == 2, f"{group['lifetimes']}"
            )
        )
    return checks


def memory_checks(
    vllm: Sequence[dict[str, Any]], ours: Sequence[dict[str, Any]], sizes: dict[str, int]
) -> list[Check]:
    """Section 2, per GPU: FlashInfer's sizes on both sides; moe-sidecar holds the
    union only, vLLM 0.33's sequence the union and the superseded workspace
    (``cudaMemGetInfo``, within :func:`tolerance`; FlashInfer's own records,
    exactly); both exact after growth; nothing left after ``destroy()``."""
    s = "2"
    checks: list[Check] = []
    want_sizes = [sizes["nvfp4"], sizes["union"]]
    for v, o in zip(vllm, ours, strict=True):
        unit = o["granularity"]
        gpu = f"GPU {o['rank']}"
        union_only = aligned(sizes["union"], unit)
        both = aligned(sizes["nvfp4"], unit) + union_only
        got = (
            [st["workspace"] for st in v["steps"]],
            [st["workspace"] for st in o["steps"]],
            [st["manager_workspace"] for st in o["steps"]],
        )
        checks.append(
            Check(
                s,
                f"{gpu}: FlashInfer sized NVFP4 then the union on both sides",
                all(g == want_sizes for g in got),
                f"vLLM {got[0]}, moe-sidecar {got[1]} (manager {got[2]}), computed {want_sizes}",
            )
        )
        for side, result, want, what in (
            ("moe-sidecar", o, union_only, "the union only"),
            ("vLLM 0.33", v, both, "the union + the superseded NVFP4 workspace"),
        ):
            held = result["after_growth"]["held"]
            allocated = result["after_growth"]["allocated"]
            tol = tolerance(want, unit)
            checks.append(
                Check(
                    s,
                    f"{gpu}: {side} holds {what} (cudaMemGetInfo)",
                    abs(held - want) <= tol,
                    f"{held:,} B held, {want:,} B expected (+-{tol:,} B)",
                )
            )
            checks.append(
                Check(
                    s,
                    f"{gpu}: {side}'s FlashInfer allocations are {what}",
                    allocated == want,
                    f"{allocated:,} B allocated, {want:,} B expected",
                )
            )
        entries = (o["after_growth"]["cache_entries"], v["after_growth"]["cache_entries"])
        if entries[0] is not None:
            checks.append(
                Check(
                    s,
                    f"{gpu}: workspace cache entries (moe-sidecar, vLLM)",
                    entries == (1, 2),
                    f"{entries}",
                )
            )
        elif entries[1] is not None:
            checks.append(
                Check(s, f"{gpu}: vLLM's workspace cache keeps 2", entries[1] == 2, f"{entries[1]}")
            )
        bad = [
            f"{r['side']} {c['format']}: max_error {c['max_error']}, bad rows {c['bad_rows']}"
            for r in (v, o)
            for c in r["exact_after_growth"]
            if not c["exact"]
        ]
        checks.append(
            Check(
                s,
                f"{gpu}: both sides exact after growth",
                not bad,
                "; ".join(bad) or "4 round trips exact",
            )
        )
        gone = o["after_destroy"]
        tol = tolerance(0, unit)
        checks.append(
            Check(
                s,
                f"{gpu}: moe-sidecar gives everything back on destroy()",
                abs(gone["held"]) <= tol and gone["allocated"] == 0 and o["unreleased"] == 0,
                f"held {gone['held']:,} B, allocated {gone['allocated']:,} B, unreleased {o['unreleased']}",
            )
        )
    return checks


def round_maxima(ranks: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Per round, the slowest rank's time: when the round is done for everyone."""
    series = [r[key]["samples"] for r in ranks]
    return [max(s[i] for s in series) for i in range(min(len(s) for s in series))]


def reuse_checks(ranks: Sequence[dict[str, Any]], rounds: int) -> list[Check]:
    """Section 3: a REUSE round of a node-local group through the sidecar is one
    RPC and no collective; no round of either mode built anything."""
    s = "3"
    checks: list[Check] = []
    for r in ranks:
        side = r["reuse_sidecar"]
        checks.append(
            Check(
                s,
                f"rank {r['rank']}: proposals travelled on the session stream",
                r.get("session_stream") is True,
                f"{r.get('session_stream')}",
            )
        )
        checks.append(
            Check(
                s,
                f"rank {r['rank']}: a sidecar REUSE round is 1 RPC, 0 collectives",
                side["rpcs_per_round"] == 1.0 and side["collectives_per_round"] == 0.0,
                f"{side['rpcs_per_round']} RPC, {side['collectives_per_round']} collectives",
            )
        )
        for mode in ("reuse_sidecar", "reuse_embedded"):
            m = r[mode]
            checks.append(
                Check(
                    s,
                    f"rank {r['rank']}: {rounds} {mode.split('_')[1]} rounds all REUSE",
                    m["reuses"] == rounds and m["built"] == 0,
                    f"{m['reuses']} reuses, {m['built']} builds",
                )
            )
    bare = ranks[0]["bare"]
    checks.append(
        Check(s, "the bare core answered REUSE", not bare["not_reuse"], f"{bare['not_reuse'][:3]}")
    )
    return checks


def exit_status(checks: Sequence[Check], skipped: Sequence[str]) -> int:
    """1 when a check failed; else 3 when the budget cut sections short; else 0
    (1 too when nothing at all was checked)."""
    if not all(c.ok for c in checks):
        return EXIT_FAILED
    if skipped:
        return EXIT_BUDGET
    return 0 if checks else EXIT_FAILED


# --- parent side ---------------------------------------------------------------------------


class BudgetExhausted(Exception):
    """Too little of ``--budget`` is left for a section."""


@dataclass
class Run:
    args: argparse.Namespace
    deadline: float
    tmp: Path
    sizes: dict[str, int]
    checks: list[Check] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    sections: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return GROUP.format(ep=self.args.ep)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def rank_timeout(self, wanted: float) -> float:
        """A watchdog for the next ranks: ``wanted``, or what the budget leaves."""
        left = self.remaining() - RANK_MARGIN_S
        if left < MIN_SECTION_S:
            raise BudgetExhausted(
                f"{self.remaining():.0f} s of the {self.args.budget:.0f} s budget left"
            )
        return min(wanted, left)

    def rank_config(self, **changes: Any) -> RankConfig:
        a = self.args
        config = RankConfig(
            backend=a.backend,
            ep=a.ep,
            tokens=a.tokens,
            check_tokens=a.check_tokens,
            layers=a.layers,
            reuse_rounds=a.reuse_rounds,
            group=self.group,
            target=None,
            jit_cache_only=a.jit_cache_only,
        )
        return replace(config, **changes)

    def ranks(
        self, fn: Callable[..., Any], name: str, wanted_timeout: float, *args: Any
    ) -> list[Any]:
        ep = self.args.ep
        return run_ranks(
            fn,
            ep,
            timeout=self.rank_timeout(wanted_timeout),
            tmp_path=self.tmp / name,
            args=args,
            envs=[{"NCCL_NVLS_ENABLE": "0"}] * ep,
        )

    def record(self, checks: Sequence[Check]) -> None:
        for c in checks:
            print(
                f"   [{'ok' if c.ok else 'FAILED'}] {c.name}"
                + (f": {c.detail}" if c.detail else "")
            )
        self.checks.extend(checks)
        sys.stdout.flush()

    def section(self, key: str, title: str, body: Callable[[], dict[str, Any]]) -> None:
        print(f"\n== {key}. {title}", flush=True)
        started = time.monotonic()
        try:
            self.sections[key] = body()
        except BudgetExhausted as error:
            self.skipped.append(key)
            self.sections[key] = {"skipped": str(error)}
            print(f"   SKIPPED (time budget): {error}")
        except Exception as error:  # a rank failed: recorded, the other sections still run
            text = "".join(traceback.format_exception(error))
            print(text)
            first = str(error).strip().splitlines()
            self.record(
                [
                    Check(
                        key,
                        "the section ran to its end",
                        False,
                        first[0] if first else type(error).__name__,
                    )
                ]
            )
            self.sections[key] = {"error": text}
        print(f"   (section {key}: {time.monotonic() - started:.1f} s)", flush=True)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(command: Sequence[str], timeout: float = 20.0) -> str | None:
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def machine() -> dict[str, Any]:
    """The machine and versions, without touching CUDA in this process (a CUDA
    context here would sit on GPU 0 during the memory readings)."""
    smi = shutil.which("nvidia-smi")
    return {
        "nvidia_smi_L": _command_output([smi, "-L"]) if smi else None,
        "gpus": _command_output(
            [
                smi,
                "--query-gpu=index,name,memory.total,driver_version,compute_cap",
                "--format=csv,noheader",
            ]
        )
        if smi
        else None,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "flashinfer": _version("flashinfer-python"),
        "moe_sidecar": _version("moe-sidecar"),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "apache_tvm_ffi": _version("apache-tvm-ffi"),
        "commit": _command_output(["git", "rev-parse", "--short", "HEAD"]),
        "host": platform.node(),
    }


def _gpu_arch(info: dict[str, Any]) -> str:
    """This GPU's FlashInfer target (``9.0a`` on an H200), for ``prewarm --arch``."""
    from moe_sidecar.client.prewarm import ToolMissing, find_cuda_toolkit, normalize_capability

    capability = None
    if info.get("gpus"):
        capability = info["gpus"].splitlines()[0].split(",")[-1].strip()
    if not capability or "." not in capability:
        # nvidia-smi without compute_cap: ask torch, in a child (no context here).
        capability = _command_output(
            [
                sys.executable,
                "-c",
                "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))",
            ],
            timeout=120,
        )
    if not capability:
        raise RuntimeError("cannot tell this GPU's compute capability")
    major, minor = (int(p) for p in capability.split(".")[:2])
    try:
        cuda_version = find_cuda_toolkit(os.environ).version
    except ToolMissing:
        cuda_version = None
    return normalize_capability(major, minor, cuda_version).label


def section_module(run: Run, info: dict[str, Any]) -> dict[str, Any]:
    """0: ``moe-sidecar prewarm``, as a user runs it (no GPU visible)."""
    if run.args.backend != "flashinfer":
        print("   reference backend: no FlashInfer module")
        return {"backend": "reference"}
    from moe_sidecar import cli

    arch = _gpu_arch(info)
    timeout = min(run.args.prewarm_timeout, max(60.0, run.remaining() - 120))
    command = [
        sys.executable,
        "-c",
        f"import sys; from {cli.__name__} import main; sys.exit(main())",
        "prewarm",
        "--arch",
        arch,
        "--json",
        "--timeout",
        str(int(timeout)),
        *(["--ignore-aot"] if run.args.jit_cache_only else []),
    ]
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    print(
        f"   moe-sidecar {' '.join(command[3:])}  (FLASHINFER_WORKSPACE_BASE={base}, no GPU visible)\n"
        "   if the module is neither compiled in that cache nor shipped ahead of time, this "
        "compiles it now: about 190 s on an H200 host",
        flush=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_CUDA_ARCH_LIST"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout + 60
    )
    wall = time.monotonic() - started
    try:
        document: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        document = {"ok": False, "error": f"no JSON from prewarm: {done.stdout[-2000:]}"}
    document["wall_s"] = wall
    targets = document.get("targets") or []
    outcomes = [
        (t.get("label"), t.get("outcome"), round(float(t.get("seconds") or 0), 1)) for t in targets
    ]
    print(f"   prewarm exited {done.returncode} after {wall:.1f} s: {outcomes}")
    if any(t.get("outcome") == "built" for t in targets):
        print(f"   NOTE: this run compiled FlashInfer's module ({wall:.0f} s of the budget)")
    run.record(
        [
            Check(
                "0",
                "FlashInfer's all-to-all module is ready (compiled or shipped ahead of time)",
                done.returncode == 0 and bool(document.get("ok")),
                str(document.get("error") or outcomes),
            )
        ]
    )
    return {"arch": arch, "prewarm": document, "exit_status": done.returncode}


def section_regression(run: Run, sidecar: Sidecar) -> dict[str, Any]:
    a, sizes = run.args, run.sizes
    reuse = "3" in a.sections
    cfg = run.rank_config(target=sidecar.target, tag="1/first lifetime")
    print(
        f"   {a.layers} layers ({a.layers - 1} NVFP4 + bf16 MTP), {a.tokens} tokens/rank, EP {a.ep}; "
        f"exact checks: {a.check_tokens} tokens/rank at a runtime maximum of {a.tokens}",
        flush=True,
    )
    first = run.ranks(lifetime_rank, "1-first", 420, cfg, False, reuse)
    for r in first:
        m = r["model"]
        print(
            f"   first lifetime, rank {r['rank']}: {_runs(m['actions'])}; init {m['init_s']:.3f} s"
        )
        for b in m["builds"]:
            trips = ", ".join(
                f"{c['format']} {'exact' if c['exact'] else 'WRONG'} ({c['seconds']:.1f} s)"
                for c in b["checks"]
            )
            print(
                f"     {b['action']} at layer {b['layer']}: {b['workspace']:,} B/rank, generation {b['generation']}; {trips}"
            )
    restarted = run.ranks(
        lifetime_rank, "1-restarted", 300, replace(cfg, tag="1/restarted"), True, False
    )
    for r in restarted:
        m = r["model"]
        print(
            f"   restarted ranks, rank {r['rank']}: {_runs(m['actions'])}; init {m['init_s']:.3f} s"
        )
        for b in m["builds"]:
            trips = ", ".join(
                f"{c['format']} {'exact' if c['exact'] else 'WRONG'}" for c in b["checks"]
            )
            print(f"     {b['action']} at layer {b['layer']}: {b['workspace']:,} B/rank; {trips}")
    stored = sidecar.get_group(run.group)
    group = {
        "workspace_bytes": int(stored.plan.workspace_bytes),
        "lifetimes": int(stored.lifetimes),
        "generation": int(stored.plan.generation),
    }
    print(f"   the sidecar's group: {group}")
    run.record(regression_checks(first, restarted, sizes, a.layers, group))
    return {"first_lifetime": first, "restarted": restarted, "sidecar_group": group}


def section_memory(run: Run, sidecar: Sidecar) -> dict[str, Any]:
    sizes = run.sizes
    vllm = run.ranks(memory_rank, "2-vllm", 300, run.rank_config(tag="2/vllm-0.33"), "vllm-0.33")
    ours = run.ranks(
        memory_rank,
        "2-moe-sidecar",
        300,
        run.rank_config(group=f"{run.group}/memory", target=sidecar.target, tag="2/moe-sidecar"),
        "moe-sidecar",
    )
    unit = ours[0]["granularity"]
    union_only = aligned(sizes["union"], unit)
    both = aligned(sizes["nvfp4"], unit) + union_only
    print(
        f"   expected per GPU (allocation unit {_mib(unit) if unit > 1 else '1 B'}): "
        f"union only {_mib(union_only)}; union + superseded {_mib(both)}"
    )
    print(
        "   GPU | side         | after 1st build | after growth (cudaMemGetInfo) | FlashInfer allocations | expected     | cache"
    )
    for v, o in zip(vllm, ours, strict=True):
        for name, result, want in (("vLLM 0.33", v, both), ("moe-sidecar", o, union_only)):
            first = result["steps"][0]["held"] if result["steps"] else 0
            g = result["after_growth"]
            print(
                f"   {result['rank']:>3} | {name:12s} | {_mib(first):>15s} | {_mib(g['held']):>29s} | "
                f"{_mib(g['allocated']):>22s} | {_mib(want):>12s} | {g['cache_entries']}"
            )
    kept = [
        v["after_growth"]["held"] - o["after_growth"]["held"]
        for v, o in zip(vllm, ours, strict=True)
    ]
    print(
        f"   kept for nothing by vLLM 0.33's sequence, per GPU: {', '.join(_mib(k) for k in kept)}"
    )
    run.record(memory_checks(vllm, ours, sizes))
    return {
        "vllm-0.33": vllm,
        "moe-sidecar": ours,
        "expected": {"union_only": union_only, "union_and_superseded": both, "granularity": unit},
    }


def _stats(samples: Sequence[float]) -> dict[str, float]:
    return {
        "p50": statistics.median(samples),
        "p99": _percentile(list(samples), 0.99),
        "n": len(samples),
    }


def section_reuse(run: Run) -> dict[str, Any]:
    s1 = run.sections.get("1") or {}
    first = s1.get("first_lifetime")
    if "skipped" in s1:
        raise BudgetExhausted("it measures in section 1's rank processes, which did not run")
    if not first:
        raise RuntimeError(
            "section 3 measures in section 1's first rank processes, which did not finish"
        )
    a = run.args
    summary: dict[str, Any] = {}
    bare = first[0]["bare"]["samples"]
    summary["bare_round"] = _stats(bare)
    summary["bare_proposal_p50"] = summary["bare_round"]["p50"] / a.ep
    for mode in ("sidecar", "embedded"):
        summary[f"{mode}_round"] = _stats(round_maxima(first, f"reuse_{mode}"))
        summary[f"{mode}_round_rank0"] = _stats(first[0][f"reuse_{mode}"]["samples"])
    core = summary["bare_round"]["p50"]
    print(
        f"   bare decision (policy.propose x {a.ep} ranks, one process): p50 {core * 1e6:.1f} us per round "
        f"({summary['bare_proposal_p50'] * 1e6:.1f} us per proposal)"
    )
    for mode, how in (
        ("sidecar", "covered: 1 message on the session stream, no wait, 0 collectives"),
        ("embedded", "covered: the in-process core, no all-gather"),
    ):
        st = summary[f"{mode}_round"]
        r0 = first[0][f"reuse_{mode}"]
        print(
            f"   REUSE round, {mode:8s} ({how}): p50 {st['p50'] * 1e6:8.1f} us, p99 {st['p99'] * 1e6:8.1f} us "
            f"(slowest of {a.ep} ranks per round; {st['p50'] / core:.1f}x the bare decision); "
            f"rank 0: {r0['rpcs_per_round']:.2f} RPC, {r0['collectives_per_round']:.2f} collectives per round"
        )
    init = {mode: max(r["init"][mode]["init_s"] for r in first) for mode in INIT_MODES}
    summary["whole_model_init_s"] = init
    summary["whole_model_init_ratio"] = (
        init["sidecar"] / init["embedded"] if init["embedded"] else None
    )
    summary["whole_model_init_vs_none"] = init["sidecar"] / init["none"] if init["none"] else None
    for mode in INIT_MODES:
        r0 = first[0]["init"][mode]
        layer_s = r0["layer_seconds"]
        print(
            f"   whole-model init ({a.layers} layers, timed alike), {mode:8s}: {init[mode]:.3f} s "
            f"(slowest rank's initialize() + first get_communication(); rank 0: {r0['init_s']:.3f} s, "
            f"of which {layer_s[0] + layer_s[-1]:.3f} s in its 2 build rounds, "
            f"{r0['settle_s']:.4f} s in get_communication())"
        )
    if summary["whole_model_init_ratio"] is not None:
        print(
            f"   sidecar / embedded: {summary['whole_model_init_ratio']:.2f} (target: <= 1); "
            f"sidecar / none: {summary['whole_model_init_vs_none'] or 0:.2f} (target: <= 1.10)"
        )
    run.record(reuse_checks(first, a.reuse_rounds))
    return summary


def _cold_summary(spawned: float, ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    t0 = ranks[0]["t"]
    module = ranks[0]["module"] or {}
    return {
        "spawn_to_ready_s": max(r["t"]["ready"] for r in ranks) - spawned,
        "process_start_to_ready_s": max(r["t"]["ready"] - r["t"]["module_start"] for r in ranks),
        "rank0": {
            "spawn_to_module_start_s": t0["module_start"] - spawned,
            "imports_and_gloo_s": t0["fn_start"] - t0["module_start"],
            "cuda_init_s": t0["cuda_ready"] - t0["fn_start"],
            "flashinfer_import_s": t0["flashinfer_imported"] - t0["cuda_ready"],
            "module_load_s": t0["module_ready"] - t0["flashinfer_imported"],
            "layers_s": t0["layers_done"] - t0["module_ready"],
            "first_dispatch_combine_x2_s": t0["ready"] - t0["layers_done"],
        },
        "module_source": module.get("source"),
        "module_compiled": [(r["module"] or {}).get("compiled") for r in ranks],
        "actions": _runs(ranks[0]["actions"]),
        "builds": ranks[0]["counters"]["builds"] + ranks[0]["counters"]["rebuilds"],
        "workspace": ranks[0]["workspace"],
    }


def section_cold(run: Run, sidecar: Sidecar) -> dict[str, Any]:
    a = run.args
    taught = bool((run.sections.get("1") or {}).get("first_lifetime"))
    cases = {
        "prewarmed + a sidecar that remembers the plan": run.rank_config(
            target=sidecar.target, tag="4/sidecar"
        ),
        "prewarmed, embedded (no sidecar)": run.rank_config(
            group=f"{run.group}/cold-embedded", target="embedded", tag="4/embedded"
        ),
    }
    out: dict[str, Any] = {}
    checks: list[Check] = []
    for name, cfg in cases.items():
        spawned = time.time()
        ranks = run.ranks(cold_rank, f"4-{cfg.tag.split('/')[1]}", 240, cfg)
        summary = _cold_summary(spawned, ranks)
        out[name] = {"spawned": spawned, "ranks": ranks, "summary": summary}
        r0 = summary["rank0"]
        print(
            f"   {name}: spawn -> ready {summary['spawn_to_ready_s']:.2f} s (process start -> ready "
            f"{summary['process_start_to_ready_s']:.2f} s); {summary['actions']}; module "
            f"{summary['module_source']}, compiled by a rank: {summary['module_compiled']}\n     rank 0: "
            + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in r0.items())
        )
        if a.backend == "flashinfer":
            checks.append(
                Check(
                    "4",
                    f"{name}: no process compiled the module",
                    all(c is False for c in summary["module_compiled"]),
                    f"{summary['module_compiled']}",
                )
            )
        if "sidecar" in cfg.tag and taught:
            checks.append(
                Check(
                    "4",
                    f"{name}: one build, at the union",
                    summary["builds"] == 1 and summary["workspace"] == run.sizes["union"],
                    f"{summary['actions']}, {summary['workspace']:,} B",
                )
            )
    run.record(checks)
    return out


def headline(run: Run) -> list[str]:
    """The figures for bench/results/gpu/README.md."""
    a, s = run.args, run.sections
    lines = [f"EP {a.ep}, {a.tokens} tokens/rank, {a.layers} layers, backend {a.backend}"]
    one = s.get("1") or {}
    if one.get("first_lifetime"):
        lines.append(
            "regression: "
            + _runs(one["first_lifetime"][0]["model"]["actions"])
            + "; restarted: "
            + _runs(one["restarted"][0]["model"]["actions"])
        )
    two = s.get("2") or {}
    if two.get("moe-sidecar"):
        ours = max(r["after_growth"]["held"] for r in two["moe-sidecar"])
        theirs = max(r["after_growth"]["held"] for r in two["vllm-0.33"])
        lines.append(
            f"device memory after growth, per GPU (max): moe-sidecar {_mib(ours)}, vLLM 0.33 {_mib(theirs)}"
        )
    three = s.get("3") or {}
    if three.get("sidecar_round"):
        lines.append(
            f"REUSE round p50/p99: sidecar {three['sidecar_round']['p50'] * 1e6:.0f}/{three['sidecar_round']['p99'] * 1e6:.0f} us, "
            f"embedded {three['embedded_round']['p50'] * 1e6:.0f}/{three['embedded_round']['p99'] * 1e6:.0f} us, "
            f"bare {three['bare_round']['p50'] * 1e6:.0f}/{three['bare_round']['p99'] * 1e6:.0f} us"
        )
        init = three["whole_model_init_s"]
        lines.append(
            f"whole-model init (timed alike): sidecar {init['sidecar']:.3f} s, embedded "
            f"{init['embedded']:.3f} s, no coordination {init['none']:.3f} s"
        )
    four = s.get("4") or {}
    for name, case in four.items():
        if isinstance(case, dict) and "summary" in case:
            lines.append(
                f"cold start, {name}: spawn -> ready {case['summary']['spawn_to_ready_s']:.2f} s"
            )
    return lines


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--ep",
        type=int,
        default=None,
        help="EP size (default: every visible GPU; 2 with --backend reference)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="directory for ep-scale.json and ep-scale.log (default $OUT)",
    )
    parser.add_argument("--backend", choices=("flashinfer", "reference"), default="flashinfer")
    parser.add_argument("--tokens", type=int, default=8192, help="max_num_tokens per rank (T)")
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=None,
        help="tokens per rank in each exact check (default: T)",
    )
    parser.add_argument(
        "--layers", type=int, default=62, help="MoE layers, the last the bf16 MTP layer"
    )
    parser.add_argument("--reuse-rounds", type=int, default=300, help="REUSE rounds timed per mode")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    parser.add_argument(
        "--sections", default="1,2,3,4", help="which measurements (3 runs in 1's rank processes)"
    )
    parser.add_argument(
        "--round-timeout", type=float, default=60.0, help="the sidecar's --round-timeout"
    )
    parser.add_argument("--prewarm-timeout", type=float, default=480.0)
    parser.add_argument(
        "--jit-cache-only",
        action="store_true",
        help="hide FlashInfer's ahead-of-time module in every rank (prewarm --ignore-aot)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out DIR (or $OUT) is required")
    if args.backend == "flashinfer" and torch.cuda.device_count() == 0:
        parser.error("no CUDA GPU visible (the CPU smoke run is --backend reference)")
    if args.ep is None:
        args.ep = torch.cuda.device_count() if args.backend == "flashinfer" else 2
    if args.ep < 1 or NUM_EXPERTS % args.ep:
        parser.error(f"--ep {args.ep}: must divide {NUM_EXPERTS} (FlashInfer's moe_ep needs it)")
    if args.layers < 2:
        parser.error("--layers must be >= 2 (NVFP4 layers, then the MTP layer)")
    if args.tokens < 1:
        parser.error("--tokens must be >= 1")
    if args.check_tokens is None:
        args.check_tokens = args.tokens
    if not 1 <= args.check_tokens <= args.tokens:
        parser.error("--check-tokens must be in [1, --tokens]")
    if args.reuse_rounds < 1:
        parser.error("--reuse-rounds must be >= 1")
    try:
        sections = {int(x) for x in args.sections.split(",") if x.strip()}
    except ValueError:
        parser.error(f"--sections {args.sections!r}: numbers 1-4, comma-separated")
    if not sections or not sections <= {1, 2, 3, 4}:
        parser.error(f"--sections {args.sections!r}: numbers 1-4, comma-separated")
    if 3 in sections:
        sections.add(1)
    # MoeAlltoAll runs with ranks sharing a GPU (rank r on GPU r % count), so
    # sections 1, 3 and 4 run at any EP; section 2 reads device memory per GPU
    # as one rank's, which ranks sharing a GPU would mix.
    if args.backend == "flashinfer" and args.ep > torch.cuda.device_count() and 2 in sections:
        parser.error(
            f"--ep {args.ep} with {torch.cuda.device_count()} GPU(s) visible: ranks would "
            "share GPUs, and section 2 reads memory per GPU as one rank's; "
            "leave it out (--sections 1,3,4)"
        )
    args.sections = {str(x) for x in sections}
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "ep-scale.log"
    log.unlink(missing_ok=True)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # Started before the tee: a process that outlives it must not hold the tee's pipe.
    resource_tracker.ensure_running()
    tee = _FdTee(log)
    status = EXIT_FAILED
    document: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ep-scale-") as tmp_name:
            status, document = _run(args, started, Path(tmp_name))
    finally:
        tee.close()
        if document:
            (args.out / "ep-scale.json").write_text(json.dumps(document, indent=2, default=str))
    return status


def _run(args: argparse.Namespace, started: float, tmp: Path) -> tuple[int, dict[str, Any]]:
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    info = machine()
    sizes = expected_sizes(args.ep, args.tokens)
    ep8 = expected_sizes(8, 8192)
    run = Run(args=args, deadline=started + args.budget, tmp=tmp, sizes=sizes)
    print(f"command: {command}")
    print(
        f"cwd: {os.getcwd()}; FLASHINFER_WORKSPACE_BASE={os.environ.get('FLASHINFER_WORKSPACE_BASE')}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}; NCCL_NVLS_ENABLE=0"
    )
    print("machine (nvidia-smi -L):")
    for line in (info["nvidia_smi_L"] or "(nvidia-smi not available)").splitlines():
        print(f"  {line}")
    if info["gpus"]:
        print(
            f"  {info['gpus'].splitlines()[0]}  (index, name, memory, driver, compute capability)"
        )
    print(
        f"versions: python {info['python']}, torch {info['torch']} (CUDA {info['torch_cuda']}), "
        f"flashinfer-python {info['flashinfer']}, moe-sidecar {info['moe_sidecar']} (commit "
        f"{info['commit']}), grpcio {info['grpcio']}, protobuf {info['protobuf']}; {info['cpus']} CPUs"
    )
    print(
        f"model: {args.layers} MoE layers ({args.layers - 1} NVFP4 + bf16 MTP), hidden {HIDDEN}, top_k "
        f"{TOP_K}, {NUM_EXPERTS} experts, {args.tokens} tokens/rank, EP {args.ep}, backend {args.backend}; "
        f"sections {','.join(sorted(args.sections))}; budget {args.budget:.0f} s"
    )
    print(
        f"workspace per rank (computed, FlashInfer 0.7.2.post1): NVFP4 {sizes['nvfp4']:,} B "
        f"({_mib(sizes['nvfp4'])}), union {sizes['union']:,} B ({_mib(sizes['union'])}), "
        f"both {_mib(sizes['nvfp4'] + sizes['union'])}"
    )
    print(
        f"  (EP 8 at 8192 tokens: NVFP4 {ep8['nvfp4'] / GiB:.2f} GiB, union {ep8['union'] / GiB:.2f} GiB, "
        f"both {(ep8['nvfp4'] + ep8['union']) / GiB:.2f} GiB)",
        flush=True,
    )
    run.section(
        "0",
        "FlashInfer's all-to-all module (moe-sidecar prewarm)",
        lambda: section_module(run, info),
    )
    sidecar_log = ""
    with running_sidecar(tmp / "sidecar", round_timeout=args.round_timeout) as sidecar:
        if "1" in args.sections:
            run.section(
                "1",
                "the regression through a real sidecar",
                lambda: section_regression(run, sidecar),
            )
        if "2" in args.sections:
            run.section(
                "2",
                "device memory after growth, per GPU: vLLM 0.33's sequence vs moe-sidecar",
                lambda: section_memory(run, sidecar),
            )
        if "3" in args.sections:
            run.section(
                "3",
                "REUSE round latency and whole-model initialisation",
                lambda: section_reuse(run),
            )
        if "4" in args.sections:
            run.section(
                "4",
                "cold start with the cache prewarmed: fresh processes to a ready all-to-all",
                lambda: section_cold(run, sidecar),
            )
        sidecar_log = sidecar.log.read_text(errors="replace")
    (args.out / "ep-scale-sidecar.log").write_text(sidecar_log)
    status = exit_status(run.checks, run.skipped)
    failed = [c for c in run.checks if not c.ok]
    print("\n== headline")
    lines = headline(run)
    for line in lines:
        print(f"   {line}")
    print(
        f"\n{len(run.checks) - len(failed)} of {len(run.checks)} checks passed"
        + (f"; FAILED: {[c.name for c in failed]}" if failed else "")
        + (f"; sections skipped for the budget: {run.skipped}" if run.skipped else "")
        + f"; {time.monotonic() - started:.1f} s; exit status {status}"
    )
    print(
        f"writing {args.out / 'ep-scale.json'}, {args.out / 'ep-scale.log'}, {args.out / 'ep-scale-sidecar.log'}"
    )
    document = {
        "command": command,
        "argv": sys.argv,
        "machine": info,
        "config": {
            k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
        },
        "model": {
            "hidden": HIDDEN,
            "top_k": TOP_K,
            "num_experts": NUM_EXPERTS,
            "layers": model_layers(args.layers)[-2:],
        },
        "expected": {"sizes": sizes, "ep8_8192": ep8},
        "sections": run.sections,
        "checks": [dataclasses.asdict(c) for c in run.checks],
        "skipped": run.skipped,
        "headline": lines,
        "exit_status": status,
        "wall_s": time.monotonic() - started,
    }
    return status, document


if __name__ == "__main__":
    sys.exit(main())
