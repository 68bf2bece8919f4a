"""vLLM's own code, on 2 CPU ranks, running moe-sidecar's manager.

In each rank: vLLM's ``load_general_plugins()`` (which finds our entry
point), vLLM's process groups built by vLLM's test helper, then

* the statement vLLM's ``CudaCommunicator`` runs to build the manager, on
  vLLM's EP group: the object is ours, a subclass of vLLM's class;
* vLLM PR #42976's regression test body, verbatim, and its 0.30 version;
* vLLM 0.33's grow-test assertions on the EP group, then vLLM 0.33's own
  ``FlashInferNVLinkOneSidedPrepareAndFinalize`` (the class that asserts
  ``isinstance``) initializing a layer with 0.33's call-site keywords and
  running a real ``prepare()``/``finalize()`` through ``get_communication()``;

with the reference backend, in sidecar mode (a real sidecar on a Unix
socket) and in embedded mode. Every workspace is FlashInfer's size for what
that vLLM version computes (each version's arithmetic is written out below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from moe_sidecar.flashinfer.v0_7_2_post1 import workspace_size_per_rank
from tests.multiprocess.harness import Sidecar, free_port, run_ranks, running_sidecar
from tests.vllm.conftest import vllm_release

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(420)]

EP = 2
VLLM_GROUP = "unknown-model:unquantized/tp1-pp1-dp2-ep2/pp0"
"""What naming derives inside vLLM's groups with no model config current."""


def pr42976_size(tokens: int, top_k: int, hidden: int, code: int, scale: int) -> int:
    """PR #42976's FlashInferNVLinkOneSidedManager.initialize(), its arithmetic."""
    hidden_bytes = hidden // 2 if code == 0 else hidden * code
    dispatch = hidden_bytes + scale + top_k * 4 + top_k * 4
    return workspace_size_per_rank(EP, tokens, dispatch, hidden * 2)


def v033_size(tokens: int, top_k: int, hidden: int, row_bytes: int) -> int:
    """FlashInfer's NVLinkOneSidedAlltoAll.__init__ for vLLM 0.33's params:
    ``row_bytes`` is ``params.dispatch_bytes_per_token + extra``."""
    return workspace_size_per_rank(EP, tokens, row_bytes + top_k * 4 + top_k * 4, hidden * 2)


def _run(mode: str, tmp_path: Path, sidecar: Sidecar | None) -> list[dict[str, Any]]:
    env = {"MOE_SIDECAR_BACKEND": "reference", "MOE_SIDECAR_GROUP": ""}
    if sidecar is not None:
        env |= {"MOE_SIDECAR_TARGET": sidecar.target, "MOE_SIDECAR_VLLM": ""}
    else:
        env |= {"MOE_SIDECAR_TARGET": "", "MOE_SIDECAR_VLLM": "1"}
    from tests.vllm import workers

    return run_ranks(
        workers.vllm_rank,
        EP,
        timeout=360,
        tmp_path=tmp_path / "ranks",
        args=(free_port(), mode),
        envs=[env] * EP,
    )


@pytest.mark.parametrize("mode", ["sidecar", "embedded"])
def test_vllm_code_against_the_manager(mode: str, tmp_path: Path) -> None:
    if mode == "sidecar":
        with running_sidecar(tmp_path / "sidecar", round_timeout=60.0) as sidecar:
            results = _run(mode, tmp_path, sidecar)
            groups = {
                name: sidecar.get_group(name)
                for name in (VLLM_GROUP, "vllm-test:sidecar/v030", "vllm-test:sidecar/v033")
            }
    else:
        results = _run(mode, tmp_path, None)

    nvfp4 = pr42976_size(1024, 2, 4096, 0, 4096 // 16)
    bf16 = pr42976_size(1024, 2, 4096, 2, 0)
    # vLLM 0.33's rebuilds in its grow test: (tokens, hidden, dispatch row) at each.
    v033_builds = [
        v033_size(1024, 4, 4096, 4096 // 2 + 4096 // 16),
        v033_size(1024, 4, 4096, 8192),
        v033_size(2048, 4, 4096, 8192),
        v033_size(2048, 4, 4096, 8192 + 256),
        v033_size(2048, 4, 8192, 8192 + 256),
        v033_size(2048, 4, 8192, 6144 * 2),
    ]
    for rank, result in enumerate(results):
        failed = {name: part["error"] for name, part in result.items() if not part["ok"]}
        assert not failed, f"rank {rank}:\n" + "\n".join(f"[{n}]\n{e}" for n, e in failed.items())

        built = result["constructed"]["value"]
        assert built["class"] == "MoeSidecarOneSidedManager" and built["is_module_attribute"]
        # Ours first (the plugin's class, vLLM's room's manager, the
        # engine-neutral one), then vLLM's.
        assert built["mro"][1:4] == [
            "moe_sidecar.client.engines.vllm.plugin.VllmManager",
            "moe_sidecar.client.engines.vllm.manager.WorkspaceManager",
            "moe_sidecar.client.manager.AlltoAllManager",
        ]
        assert built["mro"][4:6] == [
            "vllm.distributed.device_communicators.all2all.FlashInferNVLinkOneSidedManager",
            "vllm.distributed.device_communicators.base_device_communicator.All2AllManagerBase",
        ]
        assert built["generation"] == "vLLM 0.33"
        assert built["embedded"] == (mode == "embedded")
        assert built["group"] == VLLM_GROUP
        assert built["rank"] == (rank, EP, rank, EP) and built["internode"] is False

        # PR #42976's body and its 0.30 version: FlashInfer's exact sizes.
        for body in ("pr42976", "v030"):
            assert result[body]["builds"] == [
                ("build", nvfp4, 1024),
                ("rebuild", bf16, 1024),
            ], (rank, body)

        v033 = result["v033"]
        assert [b[1] for b in v033["builds"]] == v033_builds, rank
        value = v033["value"]
        assert value["workspace_size"] == value["live"] == v033_builds[-1]
        assert value["params"] == (8192, 2048)
        # vLLM 0.33's prepare/finalize: its max_num_batched_tokens is within
        # the plan, so the layer reused the shared workspace.
        assert value["max_num_batched_tokens"] <= 2048
        assert value["after_prepare_finalize"] == v033_builds[-1] and value["same_communication"]
        assert value["prepare_shapes"] == [[EP * 96, 6144], None, [EP * 96, 4]]
        assert value["finalize_error"] == 0.0
        # The union's hidden size (8192) is wider than this layer's: vLLM 0.34
        # finds the combine input buffer of another shape and keeps its own
        # (as with FlashInfer's); 0.33 asks for none.
        assert value["fused_output_buffer"] is None

        # The layer alone is the union: vLLM 0.34's expert output goes into the
        # combine input buffer, [ep * tokens, hidden], and the combine is exact.
        fused = result["fused_output"]["value"]
        assert fused["fused_output_buffer"] == (
            [EP * 96, 6144] if Version(vllm_release()) >= Version("0.34") else None
        )
        assert fused["prepare_shapes"] == [[EP * 96, 6144], None, [EP * 96, 4]]
        assert fused["finalize_error"] == 0.0
        assert fused["live_after_cleanup"] == 0
        assert value["live_after_cleanup"] == 0

    if mode == "sidecar":
        assert groups[VLLM_GROUP].plan.workspace_bytes == bf16
        assert groups["vllm-test:sidecar/v030"].plan.workspace_bytes == bf16
        assert groups["vllm-test:sidecar/v033"].plan.workspace_bytes == v033_builds[-1]
        assert groups["vllm-test:sidecar/v033"].plan.generation == len(v033_builds)
