"""The tensor table and simulator on a real CNN train step: sizes, roles, peak."""

import tfmemopt
from tfmemopt.demo import keras_train_step, seed_cnn_train_step

BATCH = 128


def cnn_report(**fields):
    tfmemopt.enable(log_level=0, **fields)
    step, x, y = seed_cnn_train_step(BATCH)
    step(x, y)
    (report,) = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")]
    return report


def test_cnn_tensor_sizes_and_roles():
    report = cnn_report()
    by_name = {t.name: t for t in report.top_tensors_at_peak}
    # conv2 output: batch x 24 x 24 x 64 floats, produced by the forward pass.
    # (Keras numbers layer names per process, so match the op, not the name.)
    conv2 = [t for t in report.top_tensors_at_peak
             if t.op == "_FusedConv2D" and not t.name.startswith("gradient_tape/")]
    assert conv2, by_name
    sizes = {BATCH * 24 * 24 * 64 * 4, BATCH * 26 * 26 * 32 * 4}
    for tensor in conv2:
        assert tensor.bytes in sizes, tensor
        assert tensor.role == "activation", tensor
    grads = [t for t in report.top_tensors_at_peak if t.name.startswith("gradient_tape/")]
    assert grads and all(t.role == "gradient" for t in grads)


def test_cnn_persistent_memory_is_weights_and_adam_slots():
    report = cnn_report()
    params = (3 * 3 * 1 * 32 + 32) + (3 * 3 * 32 * 64 + 64) + (12 * 12 * 64 * 128 + 128) + (128 * 10 + 10)
    weights_and_slots = 3 * params * 4
    persistent = report.persistent_bytes["CPU:0"]
    assert weights_and_slots <= persistent <= weights_and_slots + 2**20


def test_peak_is_at_least_the_largest_live_set():
    report = cnn_report()
    peak = report.predicted_peak_bytes["before"]["CPU:0"]
    live = sum(t.bytes for t in report.top_tensors_at_peak)
    assert peak >= report.persistent_bytes["CPU:0"] + live
    assert report.to_dict()["devices"][0]["peak_step"] >= 0
    timeline = report.to_dict()["timeline"][0]
    assert len(timeline["activation_bytes"]) == report.num_nodes
    during = [a + g for a, g in zip(timeline["activation_bytes"], timeline["gradient_bytes"])]
    assert max(during) == peak - report.persistent_bytes["CPU:0"]
    assert during.index(max(during)) == report.to_dict()["devices"][0]["peak_step"]


def lstm_step(steps, batch=32, units=64):
    import numpy as np
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((steps, 16)), tf.keras.layers.LSTM(units), tf.keras.layers.Dense(10)])
    train_step = keras_train_step(
        model, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = tf.constant(np.ones((batch, steps, 16), np.float32))
    y = tf.constant(np.zeros((batch,), np.int32))
    return train_step, x, y


def test_loop_accumulators_grow_with_the_trip_count():
    # The forward loop pushes its activations into TensorLists for the backward
    # loop: with twice the time steps, the transient peak holds twice the activations.
    transient = {}
    for steps in (25, 50):
        report = tfmemopt.analyze(*lstm_step(steps), log_level=0)
        assert report.status == "ok"
        transient[steps] = report.predicted_peak_bytes["after"]["CPU:0"] - report.persistent_bytes["CPU:0"]
    # Per step, each accumulated gate activation is batch x units floats.
    per_step = 32 * 64 * 4
    assert transient[50] - transient[25] >= 25 * 4 * per_step
    assert transient[50] < 2.2 * transient[25]


def test_bfc_allocator_model_counts_whole_chunks():
    # Under TF's BFC allocator a tensor can occupy a larger free chunk (BFC splits
    # only chunks at least twice the request), so the predicted peak is the chunk
    # total, at least the live-tensor total; without BFC the two are the same.
    code = r'''
import json, tfmemopt
from tfmemopt.demo import seed_cnn_train_step
step, x, y = seed_cnn_train_step(512)
report = tfmemopt.analyze(step, x, y, log_level=0)
print("RESULT " + json.dumps(report.to_dict()["devices"][0]))
'''
    from conftest import capped_allocator_env, run_python, subprocess_result

    results = {}
    for name, env in (("bfc", capped_allocator_env(2048)),
                      ("plain", {"TF_CPU_ALLOCATOR_USE_BFC": "false"})):
        proc = run_python(code, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[name] = subprocess_result(proc)
    bfc, plain = results["bfc"], results["plain"]
    assert bfc["allocator"] == "bfc" and plain["allocator"] == "none"
    assert bfc["live_peak_bytes"] == plain["live_peak_bytes"] == plain["peak_after_bytes"]
    # The CNN's 72 MiB activations land in 128 MiB chunks: measured with
    # benchmarks/trace_step_memory.py (allocation records), modelled here.
    assert bfc["peak_after_bytes"] >= bfc["live_peak_bytes"] + 50 * 2**20
    assert bfc["peak_after_bytes"] <= 2 * bfc["live_peak_bytes"]
