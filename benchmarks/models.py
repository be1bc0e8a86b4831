"""Benchmark models and their train steps, shared by the benchmarks.

Every model trains with a GradientTape step and Adam in one tf.function, on a
fixed-shape synthetic batch, so that the graph TF builds is the same each run.
"""

import numpy as np
import tensorflow as tf

from tfmemopt.demo import keras_train_step as _train_step
from tfmemopt.demo import seed_cnn_train_step


def _classification_batch(batch, input_shape, classes, seed=0):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((batch,) + tuple(input_shape), dtype=np.float32))
    y = tf.constant(rng.integers(0, classes, size=(batch,), dtype=np.int32))
    return x, y


_XENT = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def seed_cnn(batch=512):
    """conv32-conv64-maxpool-fc128-fc10 on 28x28x1 (the seed-000 model, as the demo)."""
    step, x, y = seed_cnn_train_step(batch)
    return step, (x, y)


def mlp(batch=512, width=1024, depth=3):
    layers = [tf.keras.Input((784,))]
    layers += [tf.keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(10)])
    return _train_step(model, _XENT), _classification_batch(batch, (784,), 10)


def cifar_resnet(blocks=10, batch=128, width=16):
    """A CIFAR-shaped ResNet: conv stem, `blocks` residual blocks (conv-BN-ReLU x2
    with an identity skip), global pooling, dense 10."""
    inputs = tf.keras.Input((32, 32, 3))
    h = tf.keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    h = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization()(h))
    for _ in range(blocks):
        r = tf.keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(h)
        r = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization()(r))
        r = tf.keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        r = tf.keras.layers.BatchNormalization()(r)
        h = tf.keras.layers.ReLU()(tf.keras.layers.Add()([h, r]))
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(10)(h))
    return _train_step(model, _XENT), _classification_batch(batch, (32, 32, 3), 10)


def resnet50(batch=16, size=64):
    model = tf.keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
    loss = tf.keras.losses.SparseCategoricalCrossentropy()  # ResNet50 ends in softmax
    return _train_step(model, loss), _classification_batch(batch, (size, size, 3), 10)


def lstm_classifier(batch=64, steps=50, features=32, units=128):
    model = tf.keras.Sequential([
        tf.keras.Input((steps, features)),
        tf.keras.layers.LSTM(units),
        tf.keras.layers.Dense(10),
    ])
    return _train_step(model, _XENT), _classification_batch(batch, (steps, features), 10)


def four_conv_cnn(batch=64, size=64, filters=64):
    """Four 3x3 'same' convolutions of `filters` channels on size x size x 3, global
    average pooling, dense 10 (issue 18: one convolution's backward needs three
    [batch, size, size, filters] tensors at once)."""
    L = tf.keras.layers
    model = tf.keras.Sequential(
        [tf.keras.Input((size, size, 3))]
        + [L.Conv2D(filters, 3, padding="same", activation="relu") for _ in range(4)]
        + [L.GlobalAveragePooling2D(), L.Dense(10)])
    return _train_step(model, _XENT), _classification_batch(batch, (size, size, 3), 10)


def unet(batch=8, size=128, width=16, depth=3, seed=0):
    """A U-Net-like segmentation model: `depth` levels of two 3x3 convolutions and
    2x2 max pooling down, a bottleneck, then per level a stride-2 transposed
    convolution up, concatenation with the level's skip, two 3x3 convolutions; a
    1x1 convolution to one logit per pixel, binary cross-entropy against a random
    mask. Channels double per level from `width`."""
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((size, size, 3))
    skips, h = [], inputs
    for level in range(depth):
        h = L.Conv2D(width << level, 3, padding="same", activation="relu")(h)
        h = L.Conv2D(width << level, 3, padding="same", activation="relu")(h)
        skips.append(h)
        h = L.MaxPooling2D(2)(h)
    h = L.Conv2D(width << depth, 3, padding="same", activation="relu")(h)
    for level in reversed(range(depth)):
        h = L.Conv2DTranspose(width << level, 2, strides=2, padding="same")(h)
        h = L.Concatenate()([h, skips[level]])
        h = L.Conv2D(width << level, 3, padding="same", activation="relu")(h)
        h = L.Conv2D(width << level, 3, padding="same", activation="relu")(h)
    model = tf.keras.Model(inputs, L.Conv2D(1, 1)(h))
    loss = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((batch, size, size, 3), dtype=np.float32))
    y = tf.constant((rng.random((batch, size, size, 1)) > 0.5).astype(np.float32))
    return _train_step(model, loss), (x, y)


MODELS = {
    "seed_cnn": seed_cnn,
    "mlp": mlp,
    "cifar_resnet10": cifar_resnet,
    "resnet50_64px": resnet50,
    "lstm": lstm_classifier,
}


# --- Recurrent models (issue 19, branch `loops`) -------------------------------------
# Kept in a block of their own (other branches add model families above). Keras
# LSTM/GRU train through control flow v2 (a While whose gradient loop reads the
# forward loop's TensorList accumulators); the models stack two layers so that the
# second layer's accumulators and the first layer's sequence output are both live.


def _stacked_rnn(layer, batch, steps, features, units, seed=0):
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([
        tf.keras.Input((steps, features)),
        layer(units, return_sequences=True),
        layer(units),
        tf.keras.layers.Dense(10),
    ])
    return _train_step(model, _XENT), _classification_batch(batch, (steps, features), 10)


def stacked_lstm(batch=64, steps=150, features=64, units=256):
    """Two stacked LSTM(units) layers over `steps` steps, dense 10."""
    return _stacked_rnn(tf.keras.layers.LSTM, batch, steps, features, units)


def stacked_gru(batch=64, steps=200, features=64, units=256):
    """Two stacked GRU(units) layers over `steps` steps, dense 10 (issue 19's model)."""
    return _stacked_rnn(tf.keras.layers.GRU, batch, steps, features, units)


RECURRENT_MODELS = {
    "stacked_lstm": stacked_lstm,
    "stacked_gru": stacked_gru,
}
MODELS.update(RECURRENT_MODELS)  # peak_accuracy.py measures them too
