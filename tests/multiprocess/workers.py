"""What the spawned ranks run. Imported in the rank processes only.

Kept apart from the test modules so a rank imports neither pytest nor the
tests' fixtures. Every worker returns plain data (dicts, lists, strings);
the tests assert on it in the parent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

HIDDEN = 256
TOP_K = 2
NUM_EXPERTS = 8
MAX_TOKENS = 16


@dataclass(frozen=True)
class Layer:
    """One MoE layer as vLLM describes it to the manager."""

    name: str
    x_bytes: int
    x_sf_bytes: int
    max_num_tokens: int = MAX_TOKENS
    top_k: int = TOP_K
    num_experts: int = NUM_EXPERTS

    @property
    def nvfp4(self) -> bool:
        return self.x_sf_bytes > 0

    @property
    def arguments(self) -> tuple[int, int, int, int, int, int]:
        """``initialize()``'s positional arguments for this layer (vLLM 0.30's call style)."""
        return (
            self.max_num_tokens,
            self.top_k,
            self.num_experts,
            HIDDEN,
            self.x_bytes,
            self.x_sf_bytes,
        )


def layer_capacities(ep_size: int, layer: Layer) -> Any:
    """The capacities the manager proposes for ``layer`` (a ``Capacities``)."""
    from moe_sidecar.client.sizing import layer_capacities as capacities

    return capacities(ep_size, *layer.arguments)


def initialize(manager: Any, layer: Layer) -> float:
    """``manager.initialize`` for ``layer``, vLLM 0.30's call style; the seconds it took."""
    started = time.perf_counter()
    manager.initialize(*layer.arguments, layer=layer.name)
    return time.perf_counter() - started


def nvfp4_layer(name: str, **kw: Any) -> Layer:
    return Layer(name, HIDDEN // 2, HIDDEN // 16, **kw)


def bf16_layer(name: str, **kw: Any) -> Layer:
    return Layer(name, HIDDEN * 2, 0, **kw)


REGRESSION = (
    nvfp4_layer("model.layers.0.mlp"),
    bf16_layer("mtp.mlp"),
    nvfp4_layer("model.layers.1.mlp"),
)


# --- counting collectives without replacing them ----------------------------

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "scatter",
    "reduce",
)


