"""Recomputation: under a budget the pass drops forward activations and recomputes
them in the backward pass, without changing a single bit of what training computes.

Each test builds a train step, optimizes it (Grappler's own entry point, or by
running it), and checks the structure of the rewritten graph, the report's numbers
and the results.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer

import tfmemopt
from tfmemopt.analysis import metagraph_of

from conftest import run_python

BENCHMARKS = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks")

PREFIX = "TfMemOpt/Recompute/"
BATCH, WIDTH = 1024, 256  # one activation: 1 MiB, the default min_tensor_bytes


def chain_mlp(depth=12, seed=0, hinted=(), dropout=None):
    """A `depth`-layer ReLU MLP trained with SGD; layers in `hinted` are built in
    tfmemopt.recompute_scope(). Returns (step, x, variables)."""
    rng = np.random.default_rng(seed)
    ws = [tf.Variable(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * 0.08)
          for _ in range(depth)]
    x = tf.constant(rng.standard_normal((BATCH, WIDTH), dtype=np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for i, w in enumerate(ws):
                with tf.name_scope(f"layer_{i}"):
                    if i in hinted:
                        with tfmemopt.recompute_scope():
                            h = tf.nn.relu(tf.matmul(h, w))
                    else:
                        h = tf.nn.relu(tf.matmul(h, w))
                    if dropout is not None:
                        h = tf.nn.dropout(h, rate=dropout, seed=i)
            loss = tf.reduce_mean(tf.square(h))
        grads = tape.gradient(loss, ws)
        for w, g in zip(ws, grads):
            w.assign_sub(0.1 * g)
        return loss

    return step, x, ws


def optimize(step, *args, **fields):
    """The step's graph after TF's meta-optimizer with TfMemOpt (two iterations,
    as when TF builds the function), and the pass's report."""
    metagraph = metagraph_of(step.get_concrete_function(*args))
    config = tfmemopt.config_proto(log_level=0, **fields)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    before = len(tfmemopt.reports())
    graph = tf_optimizer.OptimizeGraph(
        config, metagraph, cluster=grappler_cluster.Cluster(disable_detailed_stats=True))
    report = [r for r in tfmemopt.reports()[before:] if r.graph_id == "graph_to_optimize"][-1]
    return graph, report


def peak_before(step, *args):
    return tfmemopt.analyze(step, *args, mode="ANALYZE_ONLY").predicted_peak_bytes["before"]["CPU:0"]


def train(step, x, ws, steps=3):
    losses = [step(x).numpy() for _ in range(steps)]
    return losses, [w.numpy() for w in ws]


def test_auto_fits_the_budget_at_bitwise_identical_results():
    step, x, _ = chain_mlp()
    before = peak_before(step, x)
    budget = int(0.75 * before)

    base_losses, base_weights = train(*chain_mlp())
    tfmemopt.enable(budget=budget, log_level=0)
    losses, weights = train(*chain_mlp())

    assert losses == base_losses
    for w, v in zip(weights, base_weights):
        np.testing.assert_array_equal(w, v)
    report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")][-1]
    assert report.graph_changed
    assert report.recompute["policy"] == "AUTO" and report.recompute["feasible"]
    assert report.predicted_peak_bytes["before"]["CPU:0"] == before
    assert report.predicted_peak_bytes["after"]["CPU:0"] <= budget < before
    assert report.fits
    # Only forward ops are recomputed: matmuls and relus of the layers.
    assert report.recomputed_ops
    assert all(op.startswith("layer_") for op in report.recomputed_ops)
    assert 0 < report.estimated_recompute_overhead < 0.5


def test_clones_are_named_after_their_originals_and_wait_for_the_backward_pass():
    step, x, _ = chain_mlp()
    budget = int(0.75 * peak_before(step, x))
    graph, report = optimize(step, x, budget=budget)
    nodes = {n.name: n for n in graph.node}
    clones = [n for n in graph.node if n.name.startswith(PREFIX)]
    assert sorted(c.name[len(PREFIX):] for c in clones) == sorted(report.recomputed_ops)
    for clone in clones:
        original = nodes[clone.name[len(PREFIX):]]
        assert clone.op == original.op
        data = [i for i in clone.input if not i.startswith("^")]
        control = [i[1:] for i in clone.input if i.startswith("^")]
        assert len(data) == len([i for i in original.input if not i.startswith("^")])
        if not any(i.startswith(PREFIX) for i in data):
            # A clone reading only checkpoints is held back by a gradient-side trigger.
            assert any(c.startswith("gradient_tape/") for c in control), clone
    # Some backward op reads each clone; no forward op does.
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i.lstrip("^").split(":")[0], []).append(n.name)
    for clone in clones:
        assert readers.get(clone.name), clone.name
        assert all(r.startswith(("gradient_tape/", PREFIX)) for r in readers[clone.name])


