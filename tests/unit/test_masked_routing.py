"""``bench/masked_routing.py`` is the CPU test's arithmetic of masked steps
at any shape: at that test's shape (``tests/multiprocess/masked_workers.py``)
every tensor equals the test's; at DeepSeek-V3's, every expected value is
exact in bf16 and the routing reaches every rank, the one that leaves
included. ``bench/masked_steps_gpu.py``'s summary fails a run with one
inexact step."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from bench import masked_routing as routing
from bench import masked_steps_gpu
from tests.multiprocess import masked_workers

pytestmark = pytest.mark.timeout(60)

CPU_TEST = routing.Shape(
    masked_workers.HIDDEN, masked_workers.TOP_K, masked_workers.NUM_EXPERTS, masked_workers.TOKENS
)
WORLD = 4


@pytest.mark.parametrize("seed", [0, 1, 11, 21])
def test_equal_to_the_cpu_tests_arithmetic(seed: int) -> None:
    for rank in range(WORLD):
        ours, theirs = (
            routing.step_inputs(CPU_TEST, rank, seed),
            masked_workers.step_inputs(rank, seed),
        )
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
        for masked in (set(), {2}, {3}, {1, 3}):
            assert torch.equal(
                routing.expected_combine(CPU_TEST, rank, seed, WORLD, masked),
                masked_workers.expected_combine(rank, seed, WORLD, masked),
            )
        for source in range(WORLD):
            assert torch.equal(
                routing.expected_rows(CPU_TEST, source, rank, seed, WORLD),
                masked_workers.expected_rows(source, rank, seed, WORLD),
            )


def test_the_experts_give_the_expected_combine_at_deepseek_v3s_shape() -> None:
    """The experts on every rank's share, summed over the members, are the
    expected combine; every value of it is exact in bf16."""
    shape = routing.DEEPSEEK_V3
    assert routing.exact_in_bf16(shape)
    me, seed, masked = 1, 3, {3}
    inputs = routing.step_inputs(shape, me, seed)
    total = torch.zeros(shape.tokens, shape.hidden)
    for rank in range(WORLD):
        if rank not in masked:
            out = routing.expert_output(
                shape, rank, WORLD, inputs["values"], inputs["ids"], inputs["weights"]
            )
            total += out.float()
    want = routing.expected_combine(shape, me, seed, WORLD, masked)
    assert torch.equal(total, want)
    assert torch.equal(want.to(torch.bfloat16).float(), want)


def test_the_routing_reaches_every_rank_at_every_step() -> None:
    shape = routing.DEEPSEEK_V3
    for seed in range(1, 1 + 2 + 20):
        for me in range(WORLD - 1):
            assert routing.dropped_share(shape, me, seed, WORLD, {WORLD - 1}) > 0, (me, seed)
            for target in range(WORLD):
                assert routing.expected_rows(shape, me, target, seed, WORLD).size(0) > 0


def _outcome(rank: int, errors: list[float], status: int) -> dict[str, Any]:
    def steps(values: list[float]) -> list[dict[str, Any]]:
        return [{"combine_error": e, "dropped_share": 1.0} for e in values]

    outcome = {"status": status, "killed": rank == 3, "unmasked": steps([0.0, 0.0])}
    return outcome | ({"masked": steps(errors)} if rank < 3 else {})


def test_one_inexact_step_fails_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(ranks=4, steps=3)
    good = {r: _outcome(r, [0.0] * 3, 0 if r < 3 else -9) for r in range(4)}
    assert masked_steps_gpu.summarize(args, good)
    assert "masked steps: 3 of 3 exact on ranks [0, 1, 2]" in capsys.readouterr().out
    bad = good | {1: _outcome(1, [0.0, 0.5, 0.0], 0)}
    assert not masked_steps_gpu.summarize(args, bad)
    assert "masked steps: 2 of 3 exact on ranks [0, 1, 2]" in capsys.readouterr().out
    unkilled = good | {3: _outcome(3, [], 3) | {"killed": False}}
    assert not masked_steps_gpu.summarize(args, unkilled)
