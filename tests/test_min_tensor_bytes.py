"""min_tensor_bytes' default is adaptive: tensors under 1 MiB are left out of the plan
while the budget can be met without them, and considered when it cannot. A value the
user sets keeps its meaning.

The graph: a v1 Session step over a chain of 100 tanh of 250,000 floats (1,000,000 bytes
each, just under 1 MiB), differentiated with tf.gradients, under a 20 MB budget. Its
measured peak comes from the BFC allocator and, independently, from RunMetadata's step
stats (OpenAI's mem_util method).
"""

import json

import pytest

from conftest import (
    capped_allocator_env, chain_mlp, optimize, peak_before, run_python, subprocess_result,
)

BUDGET = 20_000_000

_CHAIN = r'''
import json, sys
import numpy as np
import tensorflow as tf
import tfmemopt
tf.compat.v1.disable_eager_execution()
fields = json.loads(sys.argv[1])
graph = tf.Graph()
with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [250000], name="x")
    w = tf.Variable(tf.ones([250000]) * 0.5)
    h = x * w
    for _ in range(100):
        h = tf.tanh(h)
    loss = tf.reduce_sum(h)
    (grad,) = tf.gradients(loss, [w])
    train = tf.compat.v1.assign_sub(w, 0.01 * grad)
    init = tf.compat.v1.global_variables_initializer()
config = tfmemopt.config_proto(log_level=0, **fields) if fields is not None else None
feed = np.random.default_rng(0).standard_normal(250000).astype(np.float32)
with tf.compat.v1.Session(graph=graph, config=config) as sess:
    sess.run(init)
    losses = [float(sess.run([train, loss], {x: feed})[1]) for _ in range(2)]
    meta = tf.compat.v1.RunMetadata()
    losses.append(float(sess.run([train, loss], {x: feed}, run_metadata=meta, options=
        tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))[1]))
step_stats_peak = max(m.allocator_bytes_in_use for d in meta.step_stats.dev_stats
                      for n in d.node_stats for m in n.memory)
reports = [r for r in tfmemopt.reports() if r.num_nodes > 100]
print("RESULT " + json.dumps({
    "losses": [l.hex() for l in losses], "step_stats_peak": step_stats_peak,
    "bfc_peak": tf.config.experimental.get_memory_info("CPU:0")["peak"],
    "report": reports[-1].to_dict() if reports else None}))
'''


def _run_chain(fields):
    proc = run_python(_CHAIN, json.dumps(fields),
                      env=capped_allocator_env(1024, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return subprocess_result(proc)


@pytest.fixture(scope="module")
def baseline():
    return _run_chain(None)


def test_default_config_meets_a_budget_that_needs_tensors_just_under_1_mib(baseline):
    result = _run_chain({"budget": BUDGET})
    report = result["report"]
    device = report["devices"][0]
    assert report["min_tensor_bytes_adaptive"] is True
    assert report["min_tensor_bytes"] < 1_000_000  # the plan took the 1 MB tensors
    assert device["peak_after_bytes"] <= BUDGET
    # Measured, two ways: under the budget, and far under the step without the pass.
    assert result["bfc_peak"] <= BUDGET
    assert result["step_stats_peak"] <= BUDGET
    assert baseline["bfc_peak"] > 5 * BUDGET
    assert result["losses"] == baseline["losses"]


def test_an_explicit_threshold_keeps_its_meaning():
    result = _run_chain({"budget": BUDGET, "min_tensor_bytes": 2**20})
    report = result["report"]
    assert report["min_tensor_bytes_adaptive"] is False
    assert report["min_tensor_bytes"] == 2**20
    assert not report["graph_changed"]  # nothing is 1 MiB or more
    assert report["recompute"]["feasible"] is False


def test_a_budget_met_with_large_tensors_never_looks_at_small_ones():
    # chain_mlp's activations are 1 MiB each: a plan over them alone meets the budget,
    # so the threshold stays at 1 MiB and the planner never weighs smaller tensors.
    step, x, _ = chain_mlp(depth=12)
    _, report = optimize(step, x, budget=int(0.8 * peak_before(step, x)))
    assert report.fits and report.graph_changed
    assert report.min_tensor_bytes == 2**20
    assert report.to_dict()["min_tensor_bytes_adaptive"] is True
