"""AUTO on small graphs: the recompute plan is the cheapest set of recomputed ops
whose simulated peak fits the budget.

The reference is an exhaustive search through the public config: every set of the
graph's recomputable forward ops is applied as a MANUAL plan (the same simulator,
the same clone placement), and the cheapest set that fits is the optimum. The
graphs are the optimality benchmark's train steps (benchmarks/optimality.py), run
once through our pass with tfmemopt._ext.run_pass, recompute only, no tensor too
small to consider (the benchmark's decision space).
"""

import itertools
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)


@pytest.fixture(scope="module")
def optimality():
    import optimality as module
    return module


def recomputable_forward_ops(table):
    """Forward ops the planner may recompute that own a buffer the simulator counts."""
    tensors, buffers = table["tensors"], table["buffers"]

    def owns_a_value(node):
        return any(not buffers[tensors[t]["buffer"]]["persistent"] and tensors[t]["bytes"] > 0
                   for t in node["outputs"])

    return [n["name"] for n in table["nodes"]
            if not n["backward"] and n["recomputable"] == "" and owns_a_value(n)]


def peak(report):
    return report["devices"][0]["planned_peak_bytes"]


def test_auto_finds_the_cheapest_fitting_set_on_a_gated_mlp(optimality):
    # (x @ w0) * sigmoid(x @ w1): the greedy descent alone recomputes a MatMul here
    # (51.8 ms predicted); recomputing the cheap element-wise ops fits too.
    metagraph = optimality.load("gated_mlp")
    analyzed, _, table = optimality.run_pass(metagraph, mode="ANALYZE_ONLY")
    before = analyzed["devices"][0]["peak_before_bytes"]
    lowest, _, _ = optimality.run_pass(metagraph, budget_bytes=1)
    budget = (peak(lowest) + before) // 2
    assert peak(lowest) < budget < before

    ops = recomputable_forward_ops(table)
    assert 4 <= len(ops) <= 10  # small enough to try every set here
    optimum = None
    for size in range(len(ops) + 1):
        for chosen in itertools.combinations(ops, size):
            report, _, _ = optimality.run_pass(
                metagraph, budget_bytes=budget, recompute_policy="MANUAL",
                recompute_scopes=list(chosen))
            seconds = report["recompute"]["added_seconds"]
            if peak(report) <= budget and (optimum is None or seconds < optimum):
                optimum = seconds
    assert optimum is not None and optimum > 0

    auto, _, _ = optimality.run_pass(metagraph, budget_bytes=budget)
    assert peak(auto) <= budget
    assert auto["recompute"]["added_seconds"] == pytest.approx(optimum, rel=1e-6)
    assert auto["recompute"]["search"] == "exact"
    assert 0 < auto["recompute"]["exact_candidates"] <= len(ops)
    # Deterministic: the same graph and budget give the same plan.
    again, _, _ = optimality.run_pass(metagraph, budget_bytes=budget)
    assert again["recompute"]["nodes"] == auto["recompute"]["nodes"]


def test_the_exact_search_stays_off_when_there_are_too_many_candidates(optimality):
    # Twelve ReLU layers: 24 MatMul and ReLU candidates, more than the 20 the exact
    # search takes on; the greedy descent plans alone and still fits.
    step, args = optimality.mlp([128] * 13, batch=1024)
    metagraph = optimality.tf_optimized_metagraph(step, args)
    analyzed, _, _ = optimality.run_pass(metagraph, mode="ANALYZE_ONLY")
    before = analyzed["devices"][0]["peak_before_bytes"]
    report, _, _ = optimality.run_pass(metagraph, budget_bytes=int(before * 0.8))
    assert report["recompute"]["search"] == "greedy"
    assert report["recompute"]["exact_candidates"] == -1
    assert peak(report) <= int(before * 0.8)
    assert report["recompute"]["nodes"]