def test_a_second_pass_over_the_output_adds_nothing():
    step, x, _ = chain_mlp()
    budget = int(0.75 * peak_before(step, x))
    graph, report = optimize(step, x, budget=budget)
    clones = sorted(n.name for n in graph.node if n.name.startswith(PREFIX))
    assert len(clones) == len(report.recomputed_ops) > 0  # two iterations, one rewrite

    # The output through the meta-optimizer again (a fresh pass instance).
    metagraph = tf.compat.v1.MetaGraphDef()
    metagraph.graph_def.CopyFrom(graph)
    metagraph.collection_def["train_op"].CopyFrom(
        metagraph_of(step.get_concrete_function(x)).collection_def["train_op"])
    config = tfmemopt.config_proto(budget=budget, log_level=0)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    again = tf_optimizer.OptimizeGraph(
        config, metagraph, cluster=grappler_cluster.Cluster(disable_detailed_stats=True))
    assert sorted(n.name for n in again.node if n.name.startswith(PREFIX)) == clones


def test_sqrt_keeps_about_sqrt_n_checkpoints_of_a_chain():
    step, x, _ = chain_mlp(depth=16)
    _, report = optimize(step, x, recompute_policy="SQRT", budget="64GiB")
    checkpoints = report.recompute["checkpoints"]
    assert 3 <= len(checkpoints) <= 5, checkpoints  # sqrt(16) = 4
    assert all(c.startswith("layer_") for c in checkpoints)
    assert not set(checkpoints) & set(report.recomputed_ops)
    # Everything else in the chain is recomputed, and the peak drops a lot.
    assert len(report.recomputed_ops) >= 2 * 16 - 2 * len(checkpoints) - 2
    before = report.predicted_peak_bytes["before"]["CPU:0"]
    after = report.predicted_peak_bytes["after"]["CPU:0"]
    assert after < 0.85 * before


def hinted_ops(step, x):
    graph = step.get_concrete_function(x).graph
    return {op.name for op in graph.get_operations() if "_tfmemopt_recompute" in op.node_def.attr}


def test_manual_recomputes_exactly_the_ops_built_in_recompute_scope():
    step, x, _ = chain_mlp(hinted=(3, 4, 5))
    hinted = hinted_ops(step, x)
    assert hinted and all(n.startswith(("layer_3/", "layer_4/", "layer_5/")) for n in hinted)
    _, report = optimize(step, x, recompute_policy="MANUAL")
    assert report.recompute["policy"] == "MANUAL"
    # Variable reads were built in the scope too; they are never recomputed, and the
    # report says so.
    reads = {n for n in hinted if "ReadVariableOp" in n}
    assert set(report.recomputed_ops) == hinted - reads
    refused = " ".join(report.recompute["hinted_but_not_recomputable"])
    assert all(f"layer_{i}/MatMul/ReadVariableOp " in refused for i in (3, 4, 5)), refused


def test_manual_by_scope_and_by_tf_recompute_hint():
    step, x, _ = chain_mlp()
    _, report = optimize(step, x, recompute_policy="MANUAL", recompute_scopes=["layer_7"])
    assert sorted(report.recomputed_ops) == ["layer_7/MatMul", "layer_7/Relu"]

    rng = np.random.default_rng(0)
    w = tf.Variable(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32))

    @tf.function
    def hinted_step(x):
        with tf.GradientTape() as tape:
            graph = tf.compat.v1.get_default_graph()
            h = tf.nn.relu(tf.matmul(x, w))
            with graph._attr_scope({"_recompute_hint": tf.compat.v1.AttrValue(i=1)}):
                h = tf.nn.relu(tf.matmul(h, w, name="hinted_matmul"), name="hinted_relu")
            loss = tf.reduce_mean(tf.matmul(h, w))
        w.assign_sub(tape.gradient(loss, w))
        return loss

    _, report = optimize(hinted_step, x, mode="MANUAL")
    assert sorted(report.recomputed_ops) == ["hinted_matmul", "hinted_relu"]


