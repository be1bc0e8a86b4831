"""tfmemopt.enable() reaches every place TF builds a training graph, and the pass
reports what it found there without changing the results."""

import json
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfmemopt
from tfmemopt import _eager_context
from conftest import (
    BATCH, CLASSES, FEATURES, HIDDEN, build_v1_mlp_train_op, capped_allocator_env, mlp_batch,
    make_mlp_train_step, mlp_variables, reports_for, run_mlp_steps, run_python,
)

STEP = "__inference_train_step"
# The MLP step's inputs with an unknown batch dimension.
UNKNOWN_BATCH = [tf.TensorSpec([None, FEATURES], tf.float32), tf.TensorSpec([None], tf.int32)]


def test_tf_function_in_main_thread_gets_a_report():
    tfmemopt.enable("1GiB")
    run_mlp_steps(steps=1)
    (report,) = reports_for(STEP)
    assert report.status == "ok"
    assert report.mode == "AUTO"
    assert report.num_nodes > 20 and report.num_tensors > 20
    assert report.devices == ["CPU:0"]
    assert report.budget_bytes == {"CPU:0": 2**30}
    assert report.fits is True
    assert report.unresolved_tensors == 0
    assert 0 < len(report.top_tensors_at_peak) <= 10
    sizes = [t.bytes for t in report.top_tensors_at_peak]
    assert sizes == sorted(sizes, reverse=True)
    text = report.to_text()
    assert report.graph_id in text and "predicted peak" in text
    assert report.to_dict()["graph_id"] == report.graph_id


def test_predicted_memory_matches_the_model():
    tfmemopt.enable("1GiB")
    run_mlp_steps(steps=1)
    (report,) = reports_for(STEP)
    weights = (FEATURES * HIDDEN + HIDDEN * CLASSES) * 4
    # Variables are persistent; constants add a few bytes.
    assert weights <= report.persistent_bytes["CPU:0"] <= weights + 4096
    # At some step the gradient of w1 is live together with the weights.
    peak = report.predicted_peak_bytes["before"]["CPU:0"]
    assert peak >= weights + FEATURES * HIDDEN * 4
    batch = BATCH * FEATURES * 4  # the caller's x, live all step
    assert peak <= 3 * weights + batch  # nothing counted twice
    assert report.predicted_peak_bytes["after"] == report.predicted_peak_bytes["before"]


def test_a_new_thread_gets_a_report():
    tfmemopt.enable("1GiB")
    errors = []

    def worker():
        try:
            run_mlp_steps(steps=1)
        except Exception as err:  # surfaced below
            errors.append(err)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors
    (report,) = reports_for(STEP)
    assert report.status == "ok" and report.devices == ["CPU:0"]


def test_losses_and_weights_are_bitwise_equal_with_and_without_enable():
    baseline_losses, baseline_weights = run_mlp_steps(steps=3)
    tfmemopt.enable(0.5)
    losses, weights = run_mlp_steps(steps=3)
    assert reports_for(STEP)  # the pass really ran on the second graph
    np.testing.assert_array_equal(losses, baseline_losses)
    for got, want in zip(weights, baseline_weights):
        np.testing.assert_array_equal(got, want)


def test_enable_survives_set_experimental_options():
    saved = tf.config.optimizer.get_experimental_options()
    try:
        tfmemopt.enable("1GiB")
        tf.config.optimizer.set_experimental_options({"constant_folding": True})
        rewrite = _eager_context.current_rewrite_options()
        assert rewrite.constant_folding == rewrite.ON
        (entry,) = [c for c in rewrite.custom_optimizers if c.name == "TfMemOpt"]
        assert entry.parameter_map["budget_bytes"].i == 2**30
        run_mlp_steps(steps=1)
        assert len(reports_for(STEP)) == 1
    finally:
        tf.config.optimizer.set_experimental_options(saved)


def test_disable_stops_the_pass():
    tfmemopt.enable("1GiB")
    tfmemopt.disable()
    assert tfmemopt.enabled_config() is None
    assert not _eager_context.current_rewrite_options().custom_optimizers
    run_mlp_steps(steps=1)
    assert reports_for(STEP) == []


def test_enable_again_replaces_the_config():
    tfmemopt.enable("1GiB")
    tfmemopt.enable("2GiB", mode="ANALYZE_ONLY")
    run_mlp_steps(steps=1)
    (report,) = reports_for(STEP)
    assert report.budget_bytes == {"CPU:0": 2 * 2**30}
    assert report.mode == "ANALYZE_ONLY"


