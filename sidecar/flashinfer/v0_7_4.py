"""FlashInfer 0.7.4's one-sided all-to-all workspace, in pure Python.

FlashInfer 0.7.4 removed ``MoeAlltoAll``; its one-sided all-to-all is
``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``, whose workspace layout comes
from the JIT op ``moe_a2a_get_workspace_layout`` (``calculateWorkspaceLayout``
in ``csrc/nvlink_one_sided_alltoall.cu``). Calling it loads FlashInfer's CUDA
module, which a CPU process must never do; this module is the same
arithmetic, byte for byte, with no import beyond the standard library and
the project's pure modules.

What is computed: the fence path, the only one on SM90 (H100/H200). CFT
counted writes and the Lamport transport (SM100 and newer) add regions;
the client's backend of this release turns both off (``cft=False, lamport=False``),
so every workspace it builds has this layout on every GPU.

Layout of one rank's workspace (``reserve`` aligns each region's start)::

    flag (4) | local token counter (4) | send counters (4*ep) | recv counters (2*4*ep)
    | @128 dispatch completion flags (4*ep)
    | @128 top-k target ranks (4*top_k*T) | @128 top-k target indices (4*top_k*T)
    | @128 EPLB gathered stats (4*ep*eplb) | @256 dispatch payloads (align256(dispatch))
    | @128 combine completion flags (4*ep) | @256 combine input (align256(combine))

``dispatch`` and ``combine`` are what ``NVLinkOneSidedAlltoAll.__init__``
passes: ``ep*T*(format bytes + 8*top_k + extra) + MAX_PAYLOADS*256`` and
``ep*T*hidden*2``. Unlike 0.7.2.post1, the top-k regions are sized by the
layer's ``top_k`` (not 22), and every region is fixed: a dispatch or combine
larger than its region fails in FlashInfer.

The union of several layers: a workspace is built for one
``(hidden, dispatch format, extra bytes)``, and FlashInfer shares workspaces
only between identical layouts. :func:`describe` expresses a union of
capacities (combine bytes ``2*hidden``, dispatch bytes ``activations +
scales + 8*top_k + extra``, the one per-layer rule of
:mod:`moe_sidecar.core.sizing`) as those parameters: the hidden size of
the widest combine, the largest format whose bytes fit the widest dispatch
row, and the rest as ``extra_payload_bytes_per_token``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from moe_sidecar.core.plan import Capacities
from moe_sidecar.core.sizing import (
    BF16_BYTES,
    INT32_BYTES,
    combine_bytes_per_token,
    dispatch_bytes_per_token,
    routing_bytes_per_token,
)
from moe_sidecar.flashinfer import v0_7_2_post1
from moe_sidecar.flashinfer.release import JitModuleFacts, LayoutError, Release

__all__ = [
    "CACHELINE_ALIGNMENT",
    "DISPATCH_FORMAT_BYTES",
    "FLASHINFER_VERSION",
    "MAX_PAYLOADS",
    "MAX_RANKS",
    "MAX_TOP_K",
    "RANK_MASK_WORDS",
    "RELEASE",
    "SUPPORTED_TOP_K",
    "WORKSPACE_ALIGNMENT",
    "Description",
    "LayoutError",
    "WorkspaceLayout",
    "capacities_workspace_bytes",
    "describe",
    "layer_layout",
    "object_refusals",
    "op_inputs",
    "workspace_layout",
]

FLASHINFER_VERSION: Final = "0.7.4"
DISPATCH_FORMAT_BYTES: Final = v0_7_2_post1.DISPATCH_FORMAT_BYTES
"""0.7.4's ``_DISPATCH_BYTES_PER_TOKEN``: unchanged from 0.7.2.post1's
(``tests/fi074`` reads it from the installed 0.7.4)."""
WORKSPACE_ALIGNMENT: Final = 256
"""``kWorkspaceAlignment`` (moeAlltoAllMeta.h): payload regions start and end on it."""
CACHELINE_ALIGNMENT: Final = 128
"""``kCachelineAlignment`` (nvlink_one_sided_alltoall.cu)."""
MAX_PAYLOADS: Final = 4
"""``kMaxPayloads``: the dispatch region reserves one alignment of padding per payload."""
MAX_RANKS: Final = 256
"""``kMaxRanks``: the layout refuses a larger EP group."""
RANK_MASK_WORDS: Final = 4
"""``kRankMaskWords`` (``moeAlltoAllKernels.h``): the words of ``active_rank_mask``
for :data:`MAX_RANKS` ranks (``NVLinkOneSidedAlltoAll.active_rank_mask`` builds
``(MAX_RANKS + 63) // 64`` of them)."""
MAX_TOP_K: Final = 22
"""``kMaxTopK``: the layout refuses a larger top_k."""
SUPPORTED_TOP_K: Final = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 22)
"""The top_k values ``NVLinkOneSidedAlltoAll`` accepts (its kernels' specializations);
the layout op itself takes 1 to 22."""
_INT32_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1

