"""Randomness and state: dropout (Keras and tf.nn), random augmentation layers,
tf.random.Generator, and ops that update variables in the forward pass.

Random draws and state updates are stateful ops: the pass must never clone them
(a clone would draw again, or update twice). Stateless ops that read a stateful
op's output (Keras's seeded draws, the generator's) may be recomputed, since they
read the same value. Trained under a budget that makes the pass recompute, every
loss and every variable (weights, optimizer slots, BatchNorm statistics, seed
states, the generator's state, counters) is bitwise equal to training without
tfmemopt. One subprocess, one inter-op thread (TF itself is not deterministic run
to run otherwise).
"""

import pytest

from conftest import run_python, subprocess_result

SCRIPT = r'''
import json, sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
import tfmemopt
from tensorflow.python.eager import context
from tensorflow.python.framework import op_def_registry

BATCH = 128
rng = np.random.default_rng(0)
X_FLAT = tf.constant(rng.standard_normal((BATCH, 512), dtype=np.float32))
X_IMAGE = tf.constant(rng.random((BATCH, 24, 24, 3), dtype=np.float32))
Y = tf.constant(rng.integers(0, 10, size=(BATCH,), dtype=np.int32))
XENT = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_step(model, x):
    optimizer = tf.keras.optimizers.Adam()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = XENT(Y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step, lambda: model.variables + optimizer.variables


def keras_dropout_bn():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((512,)),
        tf.keras.layers.Dense(768), tf.keras.layers.BatchNormalization(), tf.keras.layers.ReLU(),
        tf.keras.layers.Dropout(0.3),
        tf.keras.layers.Dense(768, activation="relu"), tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(768, activation="relu"),
        tf.keras.layers.Dense(10)])
    return keras_step(model, X_FLAT)


def keras_augment():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((24, 24, 3)),
        tf.keras.layers.RandomFlip("horizontal"),
        tf.keras.layers.RandomTranslation(0.1, 0.1),
        tf.keras.layers.RandomContrast(0.2),
        # Three convolutions: during the last one's backward the first one's output
        # waits for the second one's filter gradient, which recomputation can serve.
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(10)])
    return keras_step(model, X_IMAGE)


def variables(*shapes):
    r = np.random.default_rng(1)
    return [tf.Variable(r.standard_normal(s, dtype=np.float32) * 0.05) for s in shapes]


def generator_and_state():
    """tf.random.Generator noise and masks, tf.nn.dropout, and forward-pass updates
    of a moving mean and a counter whose values the loss reads."""
    ws = variables((512, 1024), (1024, 1024), (1024, 1024), (1024, 10))
    generator = tf.random.Generator.from_seed(1234)
    moving = tf.Variable(tf.zeros((1024,)))
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.matmul(X_FLAT, ws[0]))
            h = h + 0.1 * generator.normal(tf.shape(h))
            h = tf.nn.relu(tf.matmul(h, ws[1]))
            mask = tf.cast(generator.uniform(tf.shape(h)) > 0.2, tf.float32)
            h = h * mask / 0.8
            mean = moving.assign(0.9 * moving + 0.1 * tf.reduce_mean(h, axis=0))
            counter.assign_add(1)
            h = tf.nn.relu(tf.matmul(h - mean, ws[2]))
            h = tf.nn.dropout(h, rate=0.25, seed=7)
            loss = XENT(Y, tf.matmul(h, ws[3])) + 1e-3 * tf.cast(counter, tf.float32)
        grads = tape.gradient(loss, ws)
        for v, g in zip(ws, grads):
            v.assign_sub(0.05 * g)
        return loss
    everything = ws + [generator.state, moving, counter]
    return step, lambda: everything


MODELS = {"keras_dropout_bn": keras_dropout_bn, "keras_augment": keras_augment,
          "generator_and_state": generator_and_state}


def train(name, collect=False):
    tf.random.set_seed(5)
    step, state = MODELS[name]()
    ctx = context.context()
    if collect:
        ctx.enable_graph_collection()
    losses = [float(step().numpy()) for _ in range(3)]
    graph = None
    if collect:
        graph = [f.post_optimization_graph for f in ctx.export_run_metadata().function_graphs
                 if any(n.name.startswith("gradient_tape/") for n in f.post_optimization_graph.node)][-1]
        ctx.disable_graph_collection()
    return losses, [v.numpy() for v in state()], graph


def stateful(op):
    op_def = op_def_registry.get(op)
    return op_def is None or op_def.is_stateful


out = {}
for name in sys.argv[1:]:
    base_losses, base_state, _ = train(name)
    tf.random.set_seed(5)
    step, _ = MODELS[name]()
    peak = tfmemopt.analyze(step, mode="ANALYZE_ONLY").predicted_peak_bytes["before"]["CPU:0"]
    tfmemopt.clear_reports()
    # Recomputation is what this file tests: splitting (which sums weight gradients
    # in another order) is kept out.
    tfmemopt.enable(budget=int(0.6 * peak), min_tensor_bytes=4096, enable_swap=False,
                    enable_split=False, log_level=0)
    losses, state, graph = train(name, collect=True)
    tfmemopt.disable()
    (report,) = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")]
    nodes = {n.name: n for n in graph.node}
    clones = [n for n in graph.node if n.name.startswith("TfMemOpt/Recompute/")]
    out[name] = {
        "base_losses": base_losses, "losses": losses,
        "state_equal": [a.tobytes() == b.tobytes() for a, b in zip(base_state, state)],
        "num_state": len(state),
        "clones": [c.name for c in clones],
        "stateful_clones": [c.name for c in clones if stateful(c.op)],
        "recomputed": report.recomputed_ops,
        "stateful_recomputed": [n for n in report.recomputed_ops
                                if n in nodes and stateful(nodes[n].op)],
        "recomputed_random_ops": [nodes[n].op for n in report.recomputed_ops
                                  if n in nodes and "Random" in nodes[n].op],
        "stateless_random_clones": [c.name for c in clones if c.op.startswith("StatelessRandom")],
        "random_ops": sorted({n.op for n in graph.node if "Random" in n.op or n.op.startswith("Rng")}),
        "left_alone": report.recompute.get("left_alone", {}),
        "status": report.status,
    }
print("RESULT " + json.dumps(out))
'''

NAMES = ["keras_dropout_bn", "keras_augment", "generator_and_state"]


@pytest.fixture(scope="module")
def trained():
    proc = run_python(SCRIPT, *NAMES, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=900)
    return subprocess_result(proc)


@pytest.mark.parametrize("name", NAMES)
def test_losses_and_every_variable_are_bitwise_equal(trained, name):
    result = trained[name]
    assert result["status"] == "ok"
    assert result["losses"] == result["base_losses"]
    # Weights, optimizer slots, BatchNorm statistics, seed states, generator state,
    # the moving mean and the counter.
    assert result["num_state"] > 0 and all(result["state_equal"]), result["state_equal"]


@pytest.mark.parametrize("name", NAMES)
def test_the_pass_recomputes_but_never_a_stateful_op(trained, name):
    result = trained[name]
    assert result["clones"] and result["recomputed"], result  # the budget made it act
    assert result["random_ops"], "the graph draws random numbers"
    assert result["stateful_clones"] == []
    assert result["stateful_recomputed"] == []
    # A stateless draw reads its seed from a stateful op's output: recomputing it
    # gives the same numbers (generator_and_state recomputes one).
    assert all(op.startswith("StatelessRandom") for op in result["recomputed_random_ops"])
    assert result["left_alone"].get("stateful", 0) > 0
