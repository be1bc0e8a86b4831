"""A graph function whose inputs have an unknown batch dimension is planned for the
batch it is called with (tfmemopt.call_batch): sized as with the batch known, planned
under the budget, re-planned only for a larger batch, with results bitwise equal to
plain TF's."""

import numpy as np
import pytest
import tensorflow as tf

import tfmemopt
from tfmemopt import call_batch
from conftest import reports_for

IMAGE = [32, 32, 3]
SIGNATURE = [tf.TensorSpec([None] + IMAGE, tf.float32), tf.TensorSpec([None], tf.int32)]


def _batches(sizes):
    rng = np.random.default_rng(0)
    return [(tf.constant(rng.random([n] + IMAGE, dtype=np.float32)),
             tf.constant(rng.integers(0, 10, n, dtype=np.int32))) for n in sizes]


def _train(batches, input_signature=None):
    """Losses of SGD steps of a small CNN from a fixed start, one per batch, and the
    step (a fresh tf.function)."""
    tf.keras.utils.set_random_seed(1)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input(IMAGE), layers.Conv2D(32, 3, activation="relu"),
        layers.Conv2D(64, 3, activation="relu"), layers.GlobalAveragePooling2D(),
        layers.Dense(10)])
    optimizer = tf.keras.optimizers.SGD(0.1)

    @tf.function(input_signature=input_signature)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return np.array([step(x, y).numpy() for x, y in batches]), step


def test_a_step_of_unknown_batch_is_planned_for_the_batch_it_is_called_with():
    batches = _batches([32, 24, 40])  # then a smaller batch, then a larger one
    plain, _ = _train(batches, SIGNATURE)
    _, static_step = _train(batches[:1])
    known = tfmemopt.analyze(static_step, *batches[0], log_level=0)
    static_peak = known.predicted_peak_bytes["before"]["CPU:0"]

    tfmemopt.clear_reports()
    budget = int(0.9 * static_peak)  # met by recomputing (a split needs a static batch)
    tfmemopt.enable(budget, log_level=0)
    losses, step = _train(batches, SIGNATURE)

    np.testing.assert_array_equal(losses, plain)  # bitwise: recomputed and swapped only
    reports = reports_for("__inference_step")
    # The batch of 24 ran the plan made for 32; the batch of 40 was planned anew.
    assert [r.to_dict()["assume_batch_size"] for r in reports] == [32, 40]
    first = reports[0]
    assert first.unresolved_tensors == 0
    assert first.predicted_peak_bytes["before"]["CPU:0"] == pytest.approx(static_peak, rel=0.01)
    assert first.graph_changed and first.fits
    assert first.recomputed_ops
    assert first.predicted_peak_bytes["after"]["CPU:0"] <= budget
    assert reports[1].predicted_peak_bytes["before"]["CPU:0"] > static_peak
    name = step.get_concrete_function().name.decode()
    assert call_batch.planned_batches()[name] == 40


def test_without_a_call_the_batch_stays_unknown():
    # Counted as 1, the step is predicted at a fraction of its size: what enable()
    # planned before the call told the batch.
    batches = _batches([32])
    _, step = _train(batches, SIGNATURE)
    unknown = tfmemopt.analyze(step, *batches[0], log_level=0)
    _, static_step = _train(batches)
    known = tfmemopt.analyze(static_step, *batches[0], log_level=0)
    assert unknown.unresolved_tensors > 0
    assert (unknown.predicted_peak_bytes["before"]["CPU:0"]
            < 0.2 * known.predicted_peak_bytes["before"]["CPU:0"])


def test_inputs_that_disagree_on_their_leading_dimension_tell_no_batch():
    # A ragged tensor's values beside its lengths: which is the batch is not known.
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def segment_means(values, lengths):
        ids = tf.repeat(tf.range(tf.size(lengths)), lengths)
        return tf.math.segment_mean(values, ids)

    tfmemopt.enable("1GiB", log_level=0)
    segment_means(tf.ones([100]), tf.fill([4], 25))
    (report,) = reports_for("__inference_segment_means")
    assert report.to_dict()["assume_batch_size"] == 0
    assert report.unresolved_tensors > 0


def test_an_assume_batch_size_in_the_config_is_kept():
    tfmemopt.enable("1GiB", assume_batch_size=16, log_level=0)
    _train(_batches([32]), SIGNATURE)
    (report,) = reports_for("__inference_step")
    assert report.to_dict()["assume_batch_size"] == 16


def test_an_assume_batch_size_of_0_given_keeps_the_batch_unknown():
    tfmemopt.enable("1GiB", assume_batch_size=0, log_level=0)
    _train(_batches([32]), SIGNATURE)
    (report,) = reports_for("__inference_step")
    assert report.to_dict()["assume_batch_size"] == 0
    assert report.unresolved_tensors > 0


def test_a_step_of_known_shapes_is_left_as_configured():
    tfmemopt.enable("1GiB", log_level=0)
    _train(_batches([32]))
    (report,) = reports_for("__inference_step")
    assert report.to_dict()["assume_batch_size"] == 0
    assert report.unresolved_tensors == 0


def test_a_plan_made_without_the_batch_is_a_warning(capfd):
    # Planned where no call tells the batch (tfmemopt.analyze, a Session's placeholder
    # of unknown batch), the sizes counted as 1 make "fits" meaningless: a WARNING line,
    # not an INFO one, and the report's fits stays what the numbers say.
    batches = _batches([32])
    _, step = _train(batches, SIGNATURE)
    report = tfmemopt.analyze(step, *batches[0], budget="1GiB")
    assert report.unresolved_tensors > 0 and report.fits
    lines = [l for l in capfd.readouterr().err.splitlines()
             if f"TfMemOpt: graph {report.graph_id}" in l]
    assert len(lines) == 1 and lines[0].startswith("W"), lines
    assert "set assume_batch_size" in lines[0]
    # With the batch known, the same graph is an INFO line.
    report = tfmemopt.analyze(step, *batches[0], budget="1GiB", assume_batch_size=32)
    lines = [l for l in capfd.readouterr().err.splitlines()
             if f"TfMemOpt: graph {report.graph_id}" in l]
    assert len(lines) == 1 and lines[0].startswith("I"), lines


def test_a_call_whose_batch_cannot_be_read_runs_as_configured(monkeypatch):
    # Whatever the inputs are, reading them must not break the user's call.
    from tfmemopt import _eager_context

    def unreadable(function, args):
        raise RuntimeError("inputs of no shape")

    monkeypatch.setattr(_eager_context, "_call_edit_resolver", unreadable)
    tfmemopt.enable("1GiB", log_level=0)
    losses, _ = _train(_batches([32]), SIGNATURE)
    assert np.isfinite(losses).all()
    (report,) = reports_for("__inference_step")
    assert report.to_dict()["assume_batch_size"] == 0