def test_over_budget_graph_is_reported_as_not_fitting():
    tfmemopt.enable(1024)  # bytes: far below the weights alone
    run_mlp_steps(steps=1)
    (report,) = reports_for(STEP)
    assert report.fits is False


def test_unknown_batch_dimension_is_resolved_by_assume_batch_size():
    tfmemopt.enable("1GiB")
    run_mlp_steps(steps=1)
    (known,) = reports_for(STEP)
    # Planned without a call (nothing tells the batch), the unknown dimension stays
    # unknown and the report says what resolves it.
    variables = mlp_variables()
    step = make_mlp_train_step(variables, input_signature=UNKNOWN_BATCH)
    unknown = tfmemopt.analyze(step, *mlp_batch(), budget="1GiB", log_level=0)
    assert unknown.unresolved_tensors > 0
    assert "assume_batch_size" in unknown.to_text()
    tfmemopt.clear_reports()
    tfmemopt.enable("1GiB", assume_batch_size=BATCH)
    run_mlp_steps(steps=1, input_signature=UNKNOWN_BATCH)
    (resolved,) = reports_for(STEP)
    assert resolved.unresolved_tensors == 0
    assert resolved.to_dict()["batch_dims_resolved"] > 0
    # The dynamic-shape graph has a few extra shape ops (tens of bytes), otherwise
    # the same tensors.
    assert resolved.predicted_peak_bytes["before"]["CPU:0"] == pytest.approx(
        known.predicted_peak_bytes["before"]["CPU:0"], rel=1e-3)


def test_a_call_tells_the_unknown_batch_that_the_config_does_not():
    # Under enable() without assume_batch_size, the eager call gives the pass the batch
    # of its inputs (tfmemopt.call_batch): sized as with the batch in the signature.
    tfmemopt.enable("1GiB")
    run_mlp_steps(steps=1)
    (known,) = reports_for(STEP)
    tfmemopt.clear_reports()
    run_mlp_steps(steps=1, input_signature=UNKNOWN_BATCH)
    (called,) = reports_for(STEP)
    assert called.unresolved_tensors == 0
    assert called.to_dict()["assume_batch_size"] == BATCH
    assert called.predicted_peak_bytes["before"]["CPU:0"] == pytest.approx(
        known.predicted_peak_bytes["before"]["CPU:0"], rel=1e-3)


def test_dimensions_left_unknown_with_the_batch_given_are_taken_as_the_batch(tmp_path):
    # boolean_mask keeps rows known only when the step runs: with assume_batch_size
    # they are taken as the batch (at most what is kept), not as 1, and the report
    # says so instead of asking for what is already set.
    weights = tf.Variable(tf.ones([FEATURES, CLASSES]))

    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32)])
    def masked_step(x):
        with tf.GradientTape() as tape:
            kept = tf.boolean_mask(x, x[:, 0] > 0.5)
            loss = tf.reduce_sum(tf.matmul(kept, weights))
        return tape.gradient(loss, weights)

    tfmemopt.enable("1GiB", assume_batch_size=BATCH)
    x, _ = mlp_batch(batch=BATCH)
    masked_step(x)
    (report,) = reports_for("__inference_masked_step")
    assert report.unresolved_tensors == 0
    assert report.to_dict()["batch_dims_assumed"] > 0
    # The kept rows are sized as the whole batch: the prediction holds x twice over.
    assert report.predicted_peak_bytes["before"]["CPU:0"] >= 2 * BATCH * FEATURES * 4
    text = report.to_text()
    assert f"taken as assume_batch_size={BATCH}" in text
    assert "set assume_batch_size" not in text
    report.to_html(tmp_path / "report.html")
    assert "set assume_batch_size" not in (tmp_path / "report.html").read_text()


def test_a_recurrent_step_traced_with_an_unknown_batch_is_sized_as_with_the_batch_known():
    # Keras fit traces its step with an unknown batch when the data ends in a partial
    # batch; inside the LSTM's loops TF's shape inference loses the batch symbol, so
    # assume_batch_size must size those tensors too: counted as 1, the step was
    # predicted at 2.6 MB against 34.8 MB with the batch known.
    tf.keras.utils.set_random_seed(0)
    batch = 256
    layer = tf.keras.layers.LSTM(64, return_sequences=True)
    head = tf.keras.layers.Dense(1)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(head(layer(x)))
        return tape.gradient(loss, layer.trainable_variables + head.trainable_variables)

    x = tf.ones([batch, 50, 16])
    head(layer(x))
    known = tfmemopt.analyze(tf.function(step), x, log_level=0)
    unknown = tf.function(step, input_signature=[tf.TensorSpec([None, 50, 16])])
    assumed = tfmemopt.analyze(unknown, x, assume_batch_size=batch, log_level=0)
    assert known.unresolved_tensors == 0
    assert assumed.to_dict()["batch_dims_assumed"] > 0
    # What stays unsized is of unknown rank (the gradient loop's merges of lists).
    assert assumed.predicted_peak_bytes["before"]["CPU:0"] == pytest.approx(
        known.predicted_peak_bytes["before"]["CPU:0"], rel=0.15)


