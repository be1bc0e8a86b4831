"""tfmemopt.analyze() plans a train step without running it, and agrees with what
the pass reports when the same step really trains."""

import numpy as np
import pytest
import tensorflow as tf

import tfmemopt
from tfmemopt.demo import seed_cnn_train_step

BATCH = 128


def runtime_report(batch=BATCH):
    tfmemopt.enable(log_level=0)
    step, x, y = seed_cnn_train_step(batch)
    step(x, y)
    tfmemopt.disable()
    return [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")][-1]


def test_tf_function_analysis_matches_training_and_trains_nothing():
    step, x, y = seed_cnn_train_step(BATCH)
    concrete = step.get_concrete_function(x, y)
    before = [v.numpy() for v in concrete.variables]
    report = tfmemopt.analyze(step, x, y, budget="1GiB", log_level=0)
    after = [v.numpy() for v in concrete.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)  # nothing was trained
    assert report.status == "ok" and report.unresolved_tensors == 0
    assert report.devices == ["CPU:0"]
    assert report.budget_bytes == {"CPU:0": 2**30}
    trained = runtime_report()
    assert report.persistent_bytes["CPU:0"] == pytest.approx(trained.persistent_bytes["CPU:0"], abs=1024)
    assert report.predicted_peak_bytes["after"]["CPU:0"] == pytest.approx(
        trained.predicted_peak_bytes["after"]["CPU:0"], rel=0.10)


def test_concrete_function_gives_the_same_report_as_its_tf_function():
    step, x, y = seed_cnn_train_step(BATCH)
    from_function = tfmemopt.analyze(step, x, y, log_level=0)
    from_concrete = tfmemopt.analyze(step.get_concrete_function(x, y), log_level=0)
    assert from_concrete.predicted_peak_bytes == from_function.predicted_peak_bytes
    assert from_concrete.num_nodes == from_function.num_nodes


def test_keras_model_train_step():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((784,)),
        tf.keras.layers.Dense(512, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.zeros((64, 784), np.float32)
    y = np.zeros((64,), np.int32)
    report = tfmemopt.analyze(model, x=x, y=y, log_level=0)
    weights = (784 * 512 + 512 + 512 * 10 + 10) * 4
    assert report.unresolved_tensors == 0
    assert 3 * weights <= report.persistent_bytes["CPU:0"] <= 3 * weights + 2**16
    # The first layer's activations and their gradient are live at some step.
    assert report.predicted_peak_bytes["after"]["CPU:0"] >= 3 * weights + 64 * 512 * 4


def test_keras_model_with_several_inputs_and_outputs_takes_them_as_fit_does():
    tf.keras.utils.set_random_seed(0)
    tokens = tf.keras.Input((16,), dtype="int32", name="tokens")
    extra = tf.keras.Input((8,), name="extra")
    h = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(100, 32)(tokens))
    h = tf.keras.layers.Dense(256, activation="relu")(tf.keras.layers.Concatenate()([h, extra]))
    model = tf.keras.Model({"tokens": tokens, "extra": extra},
                           [tf.keras.layers.Dense(5, name="cls")(h),
                            tf.keras.layers.Dense(1, name="reg")(h)])
    model.compile(optimizer="adam",
                  loss=[tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"])
    x = {"tokens": np.zeros((64, 16), np.int32), "extra": np.zeros((64, 8), np.float32)}
    y = [np.zeros((64,), np.int64), np.zeros((64, 1), np.float32)]  # of two dtypes
    report = tfmemopt.analyze(model, x=x, y=y, log_level=0)
    assert report.status == "ok" and report.unresolved_tensors == 0
    # The hidden layer's activations (64 x 256 floats) are live at some step.
    assert report.predicted_peak_bytes["after"]["CPU:0"] >= (
        report.persistent_bytes["CPU:0"] + 64 * 256 * 4)


def test_keras_model_whose_loss_is_its_own_needs_no_y():
    tf.keras.utils.set_random_seed(0)

    class Autoencoder(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.encode = tf.keras.layers.Dense(64, activation="relu")
            self.decode = tf.keras.layers.Dense(32)

        def call(self, x):
            out = self.decode(self.encode(x))
            self.add_loss(tf.reduce_mean(tf.square(out - x)))
            return out

    model = Autoencoder()
    model.compile(optimizer="sgd")
    report = tfmemopt.analyze(model, x=np.zeros((128, 32), np.float32), log_level=0)
    assert report.status == "ok" and report.num_nodes > 10


def test_bad_arguments():
    step, x, y = seed_cnn_train_step(8)
    with pytest.raises(TypeError, match="fn=.*allowed: a tf.function"):
        tfmemopt.analyze(lambda a: a, x)
    with pytest.raises(ValueError, match="x= and y= are for Keras models"):
        tfmemopt.analyze(step, x=x, y=y)
    with pytest.raises(ValueError, match="unknown field 'bogus'"):
        tfmemopt.analyze(step, x, y, bogus=1)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="compile"):
        tfmemopt.analyze(model, x=np.zeros((2, 4), np.float32), y=np.zeros((2, 1), np.float32))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="x="):
        tfmemopt.analyze(model)


def test_an_unplaced_metagraph_gets_the_hosts_memory_not_grapplers_nominal_cpu():
    # Grappler's cluster gives its CPU a nominal 256 MiB; an unplaced graph runs on the
    # host's CPU, so the default budget (0.9) is of the host's RAM.
    from conftest import build_v1_mlp_train_op

    graph = tf.Graph()
    with graph.as_default():
        build_v1_mlp_train_op()
        metagraph = tf.compat.v1.train.export_meta_graph(graph=graph)
    assert not any(node.device for node in metagraph.graph_def.node)
    report = tfmemopt.analyze_metagraph(metagraph, log_level=0)
    (device,) = report.to_dict()["devices"]
    assert device["memory_source"] == "host_ram", device
    assert device["memory_bytes"] > 2**30
    assert report.budget_bytes[device["device"]] == int(0.9 * device["memory_bytes"])
