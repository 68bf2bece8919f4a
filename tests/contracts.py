"""vLLM's own tests of the one-sided manager, as bodies any manager can run.

Shared by the CPU tests (reference backend, with and without vLLM's process
groups) and the GPU tests (FlashInfer). Each one's docstring names
the vLLM file and test it comes from.

* :func:`v033_capacity_contract` is vLLM 0.33's grow test
  (``tests/distributed/test_mnnvl_alltoall.py``, "Share one workspace across
  hidden sizes without losing capacity."), its assertions verbatim from the
  line ``# A quantized-only layer reserves its actual dispatch row size.``
  on. The notes do not quote the lines before it; ``base_kwargs`` here use
  the values of the PR #42976 test (1024 tokens, hidden 4096, ``world_size
  * 8`` experts) with 0.33's ``top_k=4``, and ``nvfp4_kwargs``/``bf16_kwargs``
  are ``dispatch_format=QuantFormat.NVFP4``/``QuantFormat.BF16``.

:data:`QuantFormat` is FlashInfer 0.7.2.post1's enum, copied (names and
values; FlashInfer reads only ``.name``) for machines without FlashInfer;
the GPU tests pass FlashInfer's own.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["QuantFormat", "v033_capacity_contract"]


class QuantFormat(enum.Enum):
    """``flashinfer.fused_moe.api.QuantFormat`` of flashinfer-python 0.7.2.post1."""

    BF16 = 0
    FP16 = 1
    FP8PerTensor = 2
    DeepSeekFp8 = 3
    MXFP8 = 4
    NVFP4 = 5
    MXFP4 = 6
    MXINT4 = 7
    INT4 = 8


def v033_capacity_contract(manager: Any, world_size: int, quant_format: Any) -> dict[str, Any]:
    """Runs vLLM 0.33's grow-test assertions against ``manager`` (every rank).

    Returns the objects the test names (``original`` ... ``shared``) and the
    base arguments, for round trips afterwards.

    Raises:
        AssertionError: the manager differs from vLLM 0.33's contract.
    """
    QuantFormat = quant_format  # the test's own name for it
    base_kwargs = dict(
        max_num_tokens=1024,
        top_k=4,
        num_experts=world_size * 8,
        hidden_size=4096,
    )
    nvfp4_kwargs = dict(dispatch_format=QuantFormat.NVFP4)
    bf16_kwargs = dict(dispatch_format=QuantFormat.BF16)

    # --- verbatim from vLLM 0.33's test ---------------------------------
    # fmt: off
    # A quantized-only layer reserves its actual dispatch row size.
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    original = manager.get_communication()
    assert original.params.dispatch_format == QuantFormat.NVFP4
    assert original.params.dispatch_bytes_per_token == 4096 // 2 + 4096 // 16
    assert original.config.extra_payload_bytes_per_token == 0
    manager.initialize(**base_kwargs, **bf16_kwargs)
    bf16 = manager.get_communication()
    assert bf16 is not original
    assert bf16.params.dispatch_bytes_per_token == 8192

    # Token growth for a smaller format must retain earlier BF16 capacity.
    manager.initialize(**{**base_kwargs, "max_num_tokens": 2048}, **nvfp4_kwargs)
    grown = manager.get_communication()
    assert grown is not bf16
    assert grown.params.max_tokens_per_rank == 2048
    assert grown.params.dispatch_bytes_per_token == 8192

    # A BF16 row plus scales needs additional dispatch capacity.
    manager.initialize(**base_kwargs, extra_payload_bytes_per_token=256)
    with_scales = manager.get_communication()
    assert with_scales is not grown
    assert with_scales.params.max_tokens_per_rank == 2048
    assert with_scales.config.extra_payload_bytes_per_token == 256
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.get_communication() is with_scales

    # A smaller hidden size shares the existing instance, without shrinking it.
    manager.initialize(
        **{**base_kwargs, "hidden_size": 2048},
    )
    assert manager.get_communication() is with_scales

    # A wider NVFP4 layer needs more combine capacity, but fewer dispatch bytes
    # than the narrower BF16 layer. Preserve both requirements independently.
    manager.initialize(**{**base_kwargs, "hidden_size": 8192}, **nvfp4_kwargs)
    wider = manager.get_communication()
    assert wider is not with_scales
    assert wider.params.hidden_size == 8192
    assert wider.params.max_tokens_per_rank == 2048
    assert (
        wider.params.dispatch_bytes_per_token
        + wider.config.extra_payload_bytes_per_token
    ) == 8192 + 256

    # Smaller BF16 rows can increase dispatch capacity without changing the
    # largest hidden size or the combine capacity.
    manager.initialize(**{**base_kwargs, "hidden_size": 6144}, **bf16_kwargs)
    shared = manager.get_communication()
    assert shared.params.hidden_size == 8192
    assert shared.params.max_tokens_per_rank == 2048
    assert (
        shared.params.dispatch_bytes_per_token
        + shared.config.extra_payload_bytes_per_token
    ) == 6144 * 2
    # fmt: on
    # --- end of the verbatim part ---------------------------------------

    return {
        "base_kwargs": base_kwargs,
        "objects": [original, bf16, grown, with_scales, wider, shared],
        "shared": shared,
    }
