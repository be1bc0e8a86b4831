"""tfmemopt.keras.MemoryOptimizer: the pass on Keras `fit`, with its report.

The model is an 8-layer ReLU MLP at batch 1024 (each activation 1 MiB, the default
min_tensor_bytes). With whole batches Keras traces the step with a static batch
dimension; data with a partial last batch makes it unknown, which is what
`assume_batch_size` (set by the callback from `fit`) stands in for.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfmemopt
from tfmemopt import _eager_context
from tfmemopt.keras import MemoryOptimizer

BATCH, WIDTH, DEPTH = 1024, 256, 8
SAMPLES = 3 * BATCH
PARTIAL = 3 * BATCH + 100  # a partial last batch: the batch dimension is unknown


def mlp(jit_compile=False, first_layer=None):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((WIDTH,))]
    if first_layer is not None:
        layers.append(first_layer)
    layers += [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=jit_compile)
    return model


def data(samples=SAMPLES):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((samples, WIDTH)).astype(np.float32),
            rng.standard_normal((samples, 1)).astype(np.float32))


def fit(model, callbacks=(), epochs=2, samples=SAMPLES, **kwargs):
    x, y = data(samples)
    kwargs.setdefault("batch_size", BATCH)
    history = model.fit(x, y, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks), **kwargs)
    return history.history["loss"]


def train_step_reports():
    """Reports of Keras step graphs (train and test) in this process."""
    return [r for r in tfmemopt.reports()
            if "multi_step_on_iterator" in r.graph_id or "one_step_on_data" in r.graph_id]


def activation_bytes(report):
    """Bytes of the largest forward activation (a Dense layer's output) at the peak."""
    return max(t.bytes for t in report.top_tensors_at_peak
               if t.role == "activation" and t.op == "_FusedMatMul")


@pytest.fixture(scope="module")
def peak_without_rewrite():
    """The train step's predicted peak, from an ANALYZE_ONLY fit."""
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    fit(mlp(), [callback], epochs=1)
    tfmemopt.clear_reports()
    return callback.report.predicted_peak_bytes["before"]["CPU:0"]


def test_fit_reports_the_train_step_and_recomputes_under_a_tight_budget(peak_without_rewrite):
    budget = int(0.75 * peak_without_rewrite)
    callback = MemoryOptimizer(budget=budget, log_level=0)
    fit(mlp(), [callback])

    report = callback.report
    assert report is not None and report.status == "ok"
    assert "multi_step_on_iterator" in report.graph_id  # the step fit runs without it
    # Only the train step's graph: its plan, and a re-plan under a lower budget when
    # its first steps measured over the budget (the allocator's order varies by run).
    assert {r.graph_id for r in callback.reports} == {report.graph_id}
    first = callback.reports[0]
    assert first.budget_bytes["CPU:0"] == budget
    assert report.budget_bytes["CPU:0"] <= budget
    # The plan under the user's budget recomputes; a calibrated re-plan under a lower
    # budget may swap instead (swapping is what the planner picks there).
    assert first.graph_changed and first.recomputed_ops
    assert report.graph_changed
    # (ANALYZE_ONLY and AUTO see the step after slightly different built-in passes.)
    assert first.predicted_peak_bytes["before"]["CPU:0"] == pytest.approx(
        peak_without_rewrite, rel=0.01)
    for planned in callback.reports:
        assert planned.predicted_peak_bytes["after"]["CPU:0"] <= planned.budget_bytes["CPU:0"]


def test_losses_are_bitwise_those_of_fit_without_the_callback(peak_without_rewrite):
    plain = fit(mlp())
    callback = MemoryOptimizer(budget=int(0.75 * peak_without_rewrite), log_level=0)
    optimized = fit(mlp(), [callback])
    assert callback.report.graph_changed
    assert optimized == plain  # Python floats: bitwise


def pipeline(samples=SAMPLES):
    """A tf.data pipeline of data(): its element spec's batch dimension is None."""
    dataset = tf.data.Dataset.from_tensor_slices(data(samples)).batch(BATCH)
    assert dataset.element_spec[0].shape[0] is None
    return dataset


def test_a_tf_data_fit_runs_the_step_keras_traced_for_its_pipeline(peak_without_rewrite):
    # The guarded first steps read their batches beforehand (a retry needs them) and
    # replay them through an iterator of the pipeline's own element spec, so TF runs
    # the train function Keras traced for the pipeline, batch dimension unknown, as
    # fit without tfmemopt does. A step traced on the batches' static shapes is
    # another graph, whose kernels TF may choose otherwise (oneDNN's bfloat16
    # convolutions on an AVX-512 CPU: losses differ in the last bits).
    plain = mlp().fit(pipeline(), epochs=2, verbose=0).history["loss"]
    callback = MemoryOptimizer(budget=int(0.75 * peak_without_rewrite), log_level=0)
    optimized = mlp().fit(pipeline(), epochs=2, verbose=0, callbacks=[callback])
    assert callback.reports and callback.report.graph_changed
    # One trace, of the function that takes the iterator: no step on static shapes.
    assert [r.graph_id for r in callback.reports if "one_step_on_data" in r.graph_id] == []
    assert "multi_step_on_iterator" in callback.report.graph_id
    assert callback.report.to_dict()["assume_batch_size"] == BATCH
    assert optimized.history["loss"] == plain  # Python floats: bitwise


def small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_tf_data_fit_whose_plan_needs_a_split_runs_on_the_batches_own_shapes(caplog):
    # The pipeline's step has no static batch size, so it cannot be split. When its
    # plan misses the budget, the next steps run on the batches' own shapes (a trace
    # of their own), which can be split: the report of that graph shows the split.
    caplog.set_level(logging.INFO, logger="tensorflow")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * 64, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, 4 * 64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    probe = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    small_cnn().fit(dataset, epochs=1, verbose=0, callbacks=[probe])
    assert probe.report.split.get("batch", 0) == 0  # the pipeline's graph: unknown batch
    before = probe.report.predicted_peak_bytes["before"]["CPU:0"]
    callback = MemoryOptimizer(budget=int(0.3 * before), log_level=0)
    history = small_cnn().fit(dataset, epochs=1, verbose=0, callbacks=[callback])
    first, last = callback.reports[0], callback.reports[-1]
    assert "multi_step_on_iterator" in first.graph_id and first.fits is False
    assert "splitting it along the batch needs a static batch size" in caplog.text
    assert "one_step_on_data" in last.graph_id
    assert last.split["applied"] and last.split["batch"] == 64 and last.split["slices"] >= 2
    assert last.predicted_peak_bytes["after"]["CPU:0"] < first.predicted_peak_bytes["after"]["CPU:0"]
    assert all(np.isfinite(history.history["loss"]))


def test_a_fit_of_several_steps_per_execution_whose_plan_misses_runs_one_batch_at_a_time(
        caplog):
    # Keras runs steps_per_execution steps in a while loop, whose ops the pass never
    # swaps, recomputes or splits: the plan of that graph cannot lower its peak. The
    # next steps run one batch at a time (one_step_on_data), which can be split, and
    # the warning names the loop, not the batch size.
    caplog.set_level(logging.INFO, logger="tensorflow")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * 64, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, 8 * 64)

    def model():
        made = small_cnn()
        made.compile(keras.optimizers.SGD(0.01),
                     keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     steps_per_execution=4)
        return made
    probe = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    model().fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False, callbacks=[probe])
    before = probe.report.predicted_peak_bytes["before"]["CPU:0"]
    callback = MemoryOptimizer(budget=int(0.3 * before), log_level=0)
    history = model().fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False,
                          callbacks=[callback])
    first, last = callback.reports[0], callback.reports[-1]
    assert "multi_step_on_iterator" in first.graph_id and first.fits is False
    assert "steps_per_execution=4 times in a loop" in caplog.text
    assert "static batch size" not in caplog.text
    assert "one_step_on_data" in last.graph_id
    assert last.split["applied"] and last.split["slices"] >= 2
    assert last.predicted_peak_bytes["after"]["CPU:0"] < first.predicted_peak_bytes["after"]["CPU:0"]
    assert all(np.isfinite(history.history["loss"]))


