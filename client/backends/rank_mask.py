"""Membership masks for the all-to-all backends: checked, and turned into FlashInfer's words.

A mask is an ``int`` bitmask (bit ``i`` set = EP rank ``i`` a member), as
:func:`moe_sidecar.core.membership.mask` decides it; ``None`` means every
rank. FlashInfer takes it as a CPU ``uint64`` tensor of a release's
``rank_mask_words`` words (:attr:`moe_sidecar.flashinfer.Release.rank_mask_words`),
little-endian: word ``w`` holds ranks ``64 * w`` to ``64 * w + 63``. Its
kernels drop a token's copy for a masked rank (it is not re-routed) and
leave that rank's share out of each token's combined sum.

Everything here but :func:`rank_mask_tensor` is pure Python; nothing here
imports FlashInfer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "RankMaskError",
    "active_ranks",
    "all_ranks_mask",
    "check_rank_mask",
    "kernel_mask",
    "members",
    "rank_mask_from_tensor",
    "rank_mask_tensor",
    "rank_mask_words",
    "refuse_other_combine_mask",
]

_WORD_BITS = 64
_WORD = (1 << _WORD_BITS) - 1


class RankMaskError(ValueError):
    """An ``active_rank_mask`` (or ``enable_rank_mask``) a backend refuses.

    The message names the argument and its value. Raised before anything is
    sent: the all-to-all's state is as before the call.
    """


def all_ranks_mask(ep_size: int) -> int:
    """The mask with every rank of an EP group of ``ep_size`` a member."""
    return (1 << ep_size) - 1


def check_rank_mask(
    active_rank_mask: int | None, *, ep_size: int, ep_rank: int, enable_rank_mask: bool
) -> int | None:
    """``active_rank_mask`` checked for rank ``ep_rank`` of ``ep_size``.

    Returns None when the all-to-all was built without ``enable_rank_mask``
    (and no mask was given), else the mask, every rank's when
    ``active_rank_mask`` is None (FlashInfer's kernels with the mask
    compiled in need one on every call).

    Raises:
        RankMaskError: a mask on a build without ``enable_rank_mask``; not an
            ``int``; negative; with bits at or beyond ``ep_size``; or without
            ``ep_rank``'s own bit (a rank cannot mask itself out).
    """
    if active_rank_mask is None:
        return all_ranks_mask(ep_size) if enable_rank_mask else None
    if isinstance(active_rank_mask, bool) or not isinstance(active_rank_mask, int):
        raise RankMaskError(
            f"active_rank_mask={active_rank_mask!r}: must be an int bitmask (bit i = rank i "
            "a member) or None"
        )
    if not enable_rank_mask:
        raise RankMaskError(
            f"active_rank_mask={active_rank_mask:#x}: this all-to-all was built without "
            "enable_rank_mask (BuildSpec.enable_rank_mask=True builds kernels that take one)"
        )
    if active_rank_mask < 0 or active_rank_mask >> ep_size:
        raise RankMaskError(
            f"active_rank_mask={active_rank_mask:#x}: sets bits beyond ep_size={ep_size} "
            f"(must be in [1, {all_ranks_mask(ep_size):#x}])"
        )
    if not (active_rank_mask >> ep_rank) & 1:
        raise RankMaskError(
            f"active_rank_mask={active_rank_mask:#x}: masks out this rank's own bit "
            f"(ep_rank={ep_rank}); a rank cannot leave its own group"
        )
    return active_rank_mask


def active_ranks(active_rank_mask: int, ep_size: int) -> tuple[int, ...]:
    """The ranks of ``[0, ep_size)`` whose bit ``active_rank_mask`` sets, ascending."""
    return tuple(rank for rank in range(ep_size) if (active_rank_mask >> rank) & 1)


def rank_mask_words(active_rank_mask: int, words: int) -> tuple[int, ...]:
    """``active_rank_mask`` as ``words`` unsigned 64-bit words, lowest ranks first.

    Raises:
        RankMaskError: a negative mask, or one with bits beyond ``64 * words``
            (the release's EP limit).
    """
    if active_rank_mask < 0 or active_rank_mask >> (_WORD_BITS * words):
        raise RankMaskError(
            f"active_rank_mask={active_rank_mask:#x}: does not fit {words} 64-bit word(s) "
            f"(ranks 0 to {_WORD_BITS * words - 1})"
        )
    return tuple((active_rank_mask >> (_WORD_BITS * w)) & _WORD for w in range(words))


def rank_mask_tensor(active_rank_mask: int, words: int) -> torch.Tensor:
    """:func:`rank_mask_words` as the CPU ``uint64`` tensor FlashInfer's kernels read.

    Raises:
        RankMaskError: as :func:`rank_mask_words`.
    """
    return torch.tensor(rank_mask_words(active_rank_mask, words), dtype=torch.uint64)


def members(active_rank_mask: int | None, ep_size: int) -> tuple[int, ...] | None:
    """The ranks taking part under a checked ``active_rank_mask``; None when
    every rank does (no mask, or every rank's bit set)."""
    if active_rank_mask is None or active_rank_mask == all_ranks_mask(ep_size):
        return None
    return active_ranks(active_rank_mask, ep_size)


def rank_mask_from_tensor(active_rank_mask: torch.Tensor | int | None) -> int | None:
    """FlashInfer's form of a mask (a 1-D CPU ``uint64`` tensor of words,
    lowest ranks first) as an ``int``; an ``int`` or None as it is.

    Raises:
        RankMaskError: a tensor of another dtype, shape or device.
    """
    if not isinstance(active_rank_mask, torch.Tensor):
        return active_rank_mask
    if (
        active_rank_mask.dtype != torch.uint64
        or active_rank_mask.dim() != 1
        or active_rank_mask.device.type != "cpu"
    ):
        raise RankMaskError(
            f"active_rank_mask: must be a 1-D CPU uint64 tensor of 64-bit words, got "
            f"{active_rank_mask.dtype} {list(active_rank_mask.shape)} on {active_rank_mask.device}"
        )
    words = [int(word) for word in active_rank_mask.tolist()]
    return sum(word << (_WORD_BITS * w) for w, word in enumerate(words))


def kernel_mask(
    active_rank_mask: torch.Tensor | int | None,
    *,
    ep_size: int,
    ep_rank: int,
    enable_rank_mask: bool,
    words: int,
    build: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """What FlashInfer's kernels take for ``active_rank_mask`` (an ``int``,
    FlashInfer's words, or None): None on a build without the mask compiled
    in; else the release's ``words`` words, every rank's for None (its
    kernels with the mask compiled in need one on every call), made by the
    release's own ``build(active_ranks)`` when it has one.

    Raises:
        RankMaskError: as :func:`check_rank_mask` and :func:`rank_mask_words`.
    """
    mask = check_rank_mask(
        rank_mask_from_tensor(active_rank_mask),
        ep_size=ep_size,
        ep_rank=ep_rank,
        enable_rank_mask=enable_rank_mask,
    )
    if mask is None:
        return None
    tensor = rank_mask_tensor(mask, words)  # refuses a mask beyond the release's words
    return tensor if build is None else build(active_ranks(mask, ep_size))


def refuse_other_combine_mask(combine_mask: int | None, dispatch_mask: int | None) -> None:
    """Refuses a combine whose (checked) mask is not its dispatch's:
    FlashInfer's combine would wait on, or skip, other ranks than its dispatch.

    Raises:
        RankMaskError: the two differ.
    """
    if combine_mask != dispatch_mask:
        raise RankMaskError(
            f"active_rank_mask={combine_mask!r}: combine must take its dispatch's mask "
            f"({dispatch_mask!r})"
        )