# The formats in order of preference when describing a union: the largest
# first, so the extra bytes that make up the rest stay small.
_DESCRIBE_ORDER: Final = ("BF16", "DeepSeekFp8", "MXFP8", "FP8PerTensor", "NVFP4", "MXFP4")


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def _check_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise LayoutError(f"{name}={value!r}: must be an int")


@dataclass(frozen=True)
class WorkspaceLayout:
    """One rank's workspace as ``moe_a2a_get_workspace_layout`` lays it out
    (fence path): region starts and capacities in bytes, FlashInfer's metainfo
    fields by name."""

    flag_val: int
    local_token_counter: int
    send_counters: int
    recv_counters: int
    dispatch_completion_flags: int
    topk_target_ranks: int
    topk_target_indices: int
    eplb_gathered_stats: int
    dispatch_payload: int
    dispatch_payload_size: int
    combine_completion_flags: int
    combine_input: int
    combine_input_size: int
    workspace_size: int
    """Bytes per rank before FlashInfer's allocator rounds them up."""


def workspace_layout(
    ep_size: int,
    max_num_tokens: int,
    top_k: int,
    dispatch_bytes: int,
    combine_input_bytes: int,
    eplb_stats_num_experts: int = 0,
) -> WorkspaceLayout:
    """FlashInfer 0.7.4's ``calculateWorkspaceLayout`` without CFT, byte for byte.

    Args:
        ep_size: ranks in the EP group (1 to 256).
        max_num_tokens: most tokens one rank dispatches (1 to 2**31-1).
        top_k: experts per token (1 to 22).
        dispatch_bytes: the dispatch region's bytes before alignment.
        combine_input_bytes: the combine region's bytes before alignment.
        eplb_stats_num_experts: experts whose statistics are gathered (0: none).

    Raises:
        LayoutError: a value FlashInfer's checks refuse, naming it.
    """
    _check_layout_inputs(
        ep_size, max_num_tokens, top_k, dispatch_bytes, combine_input_bytes, eplb_stats_num_experts
    )
    dispatch_size = _align(dispatch_bytes, WORKSPACE_ALIGNMENT)
    combine_size = _align(combine_input_bytes, WORKSPACE_ALIGNMENT)

    offset = 0
    starts: list[int] = []

    def reserve(size: int, alignment: int = INT32_BYTES) -> None:
        nonlocal offset
        offset = _align(offset, alignment)
        starts.append(offset)
        offset += size

    rank_counts = ep_size * INT32_BYTES
    reserve(INT32_BYTES)  # flag
    reserve(INT32_BYTES)  # local token counter
    reserve(rank_counts)  # send counters
    reserve(2 * rank_counts)  # recv counters, by round parity
    reserve(rank_counts, CACHELINE_ALIGNMENT)  # dispatch completion flags
    reserve(max_num_tokens * top_k * INT32_BYTES, CACHELINE_ALIGNMENT)  # top-k target ranks
    reserve(max_num_tokens * top_k * INT32_BYTES, CACHELINE_ALIGNMENT)  # top-k target indices
    reserve(ep_size * eplb_stats_num_experts * INT32_BYTES, CACHELINE_ALIGNMENT)  # EPLB stats
    reserve(dispatch_size, WORKSPACE_ALIGNMENT)  # dispatch payloads
    reserve(rank_counts, CACHELINE_ALIGNMENT)  # combine completion flags
    reserve(combine_size, WORKSPACE_ALIGNMENT)  # combine input
    if offset > _INT64_MAX:
        raise LayoutError(f"the workspace ({offset} bytes per rank) overflows int64")
    (flag, counter, send, recv, dflags, ranks, indices, eplb, dispatch, cflags, combine) = starts
    return WorkspaceLayout(
        flag_val=flag,
        local_token_counter=counter,
        send_counters=send,
        recv_counters=recv,
        dispatch_completion_flags=dflags,
        topk_target_ranks=ranks,
        topk_target_indices=indices,
        eplb_gathered_stats=eplb,
        dispatch_payload=dispatch,
        dispatch_payload_size=dispatch_size,
        combine_completion_flags=cflags,
        combine_input=combine,
        combine_input_size=combine_size,
        workspace_size=offset,
    )