def test_assume_batch_size_comes_from_the_batch_size_of_fit(caplog):
    caplog.set_level(logging.INFO, logger="tensorflow")
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    fit(mlp(), [callback], epochs=1, samples=PARTIAL, batch_size=512)
    assert "tfmemopt: assume_batch_size=512, the batch size of this fit" in caplog.text
    assert callback.report.to_dict()["assume_batch_size"] == 512


def test_batch_size_of_a_tf_data_pipeline_is_its_batch_argument(caplog):
    caplog.set_level(logging.INFO, logger="tensorflow")
    x, y = data(PARTIAL)
    # No drop_remainder: the element spec's batch dimension is None.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(256).prefetch(1)
    assert dataset.element_spec[0].shape[0] is None
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    mlp().fit(dataset, epochs=1, verbose=0, callbacks=[callback])
    assert "tfmemopt: assume_batch_size=256, the batch size of this fit" in caplog.text
    assert callback.report.to_dict()["assume_batch_size"] == 256


def test_an_explicit_assume_batch_size_wins():
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0, assume_batch_size=64)
    fit(mlp(), [callback], epochs=1, samples=PARTIAL)
    assert callback.report.to_dict()["assume_batch_size"] == 64


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_a_generator_gives_no_batch_size_and_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="tensorflow")
    x, y = data(PARTIAL)

    def batches():
        for start in range(0, PARTIAL, BATCH):
            yield x[start:start + BATCH], y[start:start + BATCH]

    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    mlp().fit(batches(), epochs=1, verbose=0, callbacks=[callback])
    assert "the batch size of this fit is unknown" in caplog.text
    assert "Pass MemoryOptimizer(assume_batch_size=N)" in caplog.text
    assert callback.report.to_dict()["assume_batch_size"] == 0
    # Under enable() alone the warning names the call the user wrote.
    caplog.clear()
    tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
    mlp().fit(batches(), epochs=1, verbose=0)
    assert "Pass tfmemopt.enable(..., assume_batch_size=N)" in caplog.text


