"""How a bench rank steps either FlashInfer release's all-to-all (or the CPU
reference as either): its device, the client backend a bench backend
name stands for, one dispatch and one combine through whichever object
is stepped, and one step of ``bench/masked_routing.py``'s routing checked
against its expected combine (:func:`checked_step`). Imports torch (and
FlashInfer) only when called.

Two forms: 0.7.2.post1's ``MoeAlltoAll`` is dispatched and combined through
its own calls (``flashinfer-moe-alltoall``, ``reference``); 0.7.4's is
stepped through its ``moe_ep`` object, ``NVLinkOneSidedAlltoAll``
(``flashinfer-moe-ep``; ``reference-moe-ep`` is the CPU reference's
``moe_ep`` object, stepped the same way).

0.7.4's ``moe_ep`` classes refuse a single GPU in their platform vote
(``nvlink_platform_supported``: no NVLink peers); when every rank shares the
one visible GPU, :func:`device` stands in for that vote under both names
0.7.4 reads it, and says so (the bench scripts report it as
``vote_stood_in_for``). Used by ``bench/masked_steps_gpu.py``,
``bench/peer_loss_gpu.py`` and ``bench/rejoin_gpu.py``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.masked_routing import Shape

__all__ = [
    "BACKENDS",
    "VOTE_MODULES",
    "Stepper",
    "checked_step",
    "client_backend",
    "combine",
    "device",
    "dispatch",
    "is_moe_ep",
    "resolve",
]

BACKENDS = ("auto", "flashinfer-moe-alltoall", "flashinfer-moe-ep", "reference", "reference-moe-ep")
"""``auto``: the client's choice from the installed FlashInfer; ``reference-moe-ep``:
the CPU reference stepped through its ``moe_ep`` object, as 0.7.4's is."""
VOTE_MODULES = (
    "flashinfer.moe_ep.backends.split.comm.nvlink_common",
    "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.communication",
)
"""Where FlashInfer 0.7.4 reads ``nvlink_platform_supported`` (both are used)."""


def resolve(backend: str) -> str:
    """``backend`` with ``auto`` replaced by the installed FlashInfer's backend name."""
    if backend != "auto":
        return backend
    from moe_sidecar.client.backends import flashinfer_backend_name

    return str(flashinfer_backend_name())


def is_moe_ep(backend: str) -> bool:
    """Whether ``backend`` is stepped through its ``moe_ep`` object."""
    return backend.endswith("moe-ep")


def client_backend(backend: str) -> str:
    """The client's backend name for a bench one (``reference-moe-ep`` is the
    client's ``reference``, stepped through its ``moe_ep`` object)."""
    return "reference" if backend == "reference-moe-ep" else backend


def device(rank: int, backend: str) -> tuple[Any, bool]:
    """This rank's device (rank r on ``cuda:r % count``; the CPU for a
    reference backend); whether 0.7.4's platform vote was stood in for (only
    ``flashinfer-moe-ep`` with one GPU visible, every rank sharing it)."""
    import torch

    if backend.startswith("reference"):
        return torch.device("cpu"), False
    count = torch.cuda.device_count()
    torch.cuda.set_device(rank % count)
    stood_in = backend == "flashinfer-moe-ep" and count == 1
    if stood_in:
        for name in VOTE_MODULES:
            setattr(importlib.import_module(name), "nvlink_platform_supported", lambda: True)  # noqa: B010
    torch.ones(1, device="cuda").sum().item()
    return torch.device("cuda", torch.cuda.current_device()), stood_in


def dispatch(
    stepped: Any, moe_ep: bool, values: Any, ids: Any, weights: Any, tokens: int, mask: int | None
) -> tuple[Any, Any, Any]:
    """One dispatch of ``values`` (bf16 ``[tokens, hidden]``) to the experts
    ``ids`` (int32 ``[tokens, top_k]``) with ``weights``; ``mask``: the active
    ranks (None: every rank, no mask given). The received (rows, expert ids,
    weights), rank-major; collective."""
    from bench.masked_routing import INVALID_EXPERT

    if moe_ep:
        result = stepped.dispatch(
            values, ids, weights, max_tokens_per_rank=tokens, active_rank_mask=mask
        )
        return result.hidden_states, result.topk_ids, result.topk_weights
    rows, received_ids, received_weights = stepped.dispatch(
        ids, [values, ids, weights], tokens, INVALID_EXPERT, 1, active_rank_mask=mask
    )
    return rows, received_ids, received_weights


def combine(stepped: Any, moe_ep: bool, expert_out: Any, tokens: int, mask: int | None) -> Any:
    """One combine of ``expert_out`` (the dispatch's rows' shape) back onto
    each token's source rank, under the dispatch's ``mask``; collective."""
    if moe_ep:
        return stepped.combine(expert_out, active_rank_mask=mask)
    return stepped.combine(expert_out, tokens, active_rank_mask=mask)


@dataclass(frozen=True)
class Stepper:
    """What one rank steps: the all-to-all (or its ``moe_ep`` object), where."""

    stepped: Any
    moe_ep: bool
    device: Any
    shape: Shape
    rank: int
    world: int


def checked_step(
    stepper: Stepper, seed: int, masked: set[int], *, name_mask: bool = True
) -> dict[str, Any]:
    """One dispatch + experts + combine of the routing of
    ``bench/masked_routing.py`` under the mask without the ``masked`` ranks
    (none: every rank, no mask given); the combine's differences from the
    expected values. ``name_mask=False`` passes no mask (``mask`` None):
    the stepped object supplies it, as the manager's does under a view."""
    import torch

    from bench import masked_routing as routing

    stepped, moe_ep, device = stepper.stepped, stepper.moe_ep, stepper.device
    shape, rank, world = stepper.shape, stepper.rank, stepper.world
    inputs = {k: v.to(device) for k, v in routing.step_inputs(shape, rank, seed).items()}
    named = name_mask and bool(masked)
    mask = ((1 << world) - 1) & ~sum(1 << r for r in masked) if named else None
    values = inputs["values"].to(torch.bfloat16)
    rows, ids, weights = dispatch(
        stepped, moe_ep, values, inputs["ids"], inputs["weights"], shape.tokens, mask
    )
    received = int((ids != routing.INVALID_EXPERT).any(dim=-1).sum())
    expert_out = routing.expert_output(shape, rank, world, rows, ids, weights).contiguous()
    combined = combine(stepped, moe_ep, expert_out, shape.tokens, mask)
    if device.type == "cuda":
        torch.cuda.synchronize()
    want = routing.expected_combine(shape, rank, seed, world, masked)
    got = combined.to("cpu", torch.float32)
    live = [s for s in range(world) if s not in masked]
    return {
        "seed": seed,
        "mask": mask,
        "combine_error": float((got - want).abs().max()),
        "mismatched_values": int((got != want).sum()),
        "dropped_share": routing.dropped_share(shape, rank, seed, world, masked),
        "rows_received": received,
        "rows_from_members": sum(
            routing.expected_rows(shape, s, rank, seed, world).size(0) for s in live
        ),
    }