def _check_layout_inputs(
    ep_size: int,
    max_num_tokens: int,
    top_k: int,
    dispatch_bytes: int,
    combine_input_bytes: int,
    eplb_stats_num_experts: int,
) -> None:
    """FlashInfer 0.7.4's checks of :func:`workspace_layout`'s arguments.

    Raises:
        LayoutError: a value out of FlashInfer's range, or not an int, naming it.
    """
    for name, value in (
        ("ep_size", ep_size),
        ("max_num_tokens", max_num_tokens),
        ("top_k", top_k),
        ("dispatch_bytes", dispatch_bytes),
        ("combine_input_bytes", combine_input_bytes),
        ("eplb_stats_num_experts", eplb_stats_num_experts),
    ):
        _check_int(name, value)
    if not 0 < ep_size <= MAX_RANKS:
        raise LayoutError(
            f"ep_size={ep_size}: FlashInfer {FLASHINFER_VERSION} takes 1 to {MAX_RANKS}"
        )
    if not 0 < max_num_tokens <= _INT32_MAX:
        raise LayoutError(f"max_num_tokens={max_num_tokens}: must be in 1..{_INT32_MAX}")
    if not 0 < top_k <= MAX_TOP_K:
        raise LayoutError(f"top_k={top_k}: FlashInfer {FLASHINFER_VERSION} takes 1 to {MAX_TOP_K}")
    if not 0 <= eplb_stats_num_experts <= _INT32_MAX:
        raise LayoutError(
            f"eplb_stats_num_experts={eplb_stats_num_experts}: must be in 0..{_INT32_MAX}"
        )
    for name, value in (
        ("dispatch_bytes", dispatch_bytes),
        ("combine_input_bytes", combine_input_bytes),
    ):
        if not 0 <= value <= _INT64_MAX - WORKSPACE_ALIGNMENT:
            raise LayoutError(f"{name}={value}: not a workspace payload capacity")


def _format_bytes(dispatch_format: str, hidden_size: int) -> int:
    return RELEASE.format_bytes(dispatch_format, hidden_size)


def op_inputs(
    ep_size: int,
    max_tokens_per_rank: int,
    top_k: int,
    hidden_size: int,
    dispatch_format: str,
    extra_payload_bytes_per_token: int = 0,
) -> tuple[int, int]:
    """``(dispatch_bytes, combine_input_bytes)``: what ``NVLinkOneSidedAlltoAll.__init__``
    passes to the layout op for bf16 tokens (``dtype=torch.bfloat16``).

    ``dispatch_format`` is a ``QuantFormat`` name (``"BF16"`` for unquantized rows).

    Raises:
        LayoutError: an unknown format or a negative size.
    """
    for name, value in (
        ("ep_size", ep_size),
        ("max_tokens_per_rank", max_tokens_per_rank),
        ("top_k", top_k),
        ("hidden_size", hidden_size),
        ("extra_payload_bytes_per_token", extra_payload_bytes_per_token),
    ):
        _check_int(name, value)
        if value < 0:
            raise LayoutError(f"{name}={value}: must be non-negative")
    rows = ep_size * max_tokens_per_rank
    # FlashInfer's payloads are the core's per-layer rule: the format's row
    # and scales, the int32 expert ids and float32 weights of the routing,
    # the extra bytes; bf16 rows to combine.
    per_token = dispatch_bytes_per_token(
        top_k,
        _format_bytes(dispatch_format, hidden_size),
        extra_payload_bytes_per_token=extra_payload_bytes_per_token,
    )
    return (
        rows * per_token + MAX_PAYLOADS * WORKSPACE_ALIGNMENT,
        rows * combine_bytes_per_token(hidden_size),
    )


def layer_layout(
    ep_size: int,
    max_tokens_per_rank: int,
    top_k: int,
    hidden_size: int,
    dispatch_format: str,
    extra_payload_bytes_per_token: int = 0,
    eplb_stats_num_experts: int = 0,
) -> WorkspaceLayout:
    """The layout of an ``NVLinkOneSidedAlltoAll`` built for one layer (fence path).

    Raises:
        LayoutError: FlashInfer's layout refuses it.
    """
    dispatch, combine = op_inputs(
        ep_size,
        max_tokens_per_rank,
        top_k,
        hidden_size,
        dispatch_format,
        extra_payload_bytes_per_token,
    )
    return workspace_layout(
        ep_size, max_tokens_per_rank, top_k, dispatch, combine, eplb_stats_num_experts
    )


@dataclass(frozen=True)
class Description:
    """The ``MoEEpCommParams``/``NVLinkOneSidedConfig`` fields that build a
    workspace serving a union of capacities."""

    max_tokens_per_rank: int
    top_k: int
    num_experts: int
    hidden_size: int
    """Half the combine bytes, rounded up: the combine region holds bf16 rows of it."""
    dispatch_format: str
    """A ``QuantFormat`` name: the largest whose bytes fit the dispatch row."""
    extra_payload_bytes_per_token: int
    """The rest of the dispatch row."""
    eplb_stats_num_experts: int

    @property
    def dispatch_bytes_per_token(self) -> int:
        """What the built workspace holds per token: format + routing + extra."""
        return dispatch_bytes_per_token(
            self.top_k,
            _format_bytes(self.dispatch_format, self.hidden_size),
            extra_payload_bytes_per_token=self.extra_payload_bytes_per_token,
        )


