"""SGLang 0.5.23's own code, on 2 CPU ranks, running moe-sidecar's adapter.

Each rank runs :func:`tests.sglang.workers.sglang_rank` against a real sidecar
on a Unix socket (the reference backend): SGLang's plugin loader finds the
entry point, SGLang's factory builds the dispatchers (our subclass), the
decided plans are the exact sizes (NVFP4 target, bf16 MTP draft) rather than
SGLang's bf16 ones, SGLang's dispatch/combine run on what was built, a
layer loaded with SGLang's startup overlap is sized for bf16 rows, and a
growth after sealing is refused without changing anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.client.engines.sglang.sizing import (
    DispatchType,
    Namespace,
    engine_workspace_bytes,
    exact_workspace_bytes,
    layer_dispatch_bytes,
)
from tests.multiprocess.harness import run_ranks, running_sidecar
from tests.sglang.model_config import HIDDEN, TOP_K, write_model

pytestmark = [pytest.mark.sglang, pytest.mark.multiprocess, pytest.mark.timeout(420)]

EP = 2
TOKENS = 256
"""SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK: SGLang's own token bound."""
LAYOUT = ":modelopt_fp4/tp2-pp1-dp2-ep2/pp0"
"""What names the groups after the model path (SGLang's topology)."""


def _names(model: Path) -> tuple[str, str]:
    return f"{model}{LAYOUT}/decode", f"{model}{LAYOUT}/speculative"


def _run(tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    model = write_model(tmp_path / "model")
    with running_sidecar(tmp_path / "sidecar", round_timeout=60.0) as sidecar:
        env = {
            "MOE_SIDECAR_BACKEND": "reference",
            "MOE_SIDECAR_TARGET": sidecar.target,
            "MOE_SIDECAR_GROUP": "",
            "MOE_SIDECAR_SGLANG": "",
            "HF_HUB_OFFLINE": "1",
            "SGLANG_MOE_NVFP4_DISPATCH": "1",
            "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK": str(TOKENS),
        }
        from tests.sglang import workers

        results = run_ranks(
            workers.sglang_rank,
            EP,
            timeout=360,
            tmp_path=tmp_path / "ranks",
            args=(str(model),),
            envs=[env] * EP,
        )
        groups = {name: sidecar.get_group(name) for name in _names(model)}
    return results, groups


def test_sglang_dispatchers_sized_exactly_through_a_sidecar(tmp_path: Path) -> None:
    results, groups = _run(tmp_path)
    decode, speculative = _names(tmp_path / "model")
    nvfp4 = exact_workspace_bytes(
        EP, TOKENS, TOP_K, [(HIDDEN, DispatchType.NVFP4)], Namespace.DECODE
    )
    bf16 = exact_workspace_bytes(
        EP, TOKENS, TOP_K, [(HIDDEN, DispatchType.BF16)], Namespace.SPECULATIVE
    )
    sglang_own = engine_workspace_bytes(
        EP, TOKENS, HIDDEN, TOP_K, DispatchType.NVFP4, Namespace.DECODE, eagle=True
    )
    for rank, result in enumerate(results):
        assert result["replaced"], rank
        assert result["factory_module_sees_it"], rank
        assert result["load_model_hooked"] and result["init_cuda_graphs_hooked"], rank
        assert result["target_is_ours"], rank
        # SGLang's own __init__ ran: its size is bf16 rows (NEXTN is EAGLE).
        assert result["sglang_max_tokens"] == TOKENS
        assert result["sglang_target_size"] == sglang_own
        assert result["sglang_draft_size"] == sglang_own
        assert result["draft_namespace"] == int(Namespace.SPECULATIVE)
        target = result["after_target"][decode]
        assert target["dispatch_bytes"] == layer_dispatch_bytes(HIDDEN, TOP_K, DispatchType.NVFP4)
        assert target["workspace_size"] == nvfp4 < sglang_own
        # Three NVFP4 layers: one build, the others covered.
        assert (target["builds"], target["rebuilds"]) == (1, 0)
        draft = result["groups"][speculative]
        assert draft["workspace_size"] == bf16 == sglang_own + 128
        assert result["groups"][decode] == target
        assert result["installed"] == [decode] * 3 + [speculative]
        e2e = result["end_to_end"]
        assert e2e["combined_equal"], (rank, e2e)
        assert e2e["dispatch_rows"] == [EP * max(3, 5), HIDDEN]
        assert e2e["dispatch_dtype"] == "torch.bfloat16"
        refusal = result["sealed_refusal"]
        assert refusal is not None and "CUDA graphs were already captured" in refusal, refusal
        assert "BF16 rows" in refusal and repr(decode) in refusal
        overlap = result["overlap"]
        assert overlap is not None and overlap["dispatch_bytes"] == layer_dispatch_bytes(
            HIDDEN, TOP_K, DispatchType.BF16
        )
        assert result["after_refusal"] == result["before_seal"]
    assert groups[decode].plan.capacities.dispatch_bytes_per_token == layer_dispatch_bytes(
        HIDDEN, TOP_K, DispatchType.NVFP4
    )
    assert groups[speculative].plan.capacities.dispatch_bytes_per_token == layer_dispatch_bytes(
        HIDDEN, TOP_K, DispatchType.BF16
    )