def test_the_batch_dimension_of_the_keras_step_is_resolved():
    # A partial last batch leaves the step's batch dimension unknown; it enters
    # through IteratorGetNext, and assume_batch_size resolves it.
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    fit(mlp(), [callback], epochs=1, samples=PARTIAL)
    assert activation_bytes(callback.report) == BATCH * WIDTH * 4


def test_a_step_traced_by_an_earlier_fit_is_optimized_too(peak_without_rewrite):
    model = mlp()
    fit(model, epochs=1)  # traces the train step without tfmemopt
    assert not train_step_reports()
    callback = MemoryOptimizer(budget=int(0.75 * peak_without_rewrite), log_level=0)
    fit(model, [callback], epochs=1)
    assert callback.report is not None and callback.report.graph_changed


def test_every_fit_with_the_callback_gets_its_own_report():
    # The second fit has the same config as the first: without a fresh trace TF would
    # reuse the first fit's instantiation and the pass would not run (or report).
    model = mlp()
    first = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    second = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    fit(model, [first], epochs=1)
    fit(model, [second], epochs=1)
    assert first.report is not None and second.report is not None
    assert first.report.graph_id != second.report.graph_id


def test_validation_graphs_are_not_taken_for_the_train_step():
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0)
    x, y = data(2 * BATCH)
    mlp().fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x, y),
              callbacks=[callback])
    graphs = train_step_reports()
    assert len(graphs) == 2  # the train step, then the test step
    assert [r.graph_id for r in callback.reports] == [graphs[0].graph_id]
    # Only the train step has gradients.
    assert any(t.role == "gradient" for t in callback.report.top_tensors_at_peak)


