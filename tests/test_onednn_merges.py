"""The pass keeps the node merges of TF's oneDNN layout pass (grappler/rewrite/
onednn_merge_guard.h), so that results stay bitwise equal.

After Grappler, TF's oneDNN layout pass merges Conv2DBackpropFilter + BiasAddGrad
(and Conv2D + BiasAdd) into one kernel, but only when both nodes have the same
control inputs. The order guard pins the planned order with control edges; one on a
BiasAddGrad alone left that bias gradient to Eigen's reduction instead of oneDNN's,
and after one step the biases differed from training without tfmemopt in their last
bits. The model below is a small convolutional autoencoder (ELU, SELU, spatial
dropout, batch norm, a transposed convolution) that the pass plans at 0.75 of its
predicted peak; each run is a fresh process on the capped BFC allocator.
"""

from conftest import capped_allocator_env, run_python, subprocess_result

ENV = capped_allocator_env(2048, TF_CPP_MIN_LOG_LEVEL="2")

SCRIPT = r'''
import hashlib, json, sys
import numpy as np
import tensorflow as tf
import keras
import tfmemopt
from tfmemopt.demo import keras_train_step

def build():
    keras.utils.set_random_seed(0)
    inp = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="elu")(inp)
    x = keras.layers.SpatialDropout2D(0.2)(x)
    x = keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="selu")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.UpSampling2D()(x)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="softplus")(x)
    x = keras.layers.GlobalMaxPooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(10)(x))
    rng = np.random.default_rng(0)
    xs = tf.constant(rng.random((16, 64, 64, 3), dtype=np.float32))
    ys = tf.constant(rng.integers(0, 10, size=(16,), dtype=np.int32))
    return model, xs, ys

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
out = {}
if sys.argv[1] == "tfmemopt":
    model, xs, ys = build()
    peak = tfmemopt.analyze(keras_train_step(model, loss), xs, ys).predicted_peak_bytes
    tfmemopt.enable(budget=int(0.75 * peak["before"]["CPU:0"]))
model, xs, ys = build()
step = keras_train_step(model, loss)
out["losses"] = [float(step(xs, ys).numpy()).hex() for _ in range(3)]
out["weights"] = [[v.path, hashlib.sha256(v.numpy().tobytes()).hexdigest()] for v in model.variables]
if sys.argv[1] == "tfmemopt":
    report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")][-1]
    out["changed"] = report.graph_changed
    out["order_edges"] = len(report.order_guard.get("edges", []))
    out["merges"] = report.onednn_merges
print("RESULT " + json.dumps(out))
'''


def train(mode):
    result = run_python(SCRIPT, mode, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return subprocess_result(result)


def test_control_edges_on_a_bias_gradient_keep_its_onednn_merge_and_results_bitwise():
    plain, planned = train("plain"), train("tfmemopt")
    # The plan pins its order, and some of those edges fell on merged pairs.
    assert planned["changed"] and planned["order_edges"] > 0
    merges = planned["merges"]
    assert merges["kept"]  # the plan fits without breaking a merge
    assert merges["pairs"] >= 3  # three Conv2DBackpropFilter + BiasAddGrad at least
    assert merges["edges_shared"] + merges["edges_removed"] + merges["edges_moved"] > 0
    assert merges["unmerged"] == []
    # Bit for bit: every loss and every variable (biases included) after three steps.
    assert planned["losses"] == plain["losses"]
    assert len(planned["weights"]) == len(plain["weights"])
    differing = [name for (name, digest), (_, mine) in zip(plain["weights"], planned["weights"])
                 if mine != digest]
    assert differing == []