def test_keras_fit_gets_a_report():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((FEATURES,)),
        tf.keras.layers.Dense(HIDDEN, activation="relu"),
        tf.keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer="adam",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = mlp_batch(batch=4 * BATCH)
    tfmemopt.enable("1GiB", assume_batch_size=BATCH)
    model.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, verbose=0)
    # Under enable() fit runs Keras's own step, its batches read beforehand by the
    # feedback loop (fit_retries) and replayed through an iterator of the data's spec.
    train = [r for r in tfmemopt.reports() if "multi_step_on_iterator" in r.graph_id]
    assert train, [r.graph_id for r in tfmemopt.reports()]
    report = train[-1]
    assert report.status == "ok"
    # Keras weights plus Adam's two slots per weight are persistent.
    weights = (FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES) * 4
    assert report.persistent_bytes["CPU:0"] >= 3 * weights


def compile_linear(model):
    model.compile(optimizer="adam",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def compiled_linear_model():
    """One Dense layer from FEATURES to CLASSES logits, compiled with Adam."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])
    compile_linear(model)
    return model


def test_keras_fits_under_enable_plan_the_step_once_until_the_model_is_compiled_again():
    """A fit per epoch must not re-trace and re-plan the step each time: the second and
    third fits run the graph the first planned, and compile() (a new train function)
    gets a new plan."""
    model, (x, y) = compiled_linear_model(), mlp_batch(batch=4 * BATCH)
    tfmemopt.clear_reports()
    tfmemopt.enable("1GiB")

    def train_graphs():
        return [r.graph_id for r in tfmemopt.reports() if "multi_step_on_iterator" in r.graph_id]

    for _ in range(3):
        model.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, verbose=0)
    assert len(train_graphs()) == 1, train_graphs()
    compile_linear(model)
    model.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, verbose=0)
    assert len(train_graphs()) == 2, train_graphs()


def test_keras_fit_with_fit_retries_0_plans_keras_own_step():
    model, (x, y) = compiled_linear_model(), mlp_batch(batch=4 * BATCH)
    tfmemopt.clear_reports()
    tfmemopt.enable("1GiB", assume_batch_size=BATCH, fit_retries=0)
    callbacks = []
    model.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
    ids = [r.graph_id for r in tfmemopt.reports()]
    assert any("multi_step_on_iterator" in i for i in ids), ids
    assert not any("one_step_on_data" in i for i in ids), ids
    assert callbacks == []  # the user's list is never changed


def test_forced_internal_failure_returns_the_original_graph(capfd):
    baseline_losses, baseline_weights = run_mlp_steps(steps=2)
    for stage in ("analyze", "simulate", "plan", "verify", "report"):
        tfmemopt.clear_reports()
        tfmemopt.enable("1GiB", test_only_fail_stage=stage)
        losses, weights = run_mlp_steps(steps=2)
        np.testing.assert_array_equal(losses, baseline_losses)
        np.testing.assert_array_equal(weights[0], baseline_weights[0])
        (report,) = reports_for(STEP)
        assert report.status == "fallback"
        assert report.failed_stage == stage
        assert "forced failure" in report.message
        assert not report.graph_changed
    err = capfd.readouterr().err
    line = [l for l in err.splitlines() if "TfMemOpt: graph __inference_train_step" in l and "failed" in l]
    assert line and "the original graph is used" in line[-1]


def test_v1_session_with_config_proto_gets_a_report():
    xv, yv = mlp_batch()
    with tf.Graph().as_default():
        x, y, train_op = build_v1_mlp_train_op()
        config = tfmemopt.config_proto("1GiB")
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, {x: xv.numpy(), y: yv.numpy()})
    # One report per Session.run graph: the initializer, then the train step.
    reports = tfmemopt.reports()
    assert [r.graph_id for r in reports] == ["tf_graph", "tf_graph"]
    report = reports[-1]
    assert report.status == "ok"
    assert report.budget_bytes and set(report.budget_bytes.values()) == {2**30}
    weights = (FEATURES * HIDDEN + HIDDEN * CLASSES) * 4
    assert sum(report.persistent_bytes.values()) >= weights


def test_mirrored_strategy_over_two_cpus_reports_both_devices():
    code = r'''
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tfmemopt
tfmemopt.enable("1GiB")
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    w = tf.Variable(tf.ones([256, 256]) * 0.01)
@tf.function
def train_step(x):
    def replica(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    return strategy.reduce("SUM", strategy.run(replica, args=(x,)), axis=None)
print("LOSS", float(train_step(tf.ones([64, 256]))))
devices = set()
for r in tfmemopt.reports():
    if r.graph_id.startswith("__inference_train_step"):
        devices |= set(r.devices)
print("DEVICES", sorted(devices))
'''
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DEVICES ['CPU:0', 'CPU:1']" in result.stdout, result.stdout + result.stderr[-2000:]


def test_logical_cpus_on_one_capped_allocator_are_each_budgeted_their_share():
    """Two logical CPUs allocate from the one BFC pool of the test bed: with the default
    budget (0.9 of device memory), each replica of a MirroredStrategy step is planned
    under 0.9 of half the pool, so that the two, which peak together, fit it; and the
    step is guarded by enable()'s retry like any other."""
    code = r'''
import json, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tfmemopt
from tfmemopt import function_guard
tfmemopt.enable(log_level=0)
guarded = []
snapshot = function_guard._snapshot
def watched(function, args):
    made = snapshot(function, args)
    guarded.append(made is not None)
    return made
function_guard._snapshot = watched
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    w = tf.Variable(tf.ones([256, 256]) * 0.01)
    opt = keras.optimizers.SGD(0.1)
    opt.build([w])
@tf.function
def train_step(x):
    def replica(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        opt.apply_gradients([(tape.gradient(loss, w), w)])  # an all-reduce
        return loss
    return strategy.reduce("SUM", strategy.run(replica, args=(x,)), axis=None)
train_step(tf.ones([64, 256]))
report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")][-1]
print("DEVICES " + json.dumps({d["device"]: d for d in report.to_dict()["devices"]}))
print("GUARDED " + json.dumps(guarded))
print(report.to_text())
'''
    result = run_python(code, env=capped_allocator_env(512))
    assert result.returncode == 0, result.stderr[-3000:]
    line = [l for l in result.stdout.splitlines() if l.startswith("DEVICES ")][-1]
    devices = json.loads(line[len("DEVICES "):])
    assert sorted(devices) == ["CPU:0", "CPU:1"]
    for device in devices.values():
        assert device["memory_bytes"] == 256 << 20 and device["memory_shared_by"] == 2
        assert device["budget_bytes"] <= int(0.9 * (256 << 20))
    assert "its share of one pool for 2 CPU devices" in result.stdout
    # The replicated step is guarded (retried if it runs out of memory): the ordering
    # tokens of its all-reduce are no state a retry would repeat.
    line = [l for l in result.stdout.splitlines() if l.startswith("GUARDED ")][-1]
    assert json.loads(line[len("GUARDED "):]) and all(json.loads(line[len("GUARDED "):]))


def test_one_info_line_per_graph(capfd):
    tfmemopt.enable("1GiB")
    run_mlp_steps(steps=1)
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if "TfMemOpt: graph __inference_train_step" in l]
    assert len(lines) == 1, lines
    assert "nodes, predicted peak CPU:0" in lines[0] and "(budget 1.00 GiB)" in lines[0]


