"""Random training graphs (tests/generated_graphs.py) under random budgets and
policies: whatever the pass does, nothing is lost.

For every generated case: the optimized graph is valid and runs; losses, gradients
and updated weights are bitwise equal to the run without tfmemopt (cases run in a
worker process with one inter-op thread, where TF itself is deterministic); a second
pass over the output adds nothing; a report that says the plan fits is within the
budget, and so is a fresh simulation of the output; nothing stateful is cloned; every
`TfMemOpt/` node's original exists. Where the pass split work along the batch, sums
over the batch are added slice by slice, in another order: the first losses are still
bitwise equal, and every later result is at most generated_graphs.SPLIT_ERROR_FACTOR
(8) times as far from a float64 run of the same model as the float32 run without the
pass is, counting that at least one float32 epsilon of the result: the split is about
as accurate as TF without it. CI runs a fixed (derandomized) sample; `python
benchmarks/stress.py --cases N` runs more.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import generated_graphs as gg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def worker():
    w = gg.Worker()
    yield w
    w.close()


def describe(spec, result):
    return (f"{result['outcome']}:\n  " + "\n  ".join(result["problems"][:8]) +
            f"\n  details: {result.get('details')}\n  spec: {json.dumps(spec)}")


@settings(max_examples=16, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(spec=gg.hypothesis_specs())
def test_random_training_graphs_lose_nothing(worker, spec):
    try:
        result = worker.run(spec)
    except gg.WorkerDied as err:
        pytest.fail(f"crash: {err}\n  spec: {json.dumps(spec)}")
    # A fall-back keeps the original graph (nothing lost); known ones are listed below.
    assert result["outcome"] in ("ok", "fallback"), describe(spec, result)


def test_the_sample_exercises_the_pass(worker):
    """The space is not vacuous: most policies and budgets make the pass rewrite."""
    rewritten = 0
    for seed in range(3):
        result = worker.run(gg.random_spec(seed))
        assert result["outcome"] in ("ok", "fallback"), describe(gg.random_spec(seed), result)
        rewritten += result["rewritten"]
    assert rewritten >= 2


def test_a_dead_worker_is_a_crash_and_the_next_case_runs(worker):
    with pytest.raises(gg.WorkerDied, match="worker exited") as died:
        worker.run({"abort_worker": True})
    assert died.value.phase == "start"
    assert worker.run(gg.random_spec(1))["outcome"] in ("ok", "fallback")


def test_stress_prints_the_counts_as_its_last_line():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stress.py"),
                           "--cases", "2", "--seed", "5", "--json"],
                          capture_output=True, text=True, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(summary)[:5] == ["cases", "mismatches", "invalid_graphs", "crashes",
                                 "crashes_without_tfmemopt"]
    assert summary["cases"] == 2
    assert proc.returncode == (0 if all(
        summary[k] == 0 for k in summary
        if k not in ("cases", "rewritten", "split_cases", "split", "seconds",
                     "crashes_without_tfmemopt", "tf_not_repeatable")) else 1)


def test_split_cases_lose_nothing_within_the_tolerance(worker):
    """Split cases (generated_graphs.random_split_spec): batches and budgets that make
    the pass split work along the batch. The graph is valid, a second pass adds
    nothing, the budget claims hold, the first losses are bitwise equal and the rest
    within the split rule (generated_graphs.SPLIT_ERROR_FACTOR). Twelve cases: the pass
    splits only where a split lowers the peak of the best plan without one, which a
    better schedule makes rarer, so not every case splits (seeds 5 and 8 of these do)."""
    split = 0
    for seed in range(12):
        spec = gg.random_split_spec(seed)
        result = worker.run(spec)
        assert result["outcome"] in ("ok", "fallback"), describe(spec, result)
        split += bool(result.get("split"))
    assert split >= 2


# The split rule, on the kind of sum split seed 122 tripped over: a weight gradient
# 1e-3*W (an l2 loss) plus the batch sum of batch-centered activations over 448 (a
# reduce_mean of 64 x 7 logits), a sum that is zero in exact arithmetic. Rows of
# float32 are added one after another (numpy, no BLAS: the same bits everywhere):
# in one order without the pass, slice by slice (4 slices of 16 rows) with it, and
# in float64 for the reference. "plain" is the same gradient of activations that are
# not centered: a sum that does not cancel.

def _sum_rows(rows):
    total = np.zeros(rows.shape[1:], rows.dtype)
    for row in rows:
        total = total + row
    return total


def _one_step(dtype, cancelling=True, slices=1, bug=None):
    """One training step's results, in the form of generated_graphs.train."""
    rng = np.random.default_rng(122)
    activations = (np.abs(rng.standard_normal((64, 21))) * 4).astype(np.float32).astype(dtype)
    w = (rng.standard_normal((21, 7)) / np.sqrt(21)).astype(np.float32).astype(dtype)
    if cancelling:
        activations = activations - _sum_rows(activations) / dtype(64)
    partial = [_sum_rows(part) for part in np.split(activations, slices)]
    if bug == "a slice dropped":
        partial[2] = np.zeros_like(partial[2])
    elif bug == "a slice counted twice":
        partial.append(partial[2])
    elif bug == "a slice scaled by 1 + 1e-3":
        partial[2] = partial[2] * dtype(1 + 1e-3)
    batch_sum = _sum_rows(np.stack(partial))
    grad = dtype(1e-3) * w + np.outer(batch_sum, np.ones(7, dtype)) / dtype(448)
    return {"losses": [[dtype(1.5)]], "grads": [[grad]], "weights": [w - dtype(0.05) * grad]}


