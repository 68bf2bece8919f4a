"""The answer of ``moe-sidecar size``: what one rank maps for a model at an EP size.

Pure: the standard library and the project's pure modules only (no torch,
no FlashInfer, no GPU). :func:`plan_sizes` answers; :mod:`.command` holds
the subcommand's flags and runs it.

For each layer kind of the model (``--dispatch``), the core's one per-layer
rule (:func:`moe_sidecar.core.layer.layer_capacities`) gives its capacities
(dispatch bytes per token = activations + scales + extra + ``8 * top_k`` of
routing; combine = ``2 * hidden``); the answer is the workspace of their union, in the release's own
arithmetic: :func:`moe_sidecar.core.sizing.workspace_size_per_rank` for
0.7.2.post1, :func:`moe_sidecar.client.sizing_moe_ep.capacities_workspace_bytes`
for 0.7.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Final

from moe_sidecar.client import sizing_moe_ep
from moe_sidecar.client.engines.vllm.sizing import DISPATCH_FORMAT_BYTES
from moe_sidecar.client.size.releases import DISPATCH_KINDS, RELEASES
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.layer import layer_capacities
from moe_sidecar.core.limits import EP_SIZE_REASON, MAX_EP_SIZE, check_capacities
from moe_sidecar.core.plan import Capacities, join_capacities
from moe_sidecar.core.sizing import KMAX_TOP_K, workspace_size_per_rank

__all__ = [
    "LayerSize",
    "SizeAnswer",
    "SizeError",
    "activation_bytes",
    "plan_sizes",
]

_MAX_RANKS: Final = {"0.7.2.post1": 64, "0.7.4": sizing_moe_ep.MAX_RANKS}
"""Each release's ``kMaxRanks``."""


class SizeError(ValueError):
    """An argument the answer cannot be given for; the message names it."""


def activation_bytes(kind: str, hidden: int) -> int:
    """Bytes one token's activations and scales take for a ``--dispatch`` value.

    Raises:
        SizeError: neither a known kind nor a non-negative integer.
    """
    if kind in DISPATCH_KINDS:
        return DISPATCH_FORMAT_BYTES[DISPATCH_KINDS[kind]](hidden)
    try:
        value = int(kind)
    except ValueError:
        raise SizeError(
            f"--dispatch={kind!r}: must be one of {', '.join(DISPATCH_KINDS)} or an integer "
            "(activation plus scale bytes per token)"
        ) from None
    if value < 0:
        raise SizeError(f"--dispatch={kind!r}: bytes per token must be non-negative")
    return value


@dataclass(frozen=True)
class LayerSize:
    """One layer kind of the model, alone."""

    dispatch: str
    dispatch_bytes_per_token: int
    combine_bytes_per_token: int
    workspace_bytes_per_rank: int
    """What a workspace for this layer kind alone would take."""


@dataclass(frozen=True)
class SizeAnswer:
    """What one rank maps for the model at ``ep_size`` with one FlashInfer release."""

    flashinfer: str
    ep_size: int
    capacities: Capacities
    """The union of every layer kind's capacities."""
    workspace_bytes_per_rank: int
    """FlashInfer's own per-rank size (before its allocator rounds it up)."""
    layers: tuple[LayerSize, ...]
    kept_superseded_bytes_per_rank: int
    """What a manager that grows in ``--dispatch`` order but never frees a
    superseded workspace holds per rank: the sum of every build."""
    refusals: tuple[str, ...]
    """Who would refuse this configuration (the sidecar's limits, FlashInfer's
    all-to-all object, the client), and why; empty when nobody would."""
    described_as: sizing_moe_ep.Description | None
    """0.7.4: the parameters the client's backend builds the union with."""

    @property
    def gpu_total_bytes(self) -> int:
        """Physical bytes over every GPU of the EP group (one workspace each)."""
        return self.ep_size * self.workspace_bytes_per_rank


def _workspace(release: str, capacities: Capacities, ep_size: int) -> int:
    if release == "0.7.4":
        return sizing_moe_ep.capacities_workspace_bytes(capacities, ep_size)
    return workspace_size_per_rank(
        ep_size,
        capacities.max_tokens,
        capacities.dispatch_bytes_per_token,
        capacities.combine_bytes_per_token,
        capacities.eplb_experts,
    )


def _positive(flag: str, value: int) -> None:
    if value <= 0:
        raise SizeError(f"{flag}={value}: must be positive")