def describe(capacities: Capacities) -> Description:
    """How the 0.7.4 backend builds ``capacities``: one layout serving every layer.

    The dispatch row it builds is ``max(capacities' dispatch bytes, smallest
    format + 8*top_k)``: never less than asked, exactly as asked whenever the
    row holds at least an MXFP4 row of the hidden size (any layer of that
    hidden size does).

    Raises:
        LayoutError: ``max_tokens``, ``top_k`` or ``num_experts`` is not positive.
    """
    for name in ("max_tokens", "top_k", "num_experts"):
        value = getattr(capacities, name)
        if value <= 0:
            raise LayoutError(f"{name}={value}: must be positive")
    hidden = max(1, -(-capacities.combine_bytes_per_token // BF16_BYTES))
    activation = capacities.dispatch_bytes_per_token - routing_bytes_per_token(capacities.top_k)
    fitting = [f for f in _DESCRIBE_ORDER if _format_bytes(f, hidden) <= activation]
    chosen = fitting[0] if fitting else _DESCRIBE_ORDER[-1]
    return Description(
        max_tokens_per_rank=capacities.max_tokens,
        top_k=capacities.top_k,
        num_experts=capacities.num_experts,
        hidden_size=hidden,
        dispatch_format=chosen,
        extra_payload_bytes_per_token=max(0, activation - _format_bytes(chosen, hidden)),
        eplb_stats_num_experts=capacities.eplb_experts,
    )


def capacities_workspace_bytes(capacities: Capacities, ep_size: int) -> int:
    """Per-rank bytes of the workspace the 0.7.4 backend builds for ``capacities``
    (FlashInfer's ``WORKSPACE_SIZE``, before its allocator rounds it).

    Raises:
        LayoutError: FlashInfer's layout refuses it.
    """
    d = describe(capacities)
    return layer_layout(
        ep_size,
        d.max_tokens_per_rank,
        d.top_k,
        d.hidden_size,
        d.dispatch_format,
        d.extra_payload_bytes_per_token,
        d.eplb_stats_num_experts,
    ).workspace_size


def object_refusals(
    ep_size: int, top_k: int, num_experts: int, eplb_stats_num_experts: int
) -> tuple[str, ...]:
    """Why ``NVLinkOneSidedAlltoAll`` itself (beyond its layout) would refuse
    these (empty: it would not): its top_k specializations, ``num_experts``
    divisible by the EP size and at least ``top_k``, EPLB statistics of at
    most ``num_experts`` experts."""
    reasons = []
    if top_k not in SUPPORTED_TOP_K:
        reasons.append(f"top_k={top_k}: NVLinkOneSidedAlltoAll supports top_k in {SUPPORTED_TOP_K}")
    if top_k > num_experts:
        reasons.append(f"top_k={top_k} exceeds num_experts={num_experts}")
    if num_experts % ep_size:
        reasons.append(f"num_experts={num_experts} is not divisible by the EP size {ep_size}")
    if not 0 <= eplb_stats_num_experts <= num_experts:
        reasons.append(
            f"eplb_stats_num_experts={eplb_stats_num_experts} must be in [0, num_experts={num_experts}]"
        )
    return tuple(reasons)


RELEASE: Final = Release(
    name=FLASHINFER_VERSION,
    versions=(FLASHINFER_VERSION,),
    backend="flashinfer-moe-ep",
    api="flashinfer.moe_ep.NVLinkOneSidedAlltoAll",
    max_ranks=MAX_RANKS,
    rank_mask_words=RANK_MASK_WORDS,
    max_top_k=MAX_TOP_K,
    supported_top_k=SUPPORTED_TOP_K,
    dispatch_format_bytes=DISPATCH_FORMAT_BYTES,
    jit_module=JitModuleFacts(
        name="nvlink_one_sided_alltoall",
        sources=(
            "data/csrc/nvlink_one_sided_alltoall.cu",
            "data/csrc/nvlink_one_sided_lamport.cu",
        ),
        spec_factory="flashinfer.jit.comm:gen_nvlink_one_sided_alltoall_module",
        role="the all-to-all of the client's flashinfer-moe-ep backend",
    ),
    workspace_size=capacities_workspace_bytes,
    object_refusals=object_refusals,
    install_extra="flashinfer074",
)
"""FlashInfer 0.7.4: ``MoeAlltoAll`` removed, ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``,
JIT module ``nvlink_one_sided_alltoall`` (83 s to compile on an H200 host; 0.7.4
lays out the JIT cache as 0.7.2.post1 does)."""