def test_the_report_is_logged_and_its_timeline_plotted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorflow")
    path = tmp_path / "train_step.png"
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0, plot_to=str(path))
    fit(mlp(), [callback], epochs=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"TfMemOpt report for graph {callback.report.graph_id}" in caplog.text
    assert f"memory timeline saved to {path}" in caplog.text


def test_print_report_false_logs_no_report(caplog):
    caplog.set_level(logging.INFO, logger="tensorflow")
    callback = MemoryOptimizer(mode="ANALYZE_ONLY", log_level=0, print_report=False)
    fit(mlp(), [callback], epochs=1)
    assert callback.report is not None
    assert "TfMemOpt report" not in caplog.text


class EnabledDuringFit(keras.callbacks.Callback):
    """Records the tfmemopt config in force at each train batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(tfmemopt.enabled_config())


def test_the_pass_is_enabled_during_fit_only():
    probe, model = EnabledDuringFit(), mlp()
    fit(model, [MemoryOptimizer(budget="1GiB", log_level=0), probe], epochs=1)
    assert probe.seen and all(c is not None and c.budget_bytes == 2**30 for c in probe.seen)
    assert tfmemopt.enabled_config() is None
    assert model.train_function.__name__ == "function"  # Keras's own, unwrapped
    assert not any(c.name == tfmemopt.PASS_NAME
                   for c in _eager_context.current_rewrite_options().custom_optimizers)


def test_a_previous_enable_is_restored_after_fit():
    before = tfmemopt.enable(budget=0.5, log_level=0, exclude_scopes=["head"])
    probe = EnabledDuringFit()
    fit(mlp(), [MemoryOptimizer(budget="1GiB", log_level=0), probe], epochs=1)
    assert probe.seen[0].budget_bytes == 2**30
    assert tfmemopt.enabled_config() == before
    [entry] = [c for c in _eager_context.current_rewrite_options().custom_optimizers
               if c.name == tfmemopt.PASS_NAME]
    assert entry == tfmemopt.custom_optimizer_entry(before)


class FailOnNaN(keras.layers.Layer):
    def call(self, x):
        return tf.debugging.assert_all_finite(x, "input has NaN")


def test_the_state_is_restored_when_fit_fails():
    model = mlp(first_layer=FailOnNaN())
    x, y = data()
    x[BATCH + 3, 0] = np.nan  # the second batch fails
    with pytest.raises(tf.errors.InvalidArgumentError, match="input has NaN"):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[MemoryOptimizer(log_level=0)])
    assert tfmemopt.enabled_config() is None


class StopWithAnError(keras.callbacks.Callback):
    """Stops fit with an exception from a callback, as TerminateOnNaN(raise_error=True)
    does: Keras then skips every callback's on_train_end."""

    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("stopped by a callback")


def test_the_state_is_restored_when_a_callback_stops_fit():
    model = mlp()
    with pytest.raises(RuntimeError, match="stopped by a callback"):
        fit(model, [MemoryOptimizer(budget=1, log_level=0), StopWithAnError()], epochs=1)
    assert tfmemopt.enabled_config() is None  # not left on for the script's next graphs
    assert model.train_function.__name__ == "function"  # Keras's own, unwrapped


def test_enable_is_as_it_was_when_a_callback_stops_fit():
    before = tfmemopt.enable(budget=1, log_level=0)
    try:
        model = mlp()
        with pytest.raises(RuntimeError, match="stopped by a callback"):
            fit(model, [StopWithAnError()], epochs=1)
        # The fit's own fields (its batch size as assume_batch_size) are gone: a later
        # graph is planned under enable()'s config, not under this fit's.
        assert tfmemopt.enabled_config() == before
        assert model.train_function.__name__ == "function"
        assert fit(model, epochs=1)  # the next fit trains
    finally:
        tfmemopt.disable()


def test_the_callback_is_tfmemopt_keras_memory_optimizer():
    assert tfmemopt.keras.MemoryOptimizer is MemoryOptimizer
    assert isinstance(MemoryOptimizer(), keras.callbacks.Callback)


def test_invalid_fields_are_rejected_when_the_callback_is_made():
    with pytest.raises(ValueError) as made:
        MemoryOptimizer(budget=2.0)
    with pytest.raises(ValueError) as enabled:
        tfmemopt.enable(budget=2.0)
    assert str(made.value) == str(enabled.value)
    with pytest.raises(ValueError, match=r"unknown field 'budget_byte' \(did you mean 'budget_bytes'\?\)"):
        MemoryOptimizer(budget_byte=1)
    with pytest.raises(TypeError, match="log_level"):
        MemoryOptimizer(log_level="loud")
    with pytest.raises(ValueError, match="min_tensor_bytes"):
        MemoryOptimizer(min_tensor_bytes=-5)


def test_xla_gets_one_clear_warning_and_no_pass(caplog):
    caplog.set_level(logging.WARNING, logger="tensorflow")
    model = mlp(jit_compile=True)
    callback, probe = MemoryOptimizer(log_level=0), EnabledDuringFit()
    fit(model, [callback, probe], epochs=1)
    fit(model, [callback, probe], epochs=1)
    warnings = [r.getMessage() for r in caplog.records if "bypasses Grappler" in r.getMessage()]
    assert warnings == [
        "tfmemopt: jit_compile=True (XLA compiles the train step) bypasses Grappler, so "
        "tfmemopt cannot act on this model's train step; compile(..., jit_compile=False) "
        "to use it."]
    assert callback.report is None
    assert probe.seen and all(c is None for c in probe.seen)


def test_run_eagerly_warns_too(caplog):
    caplog.set_level(logging.WARNING, logger="tensorflow")
    model = mlp()
    model.run_eagerly = True
    callback = MemoryOptimizer(log_level=0)
    fit(model, [callback], epochs=1)
    assert "run_eagerly=True (no graph is built) bypasses Grappler" in caplog.text
    assert callback.report is None


def unbuilt_mlp():
    """The MLP as a Sequential without an Input: Keras builds it, and its optimizer,
    in the first step of fit, after the callbacks' on_train_begin."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(WIDTH, activation="relu") for _ in range(2)]
                             + [keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


@pytest.mark.parametrize("how", ["callback", "enable"])
def test_a_model_built_in_its_first_step_trains_as_without_tfmemopt(how):
    plain = fit(unbuilt_mlp(), epochs=2)
    if how == "enable":
        tfmemopt.enable("1GiB", log_level=0)
        optimized = fit(unbuilt_mlp(), epochs=2)
    else:
        optimized = fit(unbuilt_mlp(), [MemoryOptimizer("1GiB", log_level=0)], epochs=2)
    assert optimized == plain
