"""SGLang 0.5.23's FlashInfer all-to-all sizes: SGLang's own, and exactly per layer.

Pure: the standard library and the project's pure modules only (no torch,
no FlashInfer, no SGLang), so ``moe-sidecar size --engine sglang`` and the
table-driven tests read it where none of them is installed.

SGLang's ``FlashinferDispatcher.__init__`` (``sglang/srt/layers/moe/
token_dispatcher/flashinfer.py``) sizes every workspace before any weight is
loaded, so before it knows a layer's real dispatch format:

* with a speculative algorithm of the EAGLE family (NEXTN is an alias of
  EAGLE) it sizes bf16 rows for every layer (``can_use_quantized_dispatch =
  not speculative_algo.is_eagle()``), NVFP4 target layers included;
* otherwise, with an NVFP4 or MXFP8 dispatch type, ``max(quantized, bf16)``:
  bf16 rows again, since a quantized row is never the larger;
* the combine row is always bf16 (``2 * hidden`` bytes).

At run time a layer dispatches the format of ``_effective_dispatch_type()``:
NVFP4 only when its quant config carries ``input_global_scale``, MXFP8 only
with ``use_mxfp8``, else bf16 (:func:`effective_dispatch`). The exact size of
a namespace is the union of its layers' rows (:func:`exact_workspace_bytes`).

Each workspace namespace (decode, speculative, SP prefill) adds
``128 * namespace`` bytes to its size (``_workspace_size_for_namespace``), so
FlashInfer's workspace cache, keyed by size, keeps concurrently live paths
apart; the exact sizes keep that padding (:func:`namespace_padding`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.sizing import combine_bytes_per_token
from moe_sidecar.flashinfer.v0_7_2_post1 import DISPATCH_FORMAT_BYTES, workspace_size_per_rank

__all__ = [
    "NAMESPACE_ALIGNMENT",
    "SGLANG_VERSION",
    "DispatchType",
    "Namespace",
    "NamespaceSize",
    "effective_dispatch",
    "engine_dispatch_bytes",
    "engine_workspace_bytes",
    "exact_workspace_bytes",
    "layer_dispatch_bytes",
    "namespace_padding",
    "row_bytes",
]

SGLANG_VERSION: Final = "0.5.23"
"""The SGLang release whose sizing this module reproduces."""

NAMESPACE_ALIGNMENT: Final = 128
"""SGLang's ``_WORKSPACE_NAMESPACE_ALIGNMENT``: bytes added per namespace index."""


class Namespace(enum.IntEnum):
    """SGLang's ``_WorkspaceNamespace``: one workspace each."""

    DECODE = 0
    SPECULATIVE = 1
    SP_PREFILL = 2


class DispatchType(enum.Enum):
    """SGLang's ``FlashinferA2ADispatchType``; the value is the FlashInfer
    ``QuantFormat`` name the client's manager takes (None: bf16 rows)."""

    BF16 = None
    NVFP4 = "NVFP4"
    MXFP8 = "MXFP8"


def _routing_bytes(top_k: int) -> int:
    # int32 expert ids and float32 weights, as SGLang's topk_id_and_weight_bytes.
    return 8 * top_k


def row_bytes(hidden_size: int, dispatch: DispatchType) -> int:
    """Bytes of one token's ``dispatch`` row: activations and scales, routing excluded."""
    if dispatch.value is None:
        return 2 * hidden_size
    return DISPATCH_FORMAT_BYTES[dispatch.value](hidden_size)


def layer_dispatch_bytes(hidden_size: int, top_k: int, dispatch: DispatchType) -> int:
    """Dispatch bytes per token of one layer sending ``dispatch`` rows."""
    return row_bytes(hidden_size, dispatch) + _routing_bytes(top_k)


def engine_dispatch_bytes(
    hidden_size: int, top_k: int, dispatch_type: DispatchType, *, eagle: bool
) -> int:
    """Dispatch bytes per token SGLang sizes for (see the module docstring):
    bf16 rows with an EAGLE-family algorithm, else ``max(quantized, bf16)``."""
    bf16 = layer_dispatch_bytes(hidden_size, top_k, DispatchType.BF16)
    if eagle or dispatch_type is DispatchType.BF16:
        return bf16
    return max(layer_dispatch_bytes(hidden_size, top_k, dispatch_type), bf16)


def effective_dispatch(
    dispatch_type: DispatchType, *, has_input_global_scale: bool, uses_mxfp8: bool
) -> DispatchType:
    """The rows a layer dispatches at run time: SGLang's
    ``_effective_dispatch_type()`` on its loaded quant config."""
    if dispatch_type is DispatchType.NVFP4 and not has_input_global_scale:
        return DispatchType.BF16
    if dispatch_type is DispatchType.MXFP8 and not uses_mxfp8:
        return DispatchType.BF16
    return dispatch_type


def namespace_padding(namespace: Namespace) -> int:
    """Bytes SGLang adds to a workspace of ``namespace``."""
    return int(namespace) * NAMESPACE_ALIGNMENT


def engine_workspace_bytes(
    ep_size: int,
    max_num_tokens: int,
    hidden_size: int,
    top_k: int,
    dispatch_type: DispatchType,
    namespace: Namespace,
    *,
    eagle: bool,
) -> int:
    """Per-rank bytes of one workspace as SGLang 0.5.23 maps it by itself."""
    return workspace_size_per_rank(
        ep_size,
        max_num_tokens,
        engine_dispatch_bytes(hidden_size, top_k, dispatch_type, eagle=eagle),
        combine_bytes_per_token(hidden_size),
    ) + namespace_padding(namespace)


def exact_workspace_bytes(
    ep_size: int,
    max_num_tokens: int,
    top_k: int,
    layers: Iterable[tuple[int, DispatchType]],
    namespace: Namespace,
) -> int:
    """Per-rank bytes of one namespace sized at the union of its layers
    (``(hidden_size, rows)`` each), SGLang's padding kept.

    Raises:
        InvalidArgument: no layers.
    """
    rows = list(layers)
    if not rows:
        raise InvalidArgument.of("layers", rows, "a namespace needs at least one MoE layer")
    dispatch = max(layer_dispatch_bytes(hidden, top_k, kind) for hidden, kind in rows)
    combine = max(combine_bytes_per_token(hidden) for hidden, _ in rows)
    return workspace_size_per_rank(ep_size, max_num_tokens, dispatch, combine) + namespace_padding(
        namespace
    )


@dataclass(frozen=True)
class NamespaceSize:
    """One namespace's workspace per rank: SGLang's and the exact one."""

    namespace: Namespace
    engine_bytes_per_rank: int
    exact_bytes_per_rank: int

    @property
    def saved_bytes_per_rank(self) -> int:
        """What sizing exactly leaves to SGLang's KV cache."""
        return self.engine_bytes_per_rank - self.exact_bytes_per_rank