def test_a_cancelling_sum_added_slice_by_slice_is_as_accurate_as_without_the_split():
    base, split = _one_step(np.float32), _one_step(np.float32, slices=4)
    reference = _one_step(np.float64)
    assert gg.first_difference(base, split).startswith("step 1 grads[0]")  # not bitwise
    # A tolerance of 1e-5 of the gradient's own norm (the rule before) calls it a bug:
    gradient, split_gradient = base["grads"][0][0], split["grads"][0][0]
    assert np.linalg.norm(split_gradient - gradient) > 1e-5 * np.linalg.norm(gradient)
    # Measured against float64, it errs no more than the sum without the split:
    assert gg.first_difference(base, split, reference) == ""
    assert gg.worst_split_error(base, split, reference) < 0.5


def test_a_sum_that_does_not_cancel_added_slice_by_slice_passes_too():
    base, split = _one_step(np.float32, False), _one_step(np.float32, False, slices=4)
    assert gg.first_difference(base, split, _one_step(np.float64, False)) == ""


# A model TF does not train bit for bit the same way twice (step 1's grads[3] takes one
# of two values, the second in about one run in three, with or without the pass, which
# changes nothing here). The case passes: its runs are compared with TF's own.
TF_NOT_REPEATABLE = {
    "seed": 16777215, "batch": 26, "kind": "dense", "input_shape": [109],
    "blocks": [{"type": "stateless_dropout", "rate": 0.3},
               {"type": "dense", "units": 1, "act": "none", "bias": False},
               {"type": "residual", "act": "tanh"}, {"type": "skip_prev", "back": 3},
               {"type": "stateless_dropout", "rate": 0.1},
               {"type": "reduce", "how": "logsumexp"},
               {"type": "stateless_dropout", "rate": 0.1},
               {"type": "stateless_dropout", "rate": 0.5}],
    "losses": [{"type": "l2", "tap": 4, "outputs": 6}], "optimizer": "momentum",
    "config": {"policy": "MANUAL", "min_tensor_bytes": 256, "budget_ratio": 0.6,
               "scopes": ["block_3", "block_6", "block_7"]}}


def test_a_model_tf_does_not_repeat_is_compared_with_tf_s_own_runs(worker):
    for _ in range(3):
        result = worker.run(TF_NOT_REPEATABLE)
        assert result["outcome"] == "ok", describe(TF_NOT_REPEATABLE, result)


# When TF's own two runs of one graph differ (generated_graphs.REPEAT_ERROR_FACTOR): the
# pass's result may differ from the first by rounding noise of the size of TF's own
# difference, and not by more.

def _rounding_variant(step, ulps):
    """`step` (the form of generated_graphs.train) with every result moved by `ulps`
    units in the last place: another order of the same float32 sums."""
    def move(a):
        a = np.asarray(a, np.float32)
        for _ in range(ulps):
            a = np.nextafter(a, np.float32(np.inf))
        return a
    return {"losses": [[move(a) for a in s] for s in step["losses"]],
            "grads": [[move(a) for a in s] for s in step["grads"]],
            "weights": [move(a) for a in step["weights"]]}