def plan_sizes(
    release: str,
    ep_size: int,
    tokens: int,
    hidden: int,
    top_k: int,
    experts: int,
    dispatch: tuple[str, ...],
    eplb_experts: int = 0,
    extra_bytes: int = 0,
) -> SizeAnswer:
    """The workspace of the union of ``dispatch``'s layer kinds under ``release``.

    Raises:
        SizeError: a flag the release itself cannot take (naming it): an
            unknown release, EP size above its ``kMaxRanks``, top_k above 22,
            a non-positive size, no ``--dispatch``.
    """
    _check_flags(
        release, ep_size, tokens, hidden, top_k, experts, dispatch, eplb_experts, extra_bytes
    )

    layers: list[LayerSize] = []
    needs: list[Capacities] = []
    refusals: list[str] = []
    for kind in dispatch:
        activation = activation_bytes(kind, hidden)
        if activation < hidden // 2:
            refusals.append(
                f"client: --dispatch={kind}: {activation} bytes per token is below hidden // 2 "
                f"= {hidden // 2}, which no dispatch row of hidden {hidden} can be"
            )
        need = layer_capacities(
            max_tokens=tokens,
            top_k=top_k,
            num_experts=experts,
            hidden_size=hidden,
            activation_bytes=activation + extra_bytes,
            eplb_experts=eplb_experts,
        )
        needs.append(need)
        layers.append(
            LayerSize(
                dispatch=kind,
                dispatch_bytes_per_token=need.dispatch_bytes_per_token,
                combine_bytes_per_token=need.combine_bytes_per_token,
                workspace_bytes_per_rank=_workspace(release, need, ep_size),
            )
        )
    union = reduce(join_capacities, needs)
    try:
        workspace = _workspace(release, union, ep_size)
    except sizing_moe_ep.LayoutError as error:
        raise SizeError(str(error)) from error
    refusals.extend(_plan_refusals(release, union, ep_size, top_k, experts, eplb_experts))
    return SizeAnswer(
        flashinfer=release,
        ep_size=ep_size,
        capacities=union,
        workspace_bytes_per_rank=workspace,
        layers=tuple(layers),
        kept_superseded_bytes_per_rank=_kept_bytes(release, needs, ep_size),
        refusals=tuple(refusals),
        described_as=sizing_moe_ep.describe(union) if release == "0.7.4" else None,
    )


def _check_flags(
    release: str,
    ep_size: int,
    tokens: int,
    hidden: int,
    top_k: int,
    experts: int,
    dispatch: tuple[str, ...],
    eplb_experts: int,
    extra_bytes: int,
) -> None:
    """Refuses the flags no release or not ``release`` can take.

    Raises:
        SizeError: an unknown release, a non-positive size, EP size above the
            release's ``kMaxRanks``, top_k above 22 or above the experts, a
            negative ``--eplb-experts`` or ``--extra-bytes``, tokens beyond an
            int32, no ``--dispatch``.
    """
    if release not in RELEASES:
        raise SizeError(f"--flashinfer={release!r}: must be one of {', '.join(RELEASES)}")
    for flag, value in (
        ("--ep", ep_size),
        ("--tokens", tokens),
        ("--hidden", hidden),
        ("--top-k", top_k),
        ("--experts", experts),
    ):
        _positive(flag, value)
    if ep_size > _MAX_RANKS[release]:
        raise SizeError(
            f"--ep={ep_size}: FlashInfer {release} takes at most {_MAX_RANKS[release]} ranks"
        )
    if top_k > KMAX_TOP_K:
        raise SizeError(f"--top-k={top_k}: FlashInfer takes at most {KMAX_TOP_K}")
    if top_k > experts:
        raise SizeError(f"--top-k={top_k}: exceeds --experts={experts}")
    if eplb_experts < 0:
        raise SizeError(f"--eplb-experts={eplb_experts}: must be non-negative")
    if extra_bytes < 0:
        raise SizeError(f"--extra-bytes={extra_bytes}: must be non-negative")
    if tokens > 2**31 - 1:
        raise SizeError(f"--tokens={tokens}: FlashInfer holds it in an int32")
    if not dispatch:
        raise SizeError("--dispatch: give at least one layer kind")


def _kept_bytes(release: str, needs: list[Capacities], ep_size: int) -> int:
    """Bytes per rank a manager that never frees keeps mapped: every growth in
    the given order stays."""
    kept, built = 0, None
    for need in needs:
        grown = need if built is None else join_capacities(built, need)
        if built is None or grown != built:
            kept += _workspace(release, grown, ep_size)
            built = grown
    return kept


def _plan_refusals(
    release: str, union: Capacities, ep_size: int, top_k: int, experts: int, eplb_experts: int
) -> list[str]:
    """What the sidecar and FlashInfer ``release`` would refuse of the plan."""
    refusals: list[str] = []
    if ep_size > MAX_EP_SIZE:
        refusals.append(f"sidecar: ep_size={ep_size}: {EP_SIZE_REASON}")
    try:
        check_capacities("plan", union, min(ep_size, MAX_EP_SIZE))
    except InvalidArgument as error:
        refusals.append(f"sidecar: {error}")
    if release == "0.7.4":
        reasons = sizing_moe_ep.object_refusals(ep_size, top_k, experts, eplb_experts)
    else:
        reasons = (
            (f"num_experts={experts} is not divisible by the EP size {ep_size}",)
            if experts % ep_size
            else ()
        )
    refusals.extend(f"FlashInfer {release}: {reason}" for reason in reasons)
    return refusals
