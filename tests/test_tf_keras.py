"""tfmemopt with tf_keras (Keras 2: `import tf_keras`, or tf.keras under
TF_USE_LEGACY_KERAS=1), which many training scripts written before Keras 3 still use.

tf_keras traces its train step (`train_function`) with an unknown batch dimension and
reads its batches from an iterator inside the graph; it calls its callbacks through its
own CallbackList. tf_keras's wheel requires the `tensorflow` distribution, not
`tensorflow-cpu`: the test installs it beside ours with `pip install --no-deps` (as
docs/usage.md tells users to) and runs the scenarios in interpreters with
TF_USE_LEGACY_KERAS=1, where `tf.keras` is tf_keras: one for the plan, the state and
enable(), one per run of the retry under a capped allocator."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import capped_allocator_env, run_python, subprocess_result

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
# The graph of the full batches (the partial last batch has its own, smaller).
r = max(callback.reports, key=lambda r: r.predicted_peak_bytes["before"]["CPU:0"],
        default=None)
out["callback"] = None if r is None else {
    "graph_id": r.graph_id, "status": r.status, "changed": r.graph_changed,
    "before": r.predicted_peak_bytes["before"]["CPU:0"],
    "after": r.predicted_peak_bytes["after"]["CPU:0"]}
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
r = max(train_reports(), key=lambda r: r.predicted_peak_bytes["before"]["CPU:0"])
out["enable"] = {"before": r.predicted_peak_bytes["before"]["CPU:0"],
                 "changed": r.graph_changed}
out["config_after_enable_fit"] = str(tfmemopt.enabled_config())
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def tf_keras_env(tmp_path_factory):
    """The environment of an interpreter where `tf.keras` is tf_keras."""
    env = {"TF_USE_LEGACY_KERAS": "1"}
    if importlib.util.find_spec("tf_keras") is None:
        target = tmp_path_factory.mktemp("tf_keras")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--target", str(target), TF_KERAS],
                             capture_output=True, text=True, timeout=600)
        assert pip.returncode == 0, pip.stderr[-2000:]
        env["PYTHONPATH"] = os.pathsep.join(
            [str(target)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return subprocess_result(proc), proc.stderr


@pytest.fixture(scope="module")
def tf_keras_run(tf_keras_env):
    return _result(run_python(_SCENARIOS, env=tf_keras_env, timeout=900))[0]


# The whole step at batch 128: two 30x30x32 and 28x28x32 float activations alone are
# 14 and 12 MiB; sized with a batch of 1 (tf_keras's unknown batch dimension, had the
# fit's batch size not reached the pass) the step would be under 1 MiB.
STEP_AT_BATCH_128 = 20 * 2**20


def test_the_callback_plans_a_tf_keras_fit_with_its_batch_size(tf_keras_run):
    report = tf_keras_run["callback"]
    assert report is not None, "the callback saw no train step report"
    assert report["graph_id"].startswith("__inference_train_function_")
    assert report["status"] == "ok" and report["changed"]
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
    assert enabled["before"] > STEP_AT_BATCH_128
    assert enabled["changed"]
    assert tf_keras_run["enable_losses"] == tf_keras_run["plain_losses"]
    # enable()'s own config, without the fit's batch size.
    assert "assume_batch_size" not in tf_keras_run["config_after_enable_fit"]
    assert "budget_bytes" in tf_keras_run["config_after_enable_fit"]


# Retries: a 24-layer MLP whose plan under the first budget runs out of memory on a
# capped allocator (8 MiB held outside the step, as in tests/test_feedback.py). The
# first budget (36 MiB, the step as TF builds it is predicted at 40.3 MiB) is far
# enough over what fits beside tf_keras's own 15 MiB that its plan runs out of memory
# in every executor order; a first budget of 32.4 MiB sometimes trained at once.
_RETRY = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tfmemopt
from tfmemopt.keras import MemoryOptimizer

mode = sys.argv[1]
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((256,))] +
                            [tf.keras.layers.Dense(256, activation="relu") for _ in range(24)] +
                            [tf.keras.layers.Dense(1)])
model.compile(tf.keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.standard_normal((3 * 1024, 256)).astype(np.float32)
y = rng.standard_normal((3 * 1024, 1)).astype(np.float32)
callbacks = []
if mode != "plain":
    hog = tf.fill([8 << 18], 1.0)  # 8 MiB
    fields = dict(enable_split=False, log_level=0)
    if mode == "callback":
        callbacks = [MemoryOptimizer(budget=37_748_736, print_report=False, retries=10,
                                     guard_steps=10, **fields)]
    else:
        tfmemopt.enable(budget=37_748_736, fit_retries=10, **fields)
history = model.fit(x, y, batch_size=1024, epochs=2, shuffle=False, verbose=0,
                    callbacks=callbacks)
print("RESULT " + json.dumps({
    "losses": [float(v).hex() for v in history.history["loss"]],
    "mae": [float(v).hex() for v in history.history["mae"]],
    "weights": [w.numpy().tobytes().hex() for w in model.weights],
    "measured": [r.measured_peak_bytes for r in tfmemopt.reports()
                 if "train_function" in r.graph_id]}))
"""

RETRY_CAP_MB = 48


def _capped(env, mb):
    return {**env, **capped_allocator_env(
        mb, TF_CPP_MIN_LOG_LEVEL="1",
        # an out-of-memory error inside some oneDNN kernels kills the interpreter
        # (docs/troubleshooting.md)
        TF_ENABLE_ONEDNN_OPTS="0")}


@pytest.mark.parametrize("mode", ["callback", "enable"])
def test_a_tf_keras_batch_that_runs_out_of_memory_is_retried_bitwise(tf_keras_env, mode):
    plain, _ = _result(run_python(_RETRY, "plain", env=_capped(tf_keras_env, 1024)))
    mine, log = _result(run_python(_RETRY, mode, env=_capped(tf_keras_env, RETRY_CAP_MB)))
    assert log.count("retrying the batch (retry") >= 1, log[-3000:]
    assert "were created by the failed attempt" not in log
    assert mine["losses"] == plain["losses"]
    assert mine["mae"] == plain["mae"]  # the failed attempts' metric updates are undone
    assert mine["weights"] == plain["weights"]
    measured = [m["CPU:0"] for m in mine["measured"] if m]
    assert measured and max(measured) <= RETRY_CAP_MB * 2**20