def test_a_result_within_tf_s_own_spread_passes_and_a_wrong_one_does_not():
    base = _one_step(np.float32, False)
    again = _rounding_variant(base, 1)  # TF's second plain run
    assert gg.first_difference(base, again)  # TF does not repeat itself here
    assert gg.repeat_difference(base, _rounding_variant(base, 3), again) == ""
    # A wrong tensor: one gradient entry off by 1e-3 of itself.
    wrong = _rounding_variant(base, 1)
    wrong["grads"][0][0] = wrong["grads"][0][0].copy()
    wrong["grads"][0][0][2, 3] *= np.float32(1 + 1e-3)
    assert gg.repeat_difference(base, wrong, again).startswith("step 1 grads[0]")
    # Where TF repeats itself, the spread is zero: only a few ulps of the norm pass.
    assert gg.repeat_difference(base, _rounding_variant(base, 1), base) == ""
    assert gg.repeat_difference(base, wrong, base).startswith("step 1 grads[0]")


@pytest.mark.parametrize("bug", ["a slice dropped", "a slice counted twice",
                                 "a slice scaled by 1 + 1e-3"])
@pytest.mark.parametrize("cancelling", [True, False], ids=["cancelling", "plain"])
def test_a_split_that_mishandles_one_slice_is_a_mismatch(bug, cancelling):
    base, reference = _one_step(np.float32, cancelling), _one_step(np.float64, cancelling)
    wrong = _one_step(np.float32, cancelling, slices=4, bug=bug)
    assert gg.first_difference(base, wrong, reference).startswith("step 1 grads[0]")
    assert gg.worst_split_error(base, wrong, reference) > 10


def test_the_first_losses_of_a_split_stay_bitwise():
    base, reference = _one_step(np.float32), _one_step(np.float64)
    split = _one_step(np.float32, slices=4)
    split["losses"] = [[np.nextafter(np.float32(1.5), np.float32(2))]]
    assert gg.first_difference(base, split, reference).startswith("step 1 losses[0]")


# The reference is the same model: Model(spec, dtype="float64") widens the float32
# draws (inputs, weights, dropout masks of both kinds) and runs the same ops, so its
# results are the float32 model's to float32's accuracy, step 2 (new masks) included.
# A different mask, or a different weight, would be off by far more.
SAME_MODEL = [
    {"seed": 7, "batch": 32, "kind": "dense", "input_shape": [24],
     "blocks": [{"type": "dense", "units": 16, "act": "tanh", "bias": True},
                {"type": "dropout", "rate": 0.3},
                {"type": "rnn", "form": "while", "steps": 3, "units": 8, "act": "tanh",
                 "readout": "last"},
                {"type": "stateless_dropout", "rate": 0.5},
                {"type": "rnn", "form": "scan", "steps": 2, "units": 8, "act": "sigmoid",
                 "readout": "mean"}],
     "losses": [{"type": "mse", "tap": 8, "outputs": 3},
                {"type": "softmax_xent", "tap": 1, "outputs": 4}],
     "optimizer": "momentum", "config": {}},
    {"seed": 8, "batch": 16, "kind": "image", "input_shape": [8, 8, 2],
     "blocks": [{"type": "conv", "filters": 4, "kernel": 3, "stride": 1, "padding": "SAME",
                 "act": "relu", "share": False},
                {"type": "dropout", "rate": 0.1}, {"type": "pool", "how": "max"},
                {"type": "conv_branch", "filters": 3, "combine": "concat", "act": "tanh"},
                {"type": "global_pool"}],
     "losses": [{"type": "sigmoid_xent", "tap": 8, "outputs": 2}],
     "optimizer": "sgd", "config": {}},
]


@pytest.mark.parametrize("spec", SAME_MODEL, ids=["dense", "image"])
def test_the_float64_reference_is_the_same_model(spec):
    results = gg.train(gg.Model(spec))
    reference = gg.train(gg.Model(spec, dtype="float64"))
    assert reference["grads"][1][0].dtype == np.float64
    pairs = [(f"step {s + 1} {key}[{k}]", a, r) for key in ("losses", "grads") for s in (0, 1)
             for k, (a, r) in enumerate(zip(results[key][s], reference[key][s]))]
    pairs += [(f"weights[{k}]", a, r)
              for k, (a, r) in enumerate(zip(results["weights"], reference["weights"]))]
    for where, a, r in pairs:
        assert np.linalg.norm(a - r) <= 1e-5 * np.linalg.norm(r), where


# Split seed 122, in 4 slices: a weight gradient is 1e-3*W (an l2 loss) plus a batch
# sum of batch-centered activations (a batch_center block) over 448, a sum that is
# zero in exact arithmetic. Added slice by slice it differs by 1.3e-5 of the
# gradient's norm, a mismatch under a tolerance relative to that norm; against
# float64 it is as accurate as without the split.
def test_a_split_of_a_cancelling_batch_sum_is_no_mismatch(worker):
    spec = gg.random_split_spec(122)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)
    assert result["split"], describe(spec, result)


