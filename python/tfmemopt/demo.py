"""The demo job: the seed-000 CNN trained under a capped CPU allocator.

Each trial runs in its own interpreter, because TF reads the allocator settings
(TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB) once at start-up.
"""

import json
import os
import subprocess
import sys

_TRIAL = r'''
import json, sys
import numpy as np
import tensorflow as tf
import tfmemopt
from tfmemopt.demo import seed_cnn_train_step

batch, steps, use = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if use:
    tfmemopt.enable(assume_batch_size=batch, log_level=0)
step, x, y = seed_cnn_train_step(batch)
result = {"batch": batch, "ok": True}
try:
    losses = [float(step(x, y)) for _ in range(steps)]
    result["losses"] = losses
except tf.errors.ResourceExhaustedError as err:
    result.update(ok=False, error=str(err).splitlines()[0][:200])
result["measured_peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")]
if reports:
    result["report"] = reports[-1].to_dict()
    result["report_text"] = reports[-1].to_text()
print("TFMEMOPT_TRIAL " + json.dumps(result))
'''


def keras_train_step(model, loss_fn):
    """A tf.function train step for `model`: loss under a GradientTape, then Adam."""
    import tensorflow as tf

    optimizer = tf.keras.optimizers.Adam()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def seed_cnn_train_step(batch, seed=0):
    """The seed-000 CNN (conv32-conv64-maxpool-fc128-fc10 on 28x28x1, Adam) and a
    synthetic batch. Returns (train_step, x, y)."""
    import numpy as np
    import tensorflow as tf

    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((batch, 28, 28, 1), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, size=(batch,), dtype=np.int32))
    return keras_train_step(model, loss_fn), x, y


def run_trial(batch, cap_mb, use_tfmemopt, steps=2, timeout=600):
    """Trains `steps` steps of the seed CNN under a `cap_mb` MiB allocator cap in a
    fresh interpreter; returns the trial's JSON result."""
    env = dict(os.environ)
    env.update(
        TF_CPU_ALLOCATOR_USE_BFC="true",
        TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mb),
        TF_CPP_MIN_LOG_LEVEL=env.get("TF_CPP_MIN_LOG_LEVEL", "1"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _TRIAL, str(batch), str(steps), "1" if use_tfmemopt else "0"],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("TFMEMOPT_TRIAL "):
            return json.loads(line[len("TFMEMOPT_TRIAL "):])
    return {"batch": batch, "ok": False,
            "error": f"trial exited with code {proc.returncode}: {proc.stderr.strip()[-300:]}"}
