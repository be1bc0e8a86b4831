"""Control flow: tf.while_loop (Keras LSTM and GRU, a hand-written RNN) and tf.cond.

TF lowers them to Enter/Exit/Merge/Switch/NextIteration frames before the pass runs
(checked below on the graph TF really runs). The pass plans around them: results are
bitwise equal to training without tfmemopt, nothing inside a loop frame or a cond
branch is cloned, and the report's `recompute.left_alone` names `control_flow`.

All four models train in one subprocess with one inter-op thread (TF itself is not
deterministic run to run otherwise), first without tfmemopt, then with a budget of
60 % of the predicted peak.
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

BATCH, STEPS, FEATURES = 64, 24, 16
COND_BATCH = 1024
rng = np.random.default_rng(0)
X = tf.constant(rng.standard_normal((BATCH, STEPS, FEATURES), dtype=np.float32))
Y = tf.constant(rng.integers(0, 10, size=(BATCH,), dtype=np.int32))
XENT = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_rnn(layer):
    def build():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([
            tf.keras.Input((STEPS, FEATURES)),
            tf.keras.layers.Dense(96, activation="relu"),  # outside the loop: recomputable
            layer(64),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10)])
        optimizer = tf.keras.optimizers.Adam()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = XENT(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return step, model.trainable_variables
    return build


def variables(*shapes):
    r = np.random.default_rng(1)
    return [tf.Variable(r.standard_normal(s, dtype=np.float32) * 0.2) for s in shapes]


def hand_rnn():
    # Per-step dense layers before the loop, wider than the loop's state: their
    # activations, held from the forward pass to the end of the backward pass, make
    # the peak, and recomputing them lowers it (the loop's own lists cannot be).
    w_a, w_b, w_in, w_h, w_mid, w_out = variables(
        (FEATURES, 256), (256, 256), (256, 96), (96, 96), (96, 1024), (1024, 10))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.einsum("btf,fh->bth", x, w_a))  # recomputable
            h = tf.nn.relu(tf.einsum("bth,hk->btk", h, w_b))  # recomputable
            inputs = tf.nn.relu(tf.einsum("bth,hk->btk", h, w_in))  # recomputable
            outputs = tf.TensorArray(tf.float32, size=STEPS)

            def body(t, h, outputs):
                h = tf.tanh(inputs[:, t] + tf.matmul(h, w_h))
                return t + 1, h, outputs.write(t, h)

            _, h, outputs = tf.while_loop(lambda t, h, o: t < STEPS, body,
                                          [tf.constant(0), tf.zeros((BATCH, 96)), outputs])
            pooled = tf.reduce_mean(outputs.stack(), axis=0)
            top = tf.nn.relu(tf.matmul(h + pooled, w_mid))  # after the loop: recomputable
            loss = XENT(y, tf.matmul(top, w_out))
        ws = [w_a, w_b, w_in, w_h, w_mid, w_out]
        grads = tape.gradient(loss, ws)
        for v, g in zip(ws, grads):
            v.assign_sub(0.1 * g)
        return loss
    return step, [w_a, w_b, w_in, w_h, w_mid, w_out]


def cond_mlp():
    # A batch of its own, so that activations (1024 x 256) outweigh the weight
    # gradients (256 x 256): those wait together for the one learning-rate constant
    # that the executor runs after the backward pass, which no recomputation lowers.
    ws = variables((STEPS * FEATURES, 256), (256, 256), (256, 256), (256, 256), (256, 10))
    flags = tf.constant([1.0, -1.0, 1.0])

    @tf.function
    def step(x, y, flag):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.matmul(tf.reshape(x, (COND_BATCH, -1)), ws[0]))
            h = tf.nn.relu(tf.matmul(h, ws[1]))
            h = tf.cond(flag > 0, lambda: tf.nn.relu(tf.matmul(h, ws[2])),
                        lambda: tf.tanh(tf.matmul(h, ws[2])))
            h = tf.nn.relu(tf.matmul(h, ws[3]))
            loss = XENT(y, tf.matmul(h, ws[4]))
        grads = tape.gradient(loss, ws)
        for v, g in zip(ws, grads):
            v.assign_sub(0.05 * g)
        return loss
    step.flags = flags
    data = np.random.default_rng(2)  # the same batch in every build
    step.x = tf.constant(data.standard_normal((COND_BATCH, STEPS, FEATURES), dtype=np.float32))
    step.y = tf.constant(data.integers(0, 10, size=(COND_BATCH,), dtype=np.int32))
    return step, ws


MODELS = {"keras_lstm": keras_rnn(tf.keras.layers.LSTM), "keras_gru": keras_rnn(tf.keras.layers.GRU),
          "hand_rnn": hand_rnn, "cond": cond_mlp}


def args_of(name, step, i):
    return (step.x, step.y, step.flags[i]) if name == "cond" else (X, Y)


def train(name, collect=False):
    step, variables = MODELS[name]()
    ctx = context.context()
    if collect:
        ctx.enable_graph_collection()
    losses = [float(step(*args_of(name, step, i)).numpy()) for i in range(3)]
    graphs = []
    if collect:
        graphs = [f.post_optimization_graph for f in ctx.export_run_metadata().function_graphs
                  if any(n.name.startswith("gradient_tape/") for n in f.post_optimization_graph.node)]
        ctx.disable_graph_collection()
    return losses, [v.numpy() for v in variables], graphs, step


def control_flow_members(graph):
    """Nodes inside a loop frame (reachable from an Enter before its Exit) or a cond
    branch (reachable from a Switch before its Merge), along data and control edges."""
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i.lstrip("^").split(":")[0], []).append(n)
    members = set()
    for start in graph.node:
        if start.op not in ("Enter", "Switch"):
            continue
        stop = "Exit" if start.op == "Enter" else "Merge"
        stack = [start]
        while stack:
            n = stack.pop()
            for r in readers.get(n.name, []):
                if r.name in members:
                    continue
                members.add(r.name)
                if r.op != stop:
                    stack.append(r)
    return members


out = {}
for name in sys.argv[1:]:
    tfmemopt.disable()
    base_losses, base_weights, _, _ = train(name)
    step, _ = MODELS[name]()
    tf.keras.utils.set_random_seed(0)
    peak = tfmemopt.analyze(step, *args_of(name, step, 0), mode="ANALYZE_ONLY")
    before = peak.predicted_peak_bytes["before"]["CPU:0"]
    tfmemopt.clear_reports()
    tfmemopt.enable(budget=int(0.6 * before), min_tensor_bytes=4096, enable_swap=False,
                    log_level=0)
    losses, weights, graphs, _ = train(name, collect=True)
    tfmemopt.disable()
    reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")]
    (graph,) = graphs
    ops = {}
    for n in graph.node:
        ops[n.op] = ops.get(n.op, 0) + 1
    members = control_flow_members(graph)
    # What the plan added (the pace stage's Identities read a loop's Switch by design:
    # docs/loops.md#pacing).
    clones = [n for n in graph.node if n.name.startswith("TfMemOpt/")
              and not n.name.startswith("TfMemOpt/LoopPace/")]
    prefix = "TfMemOpt/Recompute/"
    out[name] = {
        "base_losses": base_losses, "losses": losses,
        "weights_equal": all(a.tobytes() == b.tobytes() for a, b in zip(base_weights, weights)),
        "frame_ops": {op: ops.get(op, 0) for op in ("Enter", "Exit", "Merge", "Switch", "NextIteration")},
        "clones": [c.name for c in clones],
        "clones_in_control_flow": [c.name for c in clones if c.name in members
                                   or c.name[len(prefix):] in members],
        "clones_reading_control_flow": [c.name for c in clones if any(
            i.lstrip("^").split(":")[0] in members for i in c.input)],
        "members": len(members),
        "statuses": [r.status for r in reports],
        "left_alone": reports[-1].recompute.get("left_alone", {}),
        "recomputed": reports[-1].recomputed_ops, "note": reports[-1].recompute.get("note", ""),
        "budget": int(0.6 * before), "before": before,
    }
print("RESULT " + json.dumps(out))
'''

NAMES = ["keras_lstm", "keras_gru", "hand_rnn", "cond"]


@pytest.fixture(scope="module")
def trained():
    proc = run_python(SCRIPT, *NAMES, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=900)
    return subprocess_result(proc)


@pytest.mark.parametrize("name", NAMES)
def test_the_graph_tf_runs_has_lowered_control_flow(trained, name):
    frame_ops = trained[name]["frame_ops"]
    if name == "cond":
        assert frame_ops["Switch"] > 0 and frame_ops["Merge"] > 0, frame_ops
    else:
        assert all(frame_ops[op] > 0 for op in frame_ops), frame_ops
    assert trained[name]["members"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_results_are_bitwise_equal(trained, name):
    result = trained[name]
    assert result["statuses"] and all(s == "ok" for s in result["statuses"])
    assert result["losses"] == result["base_losses"]
    assert result["weights_equal"]


@pytest.mark.parametrize("name", NAMES)
def test_the_pass_recomputes_around_control_flow_not_inside_it(trained, name):
    result = trained[name]
    # The budget forced the pass to act, outside the loop or branches.
    assert result["clones"], result
    assert result["clones_in_control_flow"] == []
    assert result["clones_reading_control_flow"] == []
    assert result["left_alone"].get("control_flow", 0) > 0, result["left_alone"]