# Fall-backs found by the generator: the pass keeps the original graph (nothing is
# lost) and logs a WARNING, but it planned something its own verifier rejected.
MANUAL_RAISES_THE_PEAK = {
    "seed": 1808726707, "batch": 28, "kind": "image", "input_shape": [14, 13, 1],
    "blocks": [{"type": "dropout", "rate": 0.5}, {"type": "flatten"}],
    "losses": [{"type": "mse", "tap": 2, "outputs": 10},
               {"type": "sigmoid_xent", "tap": 5, "outputs": 5}],
    "optimizer": "momentum",
    "config": {"policy": "MANUAL", "min_tensor_bytes": 256, "budget_ratio": 1.0,
               "scopes": ["block_0", "block_1"]}}


# MANUAL would recompute block_0's dropout (GreaterEqual, SelectV2, Mul) from its
# RandomUniform draw, which then stays alive until the backward pass (float32: 4x the
# bool mask it replaces): predicted peak 121.6 KiB vs 81.8 KiB. The planner checks a
# SQRT/MANUAL plan against no plan and keeps the original schedule, with a note,
# instead of handing the verifier a plan it must reject. Stress seed 38.
def test_manual_hints_that_raise_the_peak_are_planned_around(worker):
    result = worker.run(MANUAL_RAISES_THE_PEAK)
    assert result["outcome"] == "ok", describe(MANUAL_RAISES_THE_PEAK, result)


# Failures found by benchmarks/stress.py (seed 0 unless said), replayed exactly:
# `python benchmarks/stress.py --replay-seed K` prints the same case and result.
# TF's own passes used to run again after ours (the meta-optimizer's second
# iteration) and rewrote the clones differently from their originals, so recomputed
# values differed in the last bits: seed 76, the remapper fused a cloned
# MatMul+BiasAdd+Tanh; seed 809, a cloned 3-input AddN got its inputs reordered. The
# pass now rewrites only in the meta-optimizer's last iteration.
@pytest.mark.parametrize("seed", [76, 809])
def test_tf_passes_after_ours_leave_the_clones_as_exact_copies(worker, seed):
    spec = gg.random_spec(seed)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)


# TF's AddN kernel sums into the first input buffer it may reuse, moved to the front
# (aggregate_ops.h). A clone of block_1/Mean reading block_0/Mean in the backward pass
# would keep block_0/Mean, an input of the forward AddN(block_0/Mean, block_2/add,
# block_3/Softplus), from being reused when that AddN runs, and the sum would change
# order. Inputs of AddNs of 3+ inputs are pinned: never recomputed, swapped or kept
# alive by a clone (see also tests/test_faults.py).
def test_recomputation_leaves_forward_addn_sums_in_their_order(worker):
    spec = gg.random_spec(763)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)


# SQRT: the planner's simulation of its rewrite predicted 169,428 bytes, within the
# 169,853-byte budget, while verify's fresh analysis of the rewritten graph predicted
# 172,428: the report contradicted itself. The planner now simulates each candidate in
# the order verify gives the rewritten graph.
def test_a_plan_that_says_it_fits_is_within_the_budget(worker):
    spec = gg.random_spec(449)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)


# AUTO, after TF's passes: the plan's own simulation lowered the peak but verify's
# fresh analysis predicted 13.1 KiB > the original's 12.6 KiB, so the pass fell back
# (same cause as above). Stress --seed 11, case 96.
def test_auto_plans_pass_their_own_verification(worker):
    spec = gg.random_spec(11000129)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)


# SQRT at a budget equal to the unplanned peak. The harness checks the claim on the
# pass's output analyzed as it is (a second trip through TF's passes rewrites it again);
# analyze() orders a step's inputs by argument, as the executor runs them. Seeds 79, 303
# and 373 were the same case.
def test_the_final_graph_of_a_plan_that_fits_is_within_the_budget(worker):
    spec = gg.random_spec(310)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)


# Swap nodes were named after the tensor with ':' spelled '_', so ShapeN_1:1 became
# ShapeN_1_1, the name of another node (seed 5: a SwapOut whose name pointed at the
# wrong original; seed 56: two swap nodes with one name, which verify rejected). They
# are now named after the producer and, past port 0, `/output_K`.
@pytest.mark.parametrize("seed", [5, 56])
def test_swap_nodes_of_multi_output_ops_have_unique_names(worker, seed):
    spec = gg.random_spec(seed)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)