def test_log_level_zero_is_silent(capfd):
    tfmemopt.enable("1GiB", log_level=0)
    run_mlp_steps(steps=1)
    assert "TfMemOpt: graph" not in capfd.readouterr().err
    assert reports_for(STEP)  # still reported to Python


def test_a_thread_that_ran_functions_before_enable_picks_it_up():
    # The worker runs a tf.function (caching its thread's options) before enable(),
    # and traces a new one after it; disable() reaches it the same way.
    from conftest import make_mlp_train_step, mlp_batch, mlp_variables

    go = [threading.Event() for _ in range(3)]
    done = [threading.Event() for _ in range(3)]
    errors = []

    def worker():
        try:
            x, y = mlp_batch()
            for phase in range(3):
                go[phase].wait(60)
                make_mlp_train_step(mlp_variables())(x, y)
                done[phase].set()
        except Exception as err:  # surfaced below
            errors.append(err)
            for event in done:
                event.set()

    thread = threading.Thread(target=worker)
    thread.start()
    counts = []
    for phase, action in enumerate((lambda: None, lambda: tfmemopt.enable("1GiB"),
                                    tfmemopt.disable)):
        action()
        go[phase].set()
        done[phase].wait(60)
        counts.append(len(reports_for(STEP)))
    thread.join(60)
    assert not errors
    assert counts == [0, 1, 1]  # none before enable(), one after, none added after disable()
