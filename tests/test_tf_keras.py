"""tfmemopt with tf_keras (Keras 2: `import tf_keras`, or tf.keras under
TF_USE_LEGACY_KERAS=1), which many training scripts written before Keras 3 still use.

tf_keras traces its train step (`train_function`) with an unknown batch dimension, so
the fit's batch size must reach the pass (assume_batch_size) for its sizes to be right,
and it calls its callbacks through its own CallbackList. tf_keras's wheel requires the
`tensorflow` distribution, not `tensorflow-cpu`; the test installs it beside ours with
`pip install --no-deps` (as docs/usage.md tells users to) and runs every scenario in one
interpreter with TF_USE_LEGACY_KERAS=1, where `tf.keras` is tf_keras.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import run_python

TF_KERAS = "tf-keras==2.21.0"

_SCENARIOS = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tfmemopt
from tfmemopt.keras import MemoryOptimizer

assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
BATCH, SAMPLES = 128, 300  # a partial last batch: tf_keras's batch dimension is unknown
rng = np.random.default_rng(0)
x = rng.random((SAMPLES, 32, 32, 3)).astype("float32")
y = rng.integers(0, 10, SAMPLES)


def model():
    tf.keras.utils.set_random_seed(0)
    m = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(32, 32, 3)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(10)])
    m.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def fit(m, callbacks=()):
    h = m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return [float(v).hex() for v in h.history["loss"]]


def train_reports():
    return [r for r in tfmemopt.reports() if "train_function" in r.graph_id]


out = {}
# Plain: no tfmemopt.
out["plain_losses"] = fit(model())

# The callback, under a budget the step does not meet.
m = model()
callback = MemoryOptimizer(budget="24MiB", print_report=False, log_level=0)
out["callback_losses"] = fit(m, [callback])
r = callback.report
out["callback"] = None if r is None else {
    "graph_id": r.graph_id, "status": r.status, "changed": r.graph_changed,
    "before": r.predicted_peak_bytes["before"]["CPU:0"],
    "after": r.predicted_peak_bytes["after"]["CPU:0"],
    "assumed": r.to_dict().get("batch_dims_assumed", 0)}
out["config_after_callback"] = str(tfmemopt.enabled_config())
# tf_keras's own train function, not the callback's wrapper (a closure of its
# on_train_begin).
out["train_function_restored"] = "MemoryOptimizer" not in getattr(
    m.train_function, "__qualname__", "")


# A callback that stops fit with an exception: tf_keras skips on_train_end.
class Stop(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("stop")


try:
    fit(model(), [MemoryOptimizer(budget="24MiB", print_report=False), Stop()])
    out["stopped"] = False
except RuntimeError:
    out["stopped"] = True
out["config_after_stop"] = str(tfmemopt.enabled_config())

# enable(): the fit gets the batch size, and enable()'s config is as it was after.
tfmemopt.clear_reports()
tfmemopt.enable(budget="24MiB", log_level=0)
out["enable_losses"] = fit(model())
r = train_reports()[-1]
out["enable"] = {"before": r.predicted_peak_bytes["before"]["CPU:0"],
                 "changed": r.graph_changed, "assumed": r.to_dict().get("batch_dims_assumed", 0)}
out["config_after_enable_fit"] = str(tfmemopt.enabled_config())
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def tf_keras_run(tmp_path_factory):
    env = {"TF_USE_LEGACY_KERAS": "1"}
    if importlib.util.find_spec("tf_keras") is None:
        target = tmp_path_factory.mktemp("tf_keras")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--target", str(target), TF_KERAS],
                             capture_output=True, text=True, timeout=600)
        assert pip.returncode == 0, pip.stderr[-2000:]
        env["PYTHONPATH"] = os.pathsep.join(
            [str(target)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = run_python(_SCENARIOS, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


# The whole step at batch 128: two 30x30x32 and 28x28x32 float activations alone are
# 14 and 12 MiB; sized with a batch of 1 the step would be under 1 MiB.
STEP_AT_BATCH_128 = 20 * 2**20


def test_the_callback_plans_a_tf_keras_fit_with_its_batch_size(tf_keras_run):
    report = tf_keras_run["callback"]
    assert report is not None, "the callback saw no train step report"
    assert report["graph_id"].startswith("__inference_train_function_")
    assert report["status"] == "ok" and report["changed"]
    assert report["assumed"] > 0  # tf_keras's unknown batch dimension, sized as 128
    assert report["before"] > STEP_AT_BATCH_128
    assert report["after"] < report["before"]


def test_losses_with_the_callback_are_bitwise_those_without(tf_keras_run):
    assert tf_keras_run["callback_losses"] == tf_keras_run["plain_losses"]


def test_the_state_is_restored_after_a_tf_keras_fit(tf_keras_run):
    assert tf_keras_run["config_after_callback"] == "None"
    assert tf_keras_run["train_function_restored"]


def test_the_state_is_restored_when_a_callback_stops_a_tf_keras_fit(tf_keras_run):
    assert tf_keras_run["stopped"]
    assert tf_keras_run["config_after_stop"] == "None"


def test_enable_sizes_a_tf_keras_fit_by_its_batch_size(tf_keras_run):
    enabled = tf_keras_run["enable"]
    assert enabled["assumed"] > 0 and enabled["before"] > STEP_AT_BATCH_128
    assert enabled["changed"]
    assert tf_keras_run["enable_losses"] == tf_keras_run["plain_losses"]
    # enable()'s own config, without the fit's batch size.
    assert "assume_batch_size" not in tf_keras_run["config_after_enable_fit"]
    assert "budget_bytes" in tf_keras_run["config_after_enable_fit"]
