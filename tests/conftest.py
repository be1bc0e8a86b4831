"""Shared builders for the tfmemopt specification tests."""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmemopt  # noqa: E402

BATCH = 64
FEATURES = 784
HIDDEN = 512
CLASSES = 10


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts with the pass disabled and no reports."""
    tfmemopt.disable()
    tfmemopt.clear_reports()
    yield
    tfmemopt.disable()
    tfmemopt.clear_reports()


def mlp_variables(seed=0):
    rng = np.random.default_rng(seed)
    w1 = tf.Variable(rng.standard_normal((FEATURES, HIDDEN), dtype=np.float32) * 0.05)
    w2 = tf.Variable(rng.standard_normal((HIDDEN, CLASSES), dtype=np.float32) * 0.05)
    return [w1, w2]


def mlp_batch(seed=1, batch=BATCH):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal((batch, FEATURES), dtype=np.float32))
    y = tf.constant(rng.integers(0, CLASSES, size=(batch,), dtype=np.int32))
    return x, y


def make_mlp_train_step(variables, input_signature=None):
    """A fresh tf.function (so it is traced, and optimized, on first call)."""
    w1, w2 = variables

    @tf.function(input_signature=input_signature)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            hidden = tf.nn.relu(tf.matmul(x, w1))
            logits = tf.matmul(hidden, w2)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )
        grads = tape.gradient(loss, [w1, w2])
        for var, grad in zip([w1, w2], grads):
            var.assign_sub(0.1 * grad)
        return loss, grads

    return train_step


def build_v1_mlp_train_op():
    """In the current (v1) graph: placeholders x, y and an SGD train op."""
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [BATCH], name="y")
    w1, w2 = mlp_variables()
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return x, y, tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def run_mlp_steps(steps=3, **step_kwargs):
    """Losses and final weights of a few SGD steps from a fixed start."""
    variables = mlp_variables()
    step = make_mlp_train_step(variables, **step_kwargs)
    x, y = mlp_batch()
    losses = [step(x, y)[0].numpy() for _ in range(steps)]
    return np.array(losses), [v.numpy() for v in variables]


def reports_for(prefix):
    """Reports whose graph id starts with `prefix` (e.g. '__inference_train_step')."""
    return [r for r in tfmemopt.reports() if r.graph_id.startswith(prefix)]


def _run(argv, env=None, timeout=600):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout)


def run_python(code, *args, env=None, timeout=600):
    """Runs `code` with `args` in a fresh interpreter (for settings that must precede
    TF start)."""
    return _run([sys.executable, "-c", code, *map(str, args)], env, timeout)


def tfmemopt_cli(*args, env=None, timeout=600):
    """Runs `python -m tfmemopt ARGS...` in a fresh interpreter."""
    return _run([sys.executable, "-m", "tfmemopt", *map(str, args)], env, timeout)