class CollectiveCounter:
    """Counts every torch.distributed collective this process issues.

    Wraps the real functions (they still run); the manager's own counters are
    checked against it, so a collective the manager forgot to count shows.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        for name in _COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return real(*args, **kwargs)

        return counted

    def __len__(self) -> int:
        return len(self.calls)


# --- data and a locally computed reference ----------------------------------


def _owner(expert: int, num_experts: int, ep_size: int) -> int:
    # Independent of the backend's vectorised partition: the plain loop of
    # FlashInfer's comment (ranks [0, remainder) own base + 1 experts).
    base, remainder = divmod(num_experts, ep_size)
    first = 0
    for rank in range(ep_size):
        count = base + (1 if rank < remainder else 0)
        if expert < first + count:
            return rank
        first += count
    raise AssertionError(expert)


def _decode(x: torch.Tensor, nvfp4: bool) -> torch.Tensor:
    """Hidden values (small integers) of dispatched rows, as float32."""
    if not nvfp4:
        return x.to(torch.float32)
    low = (x & 0xF).to(torch.float32) - 8
    high = (x >> 4).to(torch.float32) - 8
    return torch.stack([low, high], dim=-1).reshape(*x.shape[:-1], -1)


def _expert_scale(ids: torch.Tensor) -> torch.Tensor:
    return (ids % 3 + 1).to(torch.float32)


def layer_inputs(layer: Layer, rank: int, seed: int, tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    values = torch.randint(-8, 8, (tokens, HIDDEN), generator=g)
    ids = torch.stack(
        [torch.randperm(layer.num_experts, generator=g)[: layer.top_k] for _ in range(tokens)]
    ).to(torch.int32)
    weights = torch.randint(1, 3, (tokens, layer.top_k), generator=g).to(torch.float32) / 2
    if layer.nvfp4:
        nibbles = (values + 8).to(torch.uint8).reshape(tokens, HIDDEN // 2, 2)
        x = nibbles[..., 0] | (nibbles[..., 1] << 4)
        x_sf = torch.randint(0, 256, (tokens, layer.x_sf_bytes), generator=g).to(torch.uint8)
        payloads = {"x": x, "x_sf": x_sf}
    else:
        payloads = {"x": values.to(torch.bfloat16)}
    return {**payloads, "ids": ids, "weights": weights, "values": values.to(torch.float32)}


def exchange(a2a: Any, layer: Layer, ep_rank: int, ep_size: int, seed: int) -> float:
    """Dispatch + expert compute + combine at the maximum runtime tokens.

    Returns the largest difference between the combined result and the one
    computed locally from this rank's own tokens (0.0 when exact).
    """
    tokens = MAX_TOKENS
    inputs = layer_inputs(layer, ep_rank, seed, tokens)
    payloads = [inputs["x"]] + ([inputs["x_sf"]] if layer.nvfp4 else [])
    payloads += [inputs["ids"], inputs["weights"]]
    received = a2a.dispatch(inputs["ids"], payloads, tokens)
    x, ids, weights = received[0], received[-2], received[-1]
    hidden = _decode(x, layer.nvfp4)
    owners = torch.tensor([_owner(e, layer.num_experts, ep_size) for e in range(layer.num_experts)])
    mine = (owners[ids.long()] == ep_rank).to(torch.float32)
    factor = (weights * _expert_scale(ids) * mine).sum(dim=-1, keepdim=True)
    expert_out = (hidden * factor).to(torch.bfloat16)
    output = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)
    combined = a2a.combine(expert_out, tokens, output=output)
    assert combined is output
    expected = (
        inputs["values"]
        * (inputs["weights"] * _expert_scale(inputs["ids"])).sum(dim=-1, keepdim=True)
    ).to(torch.bfloat16)
    return float((combined.to(torch.float32) - expected.to(torch.float32)).abs().max())


# --- the manager through a layer sequence -----------------------------------


def run_layers(
    manager: Any,
    layers: Sequence[Layer],
    counter: CollectiveCounter,
    *,
    check_numerics: bool,
    seed: int = 0,
) -> list[dict[str, Any]]:
    from moe_sidecar.client.backends.reference import live_workspace_bytes

    records = []
    for i, layer in enumerate(layers):
        before_handle = manager.moe_alltoall
        before = manager.counters
        calls_before = len(counter)
        elapsed = initialize(manager, layer)
        after = manager.counters
        record: dict[str, Any] = {
            "layer": layer.name,
            "workspace_size": manager.workspace_size,
            "max_num_tokens": manager.max_num_tokens,
            "top_k": manager.top_k,
            "num_experts": manager.num_experts,
            "generation": manager.generation,
            "initialized": manager.initialized,
            "new_object": manager.moe_alltoall is not before_handle,
            "old_released": bool(getattr(before_handle, "released", False)),
            "delta": {
                k: v - asdict(before)[k]
                for k, v in asdict(after).items()
                if isinstance(v, int) and not isinstance(v, bool)
            },
            "dist_calls": counter.calls[calls_before:],
            "live_bytes": live_workspace_bytes(),
            "seconds": elapsed,
        }
        if check_numerics:
            calls = len(counter)
            record["max_error"] = exchange(
                manager.moe_alltoall, layer, manager.ep_rank, manager.ep_size, seed + i
            )
            del counter.calls[calls:]  # the exchange's own collectives are not the manager's
        records.append(record)
    return records


def reference_manager(cpu_group: Any, group: str, target: str | None, **kw: Any) -> Any:
    """A manager of ``group`` on the reference backend (``target`` None: the environment's)."""
    from moe_sidecar.client import WorkspaceManager

    return WorkspaceManager(cpu_group, group=group, target=target, backend="reference", **kw)


def regression_worker(rank: int, world: int, target: str | None, group: str) -> dict[str, Any]:
    """The seed's sequence, then the same workspace without the coordinator."""
    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.reference import ReferenceBackend

    cpu_group = dist.new_group(backend="gloo")
    counter = CollectiveCounter()
    manager = reference_manager(cpu_group, group, target)
    records = run_layers(manager, REGRESSION, counter, check_numerics=True)

    # Without the coordinator: sized by the first layer, as before the fix.
    first = REGRESSION[0]
    capacities = layer_capacities(world, first)
    backend = ReferenceBackend(cpu_group)
    naive = backend.build(
        BuildSpec(world, rank, capacities, backend.workspace_bytes(capacities, world))
    )
    first_error = exchange(naive, first, rank, world, seed=7)
    overflow = ""
    try:
        exchange(naive, REGRESSION[1], rank, world, seed=8)
    except RuntimeError as error:
        overflow = str(error)
    backend.release(naive)
    manager.cleanup()
    return {
        "records": records,
        "embedded": manager.embedded,
        "agrees": manager.agrees_across_ranks,
        "naive_first_error": first_error,
        "naive_overflow": overflow,
    }


def reuse_worker(rank: int, world: int, target: str, group: str) -> dict[str, Any]:
    """One build, then rounds the plan already covers."""
    cpu_group = dist.new_group(backend="gloo")
    counter = CollectiveCounter()
    manager = reference_manager(cpu_group, group, target, local_ranks=world)
    layers = [bf16_layer("layer.0")] + [
        nvfp4_layer(f"layer.{i}", max_num_tokens=MAX_TOKENS - i) for i in range(1, 6)
    ]
    records = run_layers(manager, layers, counter, check_numerics=False)
    return {"records": records, "agrees": manager.agrees_across_ranks}


def pipeline_worker(rank: int, world: int, target: str) -> dict[str, Any]:
    """2 stages x EP 2; stage 1 grows once more than stage 0."""
    stage_groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    stage = rank // 2
    cpu_group = stage_groups[stage]
    counter = CollectiveCounter()
    if stage == 0:
        layers = [nvfp4_layer(f"pp0.layers.{i}.mlp") for i in range(3)]
    else:
        layers = [nvfp4_layer("pp1.layers.0.mlp"), bf16_layer("pp1.mtp.mlp")]
        layers += [nvfp4_layer("pp1.layers.1.mlp")]
    results = {}
    for mode, mode_target in (("sidecar", target), ("embedded", "embedded")):
        manager = reference_manager(cpu_group, f"pp-test:{mode}/tp1-ep2/pp{stage}", mode_target)
        results[mode] = run_layers(manager, layers, counter, check_numerics=True, seed=stage)
        manager.cleanup()
    return {"stage": stage, "results": results}


def warm_restart_worker(rank: int, world: int, target: str, group: str) -> dict[str, Any]:
    """A model's whole layer sequence (61 NVFP4 layers and a bf16 MTP head)."""
    cpu_group = dist.new_group(backend="gloo")
    counter = CollectiveCounter()
    manager = reference_manager(cpu_group, group, target)
    layers = [nvfp4_layer(f"model.layers.{i}.mlp") for i in range(3)]
    layers += [bf16_layer("mtp.mlp")]
    layers += [nvfp4_layer(f"model.layers.{i}.mlp") for i in range(3, 6)]
    records = run_layers(manager, layers, counter, check_numerics=False)
    # The last layer is served by what is built, with no rebuild in between.
    error = exchange(manager.moe_alltoall, layers[3], rank, world, seed=3)
    return {
        "records": records,
        "counters": asdict(manager.counters),
        "lifetime": manager.lifetime,
        "max_error": error,
    }


def divergence_worker(rank: int, world: int, target: str, group: str) -> dict[str, Any]:
    """Rank 1 proposes another top_k in round 2 (sidecar, node-local group)."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    good = nvfp4_layer("model.layers.0.mlp")
    manager.initialize(MAX_TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, good.x_bytes, good.x_sf_bytes)
    top_k = 4 if rank == 1 else TOP_K

    def round_two() -> None:
        manager.initialize(
            MAX_TOKENS, top_k, NUM_EXPERTS, HIDDEN, good.x_bytes, good.x_sf_bytes, layer="mtp.mlp"
        )
        # Rank 0's round is covered: it returns at once, and the refusal is
        # raised when the answer is read, as vLLM does before its first step.
        manager.get_communication()

    return _expect_failure(round_two)


def _expect_failure(call: Callable[[], None]) -> dict[str, Any]:
    from moe_sidecar.client.errors import rpc_status

    started = time.monotonic()
    try:
        call()
    except Exception as error:
        status = rpc_status(error)
        return {
            "type": type(error).__name__,
            "mro": [c.__name__ for c in type(error).__mro__],
            "message": str(error),
            "seconds": time.monotonic() - started,
            "grpc_code": status.code.name if status else None,
        }
    return {"type": None, "seconds": time.monotonic() - started}


def embedded_divergence_worker(rank: int, world: int) -> dict[str, Any]:
    """Embedded mode: shapes differing in round 1, then a heterogeneous layer."""
    cpu_group = dist.new_group(backend="gloo")
    layer = nvfp4_layer("model.layers.0.mlp")
    first = reference_manager(cpu_group, "diverge-first/ep2", "embedded")
    top_k = 4 if rank == 1 else TOP_K
    round_one = _expect_failure(
        lambda: first.initialize(
            MAX_TOKENS, top_k, NUM_EXPERTS, HIDDEN, layer.x_bytes, layer.x_sf_bytes, layer="L0"
        )
    )
    later = reference_manager(cpu_group, "diverge-later/ep2", "embedded")
    later.initialize(MAX_TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, layer.x_bytes, layer.x_sf_bytes)

    def second() -> None:
        later.initialize(
            MAX_TOKENS, top_k, NUM_EXPERTS, HIDDEN, layer.x_bytes, layer.x_sf_bytes, layer="mtp"
        )
        # Rank 0 passes its round 2 as covered; its agreement before use
        # finds rank 1 out of step, and both raise.
        later.get_communication()

    round_two = _expect_failure(second)
    return {"round_one": round_one, "round_two": round_two}


def two_nodes_worker(rank: int, world: int, targets: list[str]) -> dict[str, Any]:
    """8 ranks, 4 per simulated node, each node with its own sidecar."""
    cpu_group = dist.new_group(backend="gloo")
    counter = CollectiveCounter()
    node = rank // 4
    manager = reference_manager(
        cpu_group, "two-nodes:fp4/tp1-ep8/pp0", targets[node], local_ranks=4
    )
    # Node 1's ranks serve larger batches in the first layer: only the
    # cross-node agreement tells node 0 about it.
    first_tokens = MAX_TOKENS + 4 if node == 1 else MAX_TOKENS
    layers = [
        nvfp4_layer("model.layers.0.mlp", max_num_tokens=first_tokens),
        bf16_layer("mtp.mlp"),
        nvfp4_layer("model.layers.1.mlp"),
    ]
    records = run_layers(manager, layers, counter, check_numerics=True)
    return {"records": records, "agrees": manager.agrees_across_ranks}


def mask_across_sidecars_worker(
    rank: int, world: int, targets: list[str], group: str
) -> dict[str, Any]:
    """``world`` ranks split evenly over ``len(targets)`` sidecars: the first
    ``initialize()``, as each rank's policy (``MOE_SIDECAR_ON_PEER_LOSS``)
    meets it, and the layer after it."""
    cpu_group = dist.new_group(backend="gloo")
    per_node = world // len(targets)
    manager = reference_manager(cpu_group, group, targets[rank // per_node], local_ranks=per_node)
    layer = nvfp4_layer("model.layers.0.mlp")

    def first() -> None:
        initialize(manager, layer)

    refused = _expect_failure(first)
    again = _expect_failure(first)
    return {"first": refused, "again": again, "generation": manager.generation}


def layers_worker(
    rank: int, world: int, target: str, group: str, layers: list[Layer]
) -> list[dict[str, Any]]:
    """Any layer sequence, checking dispatch + combine after every call."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    return run_layers(manager, layers, CollectiveCounter(), check_numerics=True)


def agreement_worker(rank: int, world: int) -> dict[str, Any]:
    """Agreement, communicator and reference-backend checks on ranks 0 and 1.

    Rank 2 is in the world but not in the EP group: it only waits at the
    end. Any collective that ran on the world instead of the EP group would
    leave ranks 0 and 1 waiting for it until the watchdog fires.
    """
    from moe_sidecar.client.agreement import LocalOutcome, agree_round
    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.communicator import GroupCommunicator
    from moe_sidecar.client.backends.reference import ReferenceBackend, live_workspace_bytes
    from moe_sidecar.client.errors import BackendError, PreconditionFailed
    from moe_sidecar.client.sizing import aux_data_size
    from moe_sidecar.core.plan import Capacities, Plan

    ep_group = dist.new_group([0, 1], backend="gloo")
    out: dict[str, Any] = {}
    if rank < 2:
        plans = [
            Plan(Capacities(16, 400, 200, 2, 8), epoch=0, generation=3),
            Plan(Capacities(32, 100, 300, 2, 8), epoch=0, generation=5),
        ]
        _, agreed = agree_round(ep_group, LocalOutcome(rank, "L", plans[rank]), group_name="g")
        out["agreed"] = (agreed.capacities, agreed.epoch, agreed.generation)
        # A reset on one node: the higher epoch wins whole.
        newer = replace(plans[1], epoch=1)
        _, agreed = agree_round(
            ep_group, LocalOutcome(rank, "L", [plans[0], newer][rank]), group_name="g"
        )
        out["agreed_epoch"] = (agreed.capacities, agreed.epoch, agreed.generation)
        failure = PreconditionFailed("boom on rank 1") if rank == 1 else None
        try:
            agree_round(
                ep_group,
                LocalOutcome(rank, "mtp", None if failure else plans[rank], failure),
                group_name="g",
            )
        except PreconditionFailed as error:
            cause = error.__cause__
            out["failed"] = (
                type(error).__name__,
                str(error),
                cause is not None and cause is failure,
            )
        shape = Plan(Capacities(16, 100, 200, 4 if rank == 1 else 2, 8), epoch=0, generation=1)
        try:
            agree_round(ep_group, LocalOutcome(rank, "L7", shape), group_name="g")
        except PreconditionFailed as error:
            out["disagree"] = (type(error).__name__, str(error))

        comm = GroupCommunicator(ep_group)
        out["comm"] = (
            comm.Get_rank(),
            comm.Get_size(),
            comm.allgather(f"r{rank}"),
            comm.bcast(f"from{rank}", root=1),
        )
        comm.barrier()
        same = comm.Split(0, rank)
        reversed_ = comm.Split(7, -rank)
        out["split"] = (
            same.Get_rank(),
            reversed_.Get_rank(),
            reversed_.allgather(rank),
            reversed_.bcast(rank, root=0),
        )
        try:
            comm.Split(rank, 0)
        except BackendError as error:
            out["multi_color"] = str(error)

        backend = ReferenceBackend(ep_group)
        five = Layer("odd", HIDDEN // 2, HIDDEN // 16, num_experts=5)
        roomy = backend.build(
            BuildSpec(
                2, rank, Capacities(MAX_TOKENS, 1, 1, TOP_K, 5), workspace_size_per_rank=1 << 20
            )
        )
        out["five_experts_error"] = exchange(roomy, five, rank, 2, seed=11)
        out["live_before_release"] = live_workspace_bytes()
        backend.release(roomy)
        out["live_after_release"] = live_workspace_bytes()
        try:
            exchange(roomy, five, rank, 2, seed=11)
        except BackendError as error:
            out["after_release"] = str(error)
        tight = backend.build(
            BuildSpec(
                2,
                rank,
                Capacities(MAX_TOKENS, 1, 1, TOP_K, 8),
                workspace_size_per_rank=aux_data_size(2, MAX_TOKENS) + 256,
            )
        )
        try:
            exchange(tight, REGRESSION[0], rank, 2, seed=1)
        except RuntimeError as error:
            out["dispatch_overflow"] = str(error)
        backend.release(tight)
    dist.barrier()
    return out


def client_surface_worker(rank: int, world: int) -> dict[str, Any]:
    """``backend="flashinfer"`` where FlashInfer is not installed, then ``get_handle()``.

    Embedded mode, so no sidecar is needed.
    """
    from moe_sidecar.client import BackendError, WorkspaceManager

    cpu_group = dist.new_group(backend="gloo")
    layer = nvfp4_layer("model.layers.0.mlp")

    # FlashInfer is imported on the first build, not at construction.
    missing = WorkspaceManager(cpu_group, target="embedded", backend="flashinfer")
    out: dict[str, Any] = {"error": None}
    try:
        initialize(missing, layer)
    except BackendError as error:
        out["error"] = (str(error), type(error.__cause__).__name__)
    out["after_failure"] = (missing.initialized, missing.moe_alltoall, missing.workspace_size)

    manager = reference_manager(cpu_group, "get-handle/ep1", "embedded")
    out["handle_before_build"] = manager.get_handle({}) is manager
    initialize(manager, layer)
    handle = manager.get_handle({})
    out["handle_is_manager"] = handle is manager
    out["handle_serves_the_layer"] = exchange(handle.moe_alltoall, layer, rank, world, seed=5)
    manager.cleanup()
    return out


# --- every vLLM generation through one manager ------------------------------


def _destroyed(communication: Any) -> bool:
    try:
        communication.alltoall  # noqa: B018 - raises once destroyed
    except RuntimeError:
        return True
    return False


def generations_worker(rank: int, world: int, target: str, group: str) -> dict[str, Any]:
    """vLLM 0.33's capacity contract through get_communication(), exact round
    trips at the full token count of every layer it initialized, checkpoint,
    destroy; then PR #42976's and 0.30's call styles on a second group."""
    from moe_sidecar.client import WorkspaceManager
    from moe_sidecar.client.backends.reference import live_workspace_bytes
    from moe_sidecar.client.errors import BackendError, InvalidArgument
    from tests.contracts import QuantFormat, v033_capacity_contract
    from tests.exchange import round_trip

    cpu_group = dist.new_group(backend="gloo")
    cpu = torch.device("cpu")
    out: dict[str, Any] = {}
    manager = WorkspaceManager(cpu_group, group=f"{group}/v033", target=target, backend="reference")
    try:
        manager.get_communication()
    except BackendError as error:
        out["before_initialize"] = str(error)
    contract = v033_capacity_contract(manager, world, QuantFormat)
    objects = contract["objects"]
    shared = contract["shared"]
    out["destroyed"] = [_destroyed(o) for o in objects]
    out["workspace_size"] = manager.workspace_size
    out["live"] = live_workspace_bytes()
    out["max_num_tokens"] = manager.max_num_tokens
    out["params"] = (shared.params.hidden_size, shared.params.max_tokens_per_rank)
    layers = [  # (hidden, quantized, scale bytes): every layer the contract initialized
        (4096, True, None),
        (4096, False, None),
        (4096, False, 256),
        (2048, False, None),
        (8192, True, None),
        (6144, False, None),
    ]
    trips = {}
    for i, (hidden, quantized, scales) in enumerate(layers):
        trips[f"{hidden}/{'nvfp4' if quantized else 'bf16'}/{scales}"] = round_trip(
            shared,
            rank=rank,
            ep_size=world,
            hidden=hidden,
            top_k=4,
            num_experts=world * 8,
            tokens=2048,
            quantized=quantized,
            device=cpu,
            seed=i,
            scale_bytes=scales,
        )
    out["trips"] = trips

    # vLLM's sleep mode: the workspace given back and taken again.
    manager.checkpoint_prepare()
    out["live_unmapped"] = live_workspace_bytes()
    try:
        shared.dispatch(torch.zeros(1, 8), torch.zeros(1, 4, dtype=torch.int32))
    except RuntimeError as error:
        out["unmapped_dispatch"] = str(error)
    manager.checkpoint_restore()
    out["live_restored"] = live_workspace_bytes()
    out["after_restore"] = round_trip(
        manager.get_communication(),
        rank=rank,
        ep_size=world,
        hidden=4096,
        top_k=4,
        num_experts=world * 8,
        tokens=64,
        quantized=True,
        device=cpu,
        seed=99,
    )
    out["same_after_restore"] = manager.get_communication() is shared
    manager.destroy()
    out["live_after_destroy"] = live_workspace_bytes()
    out["shared_destroyed"] = _destroyed(shared)

    # The older generations' call styles, on their own group (top_k 2).
    older = WorkspaceManager(cpu_group, group=f"{group}/older", target=target, backend="reference")
    sizes = []
    refusals = []
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((0, HIDDEN // 16), {}),  # PR #42976 positional: NVFP4
        ((), {"x_bytes_per_token": HIDDEN // 2, "x_sf_bytes_per_token": HIDDEN // 16}),
        ((2,), {"dispatch_scale_bytes_per_token": 0}),  # PR #42976: bf16
        ((HIDDEN * 2, 0), {}),  # 0.30 positional: bf16
    ]
    for positional, keywords in calls:
        older.initialize(MAX_TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, *positional, **keywords)
        sizes.append(older.workspace_size)
        # A refused call uses up no round: the next one goes on as if it never was.
        try:
            older.initialize(MAX_TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, 100, 0)
        except InvalidArgument as error:
            refusals.append(str(error))
    out["older_sizes"] = sizes
    out["older_refusals"] = refusals
    out["older_generation"] = older.generation
    out["older_exchange"] = exchange(older.moe_alltoall, bf16_layer("x"), rank, world, seed=5)
    older.cleanup()
    dist.barrier()
    return out


# --- liveness: ranks that die ---------------------------------------------------------


def failure_report(error: BaseException) -> dict[str, Any]:
    """What a rank sends back of an error: its type and classes, message, gRPC code, ranks, time."""
    from moe_sidecar.client.errors import rpc_status

    status = rpc_status(error)
    return {
        "type": type(error).__name__,
        "mro": [c.__name__ for c in type(error).__mro__],
        "message": str(error),
        "grpc_code": status.code.name if status else None,
        "ranks": list(getattr(error, "ranks", ())),
        "at": time.monotonic(),
    }


def session_rank(
    rank: int, ranks: int, commands: Any, results: Any, target: str, group: str
) -> None:
    """A rank that only talks to the sidecar (GrpcTransport over its Session
    stream), one round per ``("propose", round)`` command, until ``("exit",)``.

    Puts ``(rank, "decided", {...})`` or ``(rank, "failed", {...})`` per round,
    with CLOCK_MONOTONIC times, so the parent can time what happened in here.
    """
    try:
        from moe_sidecar.client.transport import GrpcTransport
        from moe_sidecar.core.group import Proposal, Requirement
        from moe_sidecar.core.identity import new_lifetime_secret
        from moe_sidecar.core.plan import Capacities

        transport = GrpcTransport(target, propose_timeout=60.0)
        lifetime = new_lifetime_secret()
        capacities = Capacities(MAX_TOKENS, 200, 400, TOP_K, NUM_EXPERTS)
        results.put((rank, "started", None))
        while True:
            command = commands.get()
            if command[0] == "exit":
                transport.close()
                results.put((rank, "exited", None))
                return
            rnd = command[1]
            proposal = Proposal(
                group, ranks, rank, ranks, lifetime, rnd, Requirement(capacities, f"layer.{rnd}")
            )
            started = time.monotonic()
            try:
                decision = transport.propose(proposal)
            except Exception as error:
                results.put(
                    (rank, "failed", {**failure_report(error), "round": rnd, "started": started})
                )
            else:
                results.put(
                    (
                        rank,
                        "decided",
                        {
                            "round": rnd,
                            "action": decision.action.value,
                            "started": started,
                            "at": time.monotonic(),
                        },
                    )
                )
    except BaseException:
        import traceback

        results.put((rank, "crashed", traceback.format_exc()))


DEATH_STATUS = 17
"""The exit status of a rank that dies in its build (os._exit)."""


def barrier_death_worker(
    rank: int, world: int, target: str, group: str, dying_rank: int
) -> dict[str, Any]:
    """Round 1 builds; ``dying_rank`` dies right after its build (every rank's
    build collective has completed), so the others wait for it in the
    post-build barrier. Returns a survivor's error."""
    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.reference import ReferenceAlltoAll, ReferenceBackend

    class DyingBackend(ReferenceBackend):
        def build(self, spec: BuildSpec) -> ReferenceAlltoAll:
            handle = super().build(spec)
            if spec.ep_rank == dying_rank:
                os._exit(DEATH_STATUS)  # the crash: no cleanup, no goodbye
            return handle

    from moe_sidecar.client import WorkspaceManager

    cpu_group = dist.new_group(backend="gloo")
    manager = WorkspaceManager(
        cpu_group, group=group, target=target, backend=DyingBackend(cpu_group), local_ranks=world
    )
    layer = nvfp4_layer("model.layers.0.mlp")
    started = time.monotonic()
    try:
        initialize(manager, layer)
    except Exception as error:
        out = failure_report(error)
        out["seconds"] = out["at"] - started
        out["cause"] = type(error.__cause__).__name__
        out["initialized"] = manager.initialized
        out["embedded"] = manager.embedded
        return out
    return {"type": None}


def bad_target_worker(rank: int, world: int) -> dict[str, Any]:
    """A WorkspaceManager built with MOE_SIDECAR_TARGET set to a bad address."""
    from moe_sidecar.client import WorkspaceManager

    cpu_group = dist.new_group(backend="gloo")
    try:
        WorkspaceManager(cpu_group, group="bad-target/ep1", backend="reference")
    except Exception as error:
        return {**failure_report(error), "field": getattr(error, "field", None)}
    return {"type": None}


class _ProposeWhen:
    """The rank's own transport, whose proposals wait until a file exists: a
    rank that is slow to reach its first proposal (after its group proof was
    shared), so a stranger can try to take its place first."""

    def __init__(self, transport: Any, go: str) -> None:
        self._transport = transport
        self._go = go

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def propose(self, proposal: Any) -> Any:
        deadline = time.monotonic() + 60
        while not os.path.exists(self._go):
            assert time.monotonic() < deadline, f"{self._go} never appeared"
            time.sleep(0.01)  # the poll interval of a wait with a deadline
        return self._transport.propose(proposal)


def group_proof_worker(
    rank: int, world: int, target: str, group: str, directory: str
) -> dict[str, Any]:
    """Two lifetimes of the group; in each, the last rank proposes only once
    the test's stranger has tried to take its place (``go-1``, ``go-2``)."""
    cpu_group = dist.new_group(backend="gloo")
    counter = CollectiveCounter()
    manager = reference_manager(cpu_group, group, target, local_ranks=world)
    real = manager._transport
    lifetimes = []
    for lifetime in (1, 2):
        if rank == world - 1:
            manager._transport = _ProposeWhen(real, os.path.join(directory, f"go-{lifetime}"))
        records = run_layers(
            manager, [nvfp4_layer("model.layers.0.mlp")], counter, check_numerics=True
        )
        lifetimes.append(
            {
                "records": records,
                "proof_calls": [c for c in records[0]["dist_calls"] if c == "broadcast"],
            }
        )
        manager.cleanup()
        manager._transport = real
    return {"lifetimes": lifetimes}
