"""FlashInfer's workspace arithmetic, as the client names it (DESIGN section 3).

The arithmetic lives in :mod:`moe_sidecar.sizing`, which imports nothing but the
standard library, because the decision core needs it too (to size a plan
that serves every layer) and must not import torch through this package.
"""

from moe_sidecar.sizing import (
    ALIGNMENT,
    KMAX_TOP_K,
    AuxOffsets,
    LayerSizes,
    align,
    aux_data_size,
    aux_offsets,
    combine_bytes_per_token,
    dispatch_bytes_per_token,
    layer_sizes,
    payload_bytes,
    workspace_for_payload,
    workspace_size_per_rank,
)

__all__ = [
    "ALIGNMENT",
    "KMAX_TOP_K",
    "AuxOffsets",
    "LayerSizes",
    "align",
    "aux_data_size",
    "aux_offsets",
    "combine_bytes_per_token",
    "dispatch_bytes_per_token",
    "layer_sizes",
    "payload_bytes",
    "workspace_for_payload",
    "workspace_size_per_rank",
]
