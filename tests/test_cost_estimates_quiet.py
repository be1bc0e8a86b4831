"""The pass asks TF's OpLevelCostEstimator for every node's compute time; doing so
must not make TF log anything: an ERROR with three protos ("OpInfo's inputs doesn't
match the graph!") where shape inference gave a node no input properties, or a ~1 KB
WARNING ("Error in PredictCost() for the op") for every op whose predictor rejects the
op info. The user reads those as failures of their step, which they are not."""

import pytest

from conftest import run_python

# Each case prints its result's bits and the pass's report statuses.
CASES = {
    # The gradient of a tf.while_loop reading a variable: GraphProperties has no
    # input properties for gradient_tape/while/VariableShape.
    "while_loop_gradient": r'''
w = tf.Variable(tf.ones([16, 16]) * 0.1)
@tf.function
def step(x):
    with tf.GradientTape() as t:
        _, h = tf.while_loop(lambda i, h: i < 5, lambda i, h: (i + 1, tf.tanh(h @ w)), [0, x])
        loss = tf.reduce_sum(h)
    return t.gradient(loss, w)
print("RESULT", float(tf.reduce_sum(step(tf.ones([8, 16])))).hex())
''',
    # tf.shape(x)[0] of an unknown batch: a StridedSlice constant folding cannot
    # remove, which TF's estimator prices by its output (PredictGatherOrSlice).
    "unknown_dimension_slice": r'''
w = tf.Variable(tf.ones([32, 16]))
@tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
def f(x):
    n = tf.shape(x)[0]
    rows = tf.gather(x, tf.range(n - 1))
    return (tf.reduce_sum(x @ w) + tf.reduce_sum(rows)) / tf.cast(n, tf.float32)
print("RESULT", float(f(tf.ones([8, 32]))).hex())
''',
}

PRELUDE = r'''
import sys
import tensorflow as tf, tfmemopt
if sys.argv[1] == "enable":
    tfmemopt.enable("64MiB")
'''
EPILOGUE = r'''
print("STATUSES", sorted({r.status for r in tfmemopt.reports()}))
'''


@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_estimates_log_nothing_and_change_no_result(case):
    code = PRELUDE + CASES[case] + EPILOGUE
    # TF's C++ log at its default level (WARNING and above), as a user sees it.
    env = {"TF_CPP_MIN_LOG_LEVEL": "1"}
    plain = run_python(code, "none", env=env)
    planned = run_python(code, "enable", env=env)
    assert plain.returncode == 0 and planned.returncode == 0, planned.stderr[-3000:]
    assert "OpInfo's inputs doesn't match the graph" not in planned.stderr, planned.stderr[-3000:]
    assert "Error in PredictCost()" not in planned.stderr, planned.stderr[-3000:]
    assert "STATUSES ['ok']" in planned.stdout, planned.stdout
    result = [line for line in plain.stdout.splitlines() if line.startswith("RESULT")]
    assert result and result[0] in planned.stdout.splitlines()
