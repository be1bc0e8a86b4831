"""One budget, one plan: for each tensor the planner keeps, swaps or recomputes it so
that the simulated peak stays within a peak budget, the same plan every time, and a
budget it cannot meet is reported with the smallest peak it can reach.

The graph is a Keras CIFAR ResNet of 4 blocks (benchmarks/models.py), about 1,450
nodes: too big for the exact search, so the greedy joint planner decides.
"""

import sys

import pytest

from conftest import BENCHMARKS, optimize, peak_before

sys.path.insert(0, BENCHMARKS)
import models  # noqa: E402


@pytest.fixture(scope="module")
def resnet():
    step, (x, y) = models.cifar_resnet(blocks=4, batch=32)
    return step, x, y, peak_before(step, x, y)


def plan_key(graph):
    return sorted((n.name, n.op, tuple(n.input)) for n in graph.node)


def test_each_budget_it_says_it_fits_is_met_and_tighter_budgets_mix_swap_and_recompute(resnet):
    step, x, y, before = resnet
    swapped, recomputed = [], []
    for fraction in (0.9, 0.7, 0.55, 0.4):
        budget = int(fraction * before)
        _, report = optimize(step, x, y, budget=budget)
        assert report.fits, (fraction, report.to_text())
        assert report.predicted_peak_bytes["after"]["CPU:0"] <= budget
        swapped.append(len(report.swapped_tensors))
        recomputed.append(len(report.recomputed_ops))
    # The planner reaches for more as the budget tightens, and uses both mechanisms.
    assert swapped == sorted(swapped) and recomputed == sorted(recomputed)
    assert swapped[-1] > 0 and recomputed[-1] > 0


def test_the_same_graph_and_budget_give_the_same_plan(resnet):
    step, x, y, before = resnet
    first, report = optimize(step, x, y, budget=int(0.55 * before))
    second, again = optimize(step, x, y, budget=int(0.55 * before))
    assert report.swapped_tensors and report.recomputed_ops
    assert plan_key(first) == plan_key(second)
    assert again.swapped_tensors == report.swapped_tensors
    assert again.recomputed_ops == report.recomputed_ops


def test_a_budget_out_of_reach_is_reported_with_the_smallest_peak_reached(resnet):
    step, x, y, before = resnet
    reached = []
    for fraction in (0.25, 0.05):
        # Swap and recompute only: splitting, the fourth choice, has tests of its own.
        _, report = optimize(step, x, y, budget=int(fraction * before), enable_split=False)
        assert report.fits is False
        reached.append(report.predicted_peak_bytes["after"]["CPU:0"])
        # The plan is still applied: the peak it reaches is well below the original.
        assert reached[-1] < 0.5 * before
        assert ("the budget cannot be met by swapping and recomputation; the plan applied "
                f"reaches the smallest peak found (CPU:0 {reached[-1] / 2**20:.2f} MiB)"
                in report.to_text()), report.to_text()
    # Below what is reachable, the budget no longer matters: the same minimum.
    assert reached[0] == reached[1]