# Stress case 844: a plan that swapped the MaxPool output its MaxPoolGrad reads sent the
# gradient down Eigen's path (3x its gradient input as scratch) instead of oneDNN's
# workspace; the planner's table kept the workspace (67,345 B planned), verify's fresh
# analysis counted the scratch (80,820 B > the original's 80,281 B), and the pass fell
# back. The planner no longer swaps such a tensor (SwapChoice::Swappable: Eigen's kernel
# also sums overlapping windows in another order); the case must plan and verify alike.
def test_a_max_pool_output_its_gradient_reads_plans_and_verifies_alike(worker):
    spec = gg.random_spec(844)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)
    assert result["rewritten"], describe(spec, result)


# TF's constant folding can turn a graph that sorts into one that does not: for
# Mul(C, M), M = Mul(c, X), with constants C and c it pushes C down into M
# (ConstantFolding::ConstantPushDown), which then reads C and waits for whatever C
# waits for. Its guard (PrepareConstantPushDown) only refuses when M is a direct
# control input of C. Here C waits for M through another node: a cycle.
def test_tf_constant_folding_closes_a_cycle_through_a_const_s_control_inputs():
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import cluster as grappler_cluster
    from tensorflow.python.grappler import tf_optimizer

    def optimized(indirect):
        graph = tf.Graph()
        with graph.as_default():
            a = tf.compat.v1.placeholder(tf.float32, [4], name="a")
            x = tf.multiply(tf.constant(3.0, name="c"), a, name="x")
            waited = x
            if indirect:
                with tf.control_dependencies([x]):
                    waited = tf.identity(a, name="y")
                graph.add_to_collection("train_op", waited)
            with tf.control_dependencies([waited]):
                big_c = tf.constant(2.0, name="big_c")
            graph.add_to_collection("train_op", tf.identity(big_c * x, name="out"))
            metagraph = tf.compat.v1.train.export_meta_graph(graph=graph)
        config = config_pb2.ConfigProto()
        rewrite = config.graph_options.rewrite_options
        rewrite.min_graph_nodes = -1
        rewrite.optimizers.append("constfold")
        rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
        return tf_optimizer.OptimizeGraph(
            config, metagraph, cluster=grappler_cluster.Cluster(disable_detailed_stats=True))

    # With the direct edge the guard holds: nothing is pushed down.
    direct = {n.name: n for n in optimized(indirect=False).node}
    assert list(direct["x"].input) == ["c", "a"] and direct["big_c"].op == "Const"
    # If this stops raising, TF fixed its guard and tfmemopt's rule that no order edge
    # touches a Const (plan/pin_order.h, IsUntimed) is no longer needed for it.
    with pytest.raises(tf.errors.InvalidArgumentError, match="topological order"):
        optimized(indirect=True)


# Split seed 167 (a swap plan): the order pinning made the Const
# gradient_tape/block_1/moments/scalar (TF's 2.0 of SquaredDifference's gradient,
# already waiting for truediv_1) wait for the swap-in of block_1/moments/mean, which
# waits for truediv_1 itself. The harness's second meta-optimizer run over that output
# dropped truediv_1 -> scalar as implied (dependency optimizer), and constant folding
# then pushed scalar into truediv_1 (the test above): "The graph couldn't be sorted in
# topological order". A Const's place in the order changes no bytes (its kernel holds
# its buffer all step), so no order edge goes into or out of one.
def test_no_order_edge_touches_a_const_and_tf_s_passes_can_run_again(worker):
    import tfmemopt
    from tfmemopt.analysis import metagraph_of

    spec = gg.random_split_spec(167)
    model = gg.Model(spec)  # holds the variables the function reads
    metagraph = metagraph_of(model.step_function().get_concrete_function())
    peak = tfmemopt.analyze_metagraph(metagraph, mode="ANALYZE_ONLY")
    fields = gg.config_fields(spec, max(peak.predicted_peak_bytes["before"].values()))
    for alone in (True, False):
        graph, report = gg._optimize(metagraph, fields, alone=alone)
        assert report is not None and report.status == "ok" and report.swapped_tensors, alone
        before = ({n.name: set(n.input) for n in metagraph.graph_def.node} if alone else
                  {n.name: set(n.input) for n in
                   gg._optimize(metagraph, {**fields, "mode": "ANALYZE_ONLY"})[0].node})
        consts = {n.name for n in graph.node if n.op in ("Const", "HostConst")}
        for n in graph.node:
            added = {i for i in n.input if i.startswith("^")} - before.get(n.name, set())
            assert not (n.name in consts and added), (alone, n.name, added)
            assert not {i[1:] for i in added} & consts, (alone, n.name, added)
    result = worker.run(spec)
    assert result["outcome"] == "ok", describe(spec, result)
