"""What the client relies on in FlashInfer 0.7.4's ``moe_ep``, read from FlashInfer itself.

Imports and signatures only, plus FlashInfer's pure Python (its format
table, its params dataclass): calling a kernel would load its CUDA module.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from moe_sidecar.client.backends import flashinfer_backend_name
from moe_sidecar.flashinfer import v0_7_4
from moe_sidecar.flashinfer.v0_7_2_post1 import DISPATCH_FORMAT_BYTES

pytestmark = [pytest.mark.fi074, pytest.mark.timeout(120)]

ONE_SIDED = "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided"


def test_the_installed_release_selects_the_moe_ep_backend() -> None:
    assert flashinfer_backend_name() == "flashinfer-moe-ep"
    # Importing flashinfer.comm needs cuda-python (not on a CPU machine): read the source.
    spec = importlib.util.find_spec("flashinfer")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    assert (package / "comm" / "mnnvl.py").is_file()
    assert not (package / "comm" / "trtllm_moe_alltoall.py").exists()  # MoeAlltoAll's module


def test_the_config_and_params_fields_the_backend_sets() -> None:
    moe_ep = importlib.import_module("flashinfer.moe_ep")
    config = {f.name for f in dataclasses.fields(moe_ep.NVLinkOneSidedConfig)}
    assert {
        "extra_payload_bytes_per_token",
        "eplb_stats_num_experts",
        "use_low_precision_combine",
        "comm_backend",
        "cft",
        "lamport",
    } <= config
    params = {f.name for f in dataclasses.fields(moe_ep.MoEEpCommParams)}
    assert {"num_experts", "top_k", "max_tokens_per_rank", "hidden_size", "dtype"} <= params
    assert "dispatch_format" in params
    bootstrap = inspect.signature(moe_ep.BootstrapConfig)
    assert {"world_size", "rank", "device", "process_group"} <= set(bootstrap.parameters)
    kernels = importlib.import_module(f"{ONE_SIDED}.kernels")
    assert callable(kernels.get_nvlink_one_sided_alltoall_module)


def test_flashinfer_format_bytes_are_ours() -> None:
    moe_ep = importlib.import_module("flashinfer.moe_ep")
    quant_format = importlib.import_module("flashinfer.fused_moe").QuantFormat
    for name, rule in DISPATCH_FORMAT_BYTES.items():
        for hidden in (2048, 2880, 4095, 7168):
            params = moe_ep.MoEEpCommParams(
                num_experts=256,
                top_k=8,
                max_tokens_per_rank=1,
                hidden_size=hidden,
                dispatch_format=quant_format[name],
            )
            assert params.dispatch_bytes_per_token == rule(hidden), (name, hidden)


def test_the_constructor_still_computes_what_the_sizing_mirrors() -> None:
    # The two op inputs v0_7_4.op_inputs writes out, in FlashInfer's own words.
    module = importlib.import_module(f"{ONE_SIDED}.communication")
    source = inspect.getsource(module.NVLinkOneSidedAlltoAll.__init__)
    for expression in (
        "tokens = self.ep_size * params.max_tokens_per_rank",
        "params.dispatch_bytes_per_token",
        "+ 2 * params.top_k * 4",
        "+ config.extra_payload_bytes_per_token",
        "+ index.MAX_PAYLOADS * alignment",
        "combine_element_size = max(params.token_dtype.itemsize, 2)",
        "combine_input_bytes = tokens * params.hidden_size * combine_element_size",
        "if cft_capable",
        "if lamport_capable:",
    ):
        assert expression in source, expression
    assert v0_7_4.SUPPORTED_TOP_K == module._SUPPORTED_TOP_K


def test_vllm_compatible_class_is_flashinfers() -> None:
    from moe_sidecar.client.backends.flashinfer_moe_ep import vllm_compatible_class

    base = importlib.import_module("flashinfer.moe_ep").NVLinkOneSidedAlltoAll
    cls = vllm_compatible_class()
    assert issubclass(cls, base) and cls._WORKSPACES is base._WORKSPACES
    ours = inspect.signature(cls.dispatch).parameters
    theirs = inspect.signature(base.dispatch).parameters
    # Every parameter of FlashInfer's, in its kind, plus vLLM 0.33's keyword.
    assert [(n, p.kind) for n, p in theirs.items()] == [
        (n, p.kind) for n, p in ours.items() if n != "max_tokens_per_rank"
    ]
    assert ours["max_tokens_per_rank"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "max_tokens_per_rank" not in theirs