def test_random_ops_are_never_recomputed_and_dropout_masks_stay_the_same():
    def run(**fields):
        tf.random.set_seed(7)
        step, x, ws = chain_mlp(dropout=0.3)
        if fields:
            tfmemopt.enable(**fields, log_level=0)
        out = train(step, x, ws)
        tfmemopt.disable()
        return out

    base_losses, base_weights = run()
    tf.random.set_seed(7)
    step, x, _ = chain_mlp(dropout=0.3)
    budget = int(0.7 * peak_before(step, x))
    tfmemopt.clear_reports()
    losses, weights = run(budget=budget)
    assert losses == base_losses
    for w, v in zip(weights, base_weights):
        np.testing.assert_array_equal(w, v)
    report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")][-1]
    assert report.recomputed_ops
    assert not [op for op in report.recomputed_ops if "random" in op.lower()]
    assert report.recompute["left_alone"].get("stateful", 0) >= 12  # one RNG per layer


def test_an_impossible_budget_reports_the_smallest_peak_reachable():
    step, x, _ = chain_mlp()
    _, report = optimize(step, x, budget=1)
    assert report.recompute["feasible"] is False
    assert report.fits is False
    after = report.predicted_peak_bytes["after"]["CPU:0"]
    assert after < report.predicted_peak_bytes["before"]["CPU:0"]
    assert "the budget cannot be met" in report.to_text()

    # With fail_on_infeasible the pass refuses, and TF keeps the graph it had.
    graph, report = optimize(step, x, budget=1, fail_on_infeasible=True)
    assert not [n for n in graph.node if n.name.startswith(PREFIX)]


def test_ops_in_a_loop_are_left_alone():
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * 0.05)
    x = tf.constant(rng.standard_normal((BATCH, WIDTH), dtype=np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.matmul(x, w))
            h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                              [tf.constant(0), h])[1]
            h = tf.nn.relu(tf.matmul(h, w))
            loss = tf.reduce_mean(h)
        w.assign_sub(tape.gradient(loss, w))
        return loss

    before = peak_before(step, x)
    graph, report = optimize(step, x, budget=int(0.6 * before))
    assert report.recompute["left_alone"].get("control_flow", 0) > 0
    frames = {n.name for n in graph.node if n.op in ("Enter", "Exit", "Merge", "Switch",
                                                       "NextIteration", "LoopCond")}
    assert frames  # the loop is lowered to frames here
    for clone in (n for n in graph.node if n.name.startswith(PREFIX)):
        assert "while" not in clone.name


SUBPROCESS_TRAIN = r'''
import json, sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)  # TF itself races otherwise
sys.path.insert(0, sys.argv[1])
import tfmemopt
from models import MODELS
name, fields = sys.argv[2], json.loads(sys.argv[3])
if fields:
    tfmemopt.enable(log_level=0, **fields)
tf.keras.utils.set_random_seed(0)
step, (x, y) = MODELS[name](**json.loads(sys.argv[4]))
losses = [float(step(x, y)) for _ in range(3)]
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")]
print("RESULT " + json.dumps({"losses": losses, "peak": peak,
      "recomputed": reports[-1].recomputed_ops if reports else [],
      "before": reports[-1].predicted_peak_bytes["before"]["CPU:0"] if reports else 0}))
'''


def train_in_subprocess(name, fields, model_kwargs, cap_mb=2048):
    """Trains a benchmark model for 3 steps on the capped BFC allocator in a fresh
    interpreter (one inter-op thread: TF's own results vary run to run otherwise)."""
    proc = run_python(
        SUBPROCESS_TRAIN, BENCHMARKS, name, json.dumps(fields), json.dumps(model_kwargs),
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(cap_mb),
             "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name, kwargs", [
    ("seed_cnn", {"batch": 128}),
    ("cifar_resnet10", {"blocks": 4, "batch": 64}),
])
def test_keras_models_train_bitwise_identically_and_lower_the_measured_peak(name, kwargs):
    # ANALYZE_ONLY leaves the graph as it is: the baseline, with its prediction.
    base = train_in_subprocess(
        name, {"mode": "ANALYZE_ONLY", "assume_batch_size": kwargs["batch"]}, kwargs)
    assert base["recomputed"] == [] and base["before"] > 0
    fields = {"budget": int(0.7 * base["before"]), "assume_batch_size": kwargs["batch"]}
    mine = train_in_subprocess(name, fields, kwargs)
    assert mine["recomputed"], "nothing was recomputed"
    assert mine["losses"] == base["losses"]
    assert mine["peak"] < base["peak"], (mine["peak"], base["peak"])
