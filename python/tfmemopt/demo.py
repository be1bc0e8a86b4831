"""The demo job: the seed-000 CNN trained under a capped CPU allocator.

Each trial runs in its own interpreter, because TF reads the allocator settings
(TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB) once at start-up.
"""

import json
import os
import subprocess
import sys



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


def cifar_resnet_train_step(batch, blocks=20, width=16, seed=0, batch_norm=True):
    """A CIFAR-shaped ResNet (conv stem, `blocks` residual blocks of conv-BN-ReLU x2
    with an identity skip, global pooling, dense 10; Adam) and a synthetic batch of
    32x32x3 images. batch_norm=False leaves out the BatchNormalization layers.
    Returns (train_step, (x, y))."""
    import numpy as np
    import tensorflow as tf

    tf.keras.utils.set_random_seed(seed)
    layers = tf.keras.layers
    inputs = tf.keras.Input((32, 32, 3))
    norm = layers.BatchNormalization if batch_norm else (lambda: (lambda t: t))
    h = layers.Conv2D(width, 3, padding="same", use_bias=not batch_norm)(inputs)
    h = layers.ReLU()(norm()(h))
    for _ in range(blocks):
        r = layers.Conv2D(width, 3, padding="same", use_bias=not batch_norm)(h)
        r = layers.ReLU()(norm()(r))
        r = layers.Conv2D(width, 3, padding="same", use_bias=not batch_norm)(r)
        r = norm()(r)
        h = layers.ReLU()(layers.Add()([h, r]))
    h = layers.GlobalAveragePooling2D()(h)
    model = tf.keras.Model(inputs, layers.Dense(10)(h))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((batch, 32, 32, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, size=(batch,), dtype=np.int32))
    return keras_train_step(model, loss), (x, y)


def run_demo(blocks=20, batch=128, cap_mb=256, steps=3, timeout=900):
    """The demo: the ResNet (without BatchNormalization, whose training TF runs with
    run-to-run differences of its own) under a `cap_mb` MiB allocator cap without
    tfmemopt (it runs out of memory), with it (it trains), and without either (the
    reference losses). One interpreter per run. Returns {"without", "with",
    "reference"} Trials."""
    from tfmemopt.maxbatch import run_trial as trial

    kwargs = {"blocks": blocks, "batch_norm": False}
    runs = {
        "without": dict(cap_mb=cap_mb, use_tfmemopt=False),
        "with": dict(cap_mb=cap_mb, use_tfmemopt=True, log_level=0),
        "reference": dict(cap_mb=None, use_tfmemopt=False),
    }
    return {name: trial(cifar_resnet_train_step, batch, steps=steps, timeout=timeout,
                        step_kwargs=kwargs, **options)
            for name, options in runs.items()}
