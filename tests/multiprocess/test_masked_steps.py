"""The reference all-to-all under a membership mask, in real rank processes.

Four gloo ranks build the reference all-to-all (once without
``enable_rank_mask``, once with it) and step once with every rank. Then
rank 2 leaves: it takes no part in anything after that, and the three
others run several steps of dispatch + combine with rank 2 masked out
(and one through the moe_ep object, the mask in FlashInfer's words).
Every survivor's received rows are exactly what its peers' routing sends it
(nothing from rank 2), and every combined row is exactly the sum over the
token's experts with rank 2's experts' contributions dropped, computed here
from the routing. The refusals (a mask on a build without
``enable_rank_mask``, a rank masking itself, bits beyond ``ep_size``, a
combine with another mask than its dispatch's) name the argument and leave
the step as it was: the step right after each one is exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess import masked_workers
from tests.multiprocess.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

WORLD = 4
MASKED = 2
SEEDS = [11, 12, 13, 14]


def _exact(step: dict[str, Any]) -> None:
    assert step["combine_error"] == 0.0, step
    assert all(error == 0.0 for error in step["row_errors"].values()), step
    assert all(want == got for want, got in step["counts"].values()), step


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    tmp_path: Path = tmp_path_factory.mktemp("masked")
    return run_ranks(
        masked_workers.masked_steps_worker,
        WORLD,
        timeout=90,
        tmp_path=tmp_path,
        args=(MASKED, SEEDS),
    )


def test_every_rank_is_exact_before_the_mask(results: list[Any]) -> None:
    for result in results:
        _exact(result["plain"])
        _exact(result["all_members"])
        assert result["all_members"]["dropped_share"] == 0.0


def test_survivors_drop_exactly_the_masked_ranks_share(results: list[Any]) -> None:
    assert "steps" not in results[MASKED]  # it took no part
    dropped = 0.0
    for rank, result in enumerate(results):
        if rank == MASKED:
            continue
        assert [step["seed"] for step in result["steps"]] == SEEDS
        for step in result["steps"]:
            _exact(step)
            assert step["counts"][MASKED] == (0, 0), (rank, step)
            dropped += step["dropped_share"]
    # The routing does send tokens to rank 2's experts: something was dropped.
    assert dropped > 0


def test_the_moe_ep_object_takes_flashinfers_words(results: list[Any]) -> None:
    for rank, result in enumerate(results):
        if rank != MASKED:
            assert result["moe_ep_error"] == 0.0, rank


def test_refusals_name_the_argument(results: list[Any]) -> None:
    refused = results[0]["refused"]
    assert "active_rank_mask=0xf" in refused["unmasked_build"]
    assert "enable_rank_mask" in refused["unmasked_build"]
    assert "active_rank_mask=0xa" in refused["own_bit"] and "ep_rank=0" in refused["own_bit"]
    assert "active_rank_mask=0x1b" in refused["beyond_ep_size"]
    assert "ep_size=4" in refused["beyond_ep_size"]
    for rank, result in enumerate(results):
        if rank != MASKED:
            assert result["refused"]["own_bit"] and result["refused"]["beyond_ep_size"], rank
            first = result["steps"][0]["wrong_combine_mask"]
            assert "active_rank_mask=15" in first and "dispatch's mask (11)" in first, first
