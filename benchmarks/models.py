"""Benchmark models and their train steps, shared by the benchmarks.

Every model trains with a GradientTape step and Adam in one tf.function, on a
fixed-shape synthetic batch, so that the graph TF builds is the same each run.
"""

import argparse

import numpy as np
import tensorflow as tf

from tfmemopt.demo import keras_train_step as _train_step
from tfmemopt.demo import seed_cnn_train_step


# The settings every search benchmark takes (resnet50_lms.py, deep_resnet.py,
# unet_split.py): each is an int option that overrides DEFAULTS, or QUICK with --quick.
SETTING_HELP = {
    "batch": "batch size",
    "cap_mb": "CPU allocator cap in MiB",
    "steps": "training steps per search trial",
    "rounds": "timed steps per configuration",
}


def benchmark_settings(description, defaults, quick, helps, extra=None):
    """Parses a search benchmark's command line: one int option per int setting of
    `defaults` (help from `helps`, else SETTING_HELP), --json and --quick;
    `extra(parser)` adds the script's own options (its other settings among them).
    Returns (args, settings): QUICK with --quick, else DEFAULTS, updated by the options
    given."""
    parser = argparse.ArgumentParser(description=description)
    for key, value in defaults.items():
        if isinstance(value, int):
            parser.add_argument("--" + key.replace("_", "-"), type=int,
                                help=helps.get(key, SETTING_HELP.get(key)))
    if extra is not None:
        extra(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON line, last")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small configuration for tests: {quick}")
    args = parser.parse_args()
    settings = dict(quick if args.quick else defaults)
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    return args, settings


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


# ---------------------------------------------------------------------------
# Architecture families (issue 15): each stresses kernels the models above do not.


def transformer_encoder(batch=16, seq=128, d_model=256, heads=8, key_dim=32, ff=1024,
                        blocks=4, features=64):
    """A Transformer encoder: `blocks` pre-norm blocks of Keras MultiHeadAttention
    (softmax over seq x seq scores) and a GELU feed-forward, with LayerNorm, on a
    float sequence projected to d_model; mean pooling, dense 10. The issue's shapes."""
    layers = tf.keras.layers
    inputs = tf.keras.Input((seq, features))
    h = layers.Dense(d_model)(inputs)
    for _ in range(blocks):
        a = layers.LayerNormalization()(h)
        a = layers.MultiHeadAttention(num_heads=heads, key_dim=key_dim)(a, a)
        h = layers.Add()([h, a])
        f = layers.LayerNormalization()(h)
        f = layers.Dense(ff, activation="gelu")(f)
        f = layers.Dense(d_model)(f)
        h = layers.Add()([h, f])
    h = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(h))
    model = tf.keras.Model(inputs, layers.Dense(10)(h))
    return _train_step(model, _XENT), _classification_batch(batch, (seq, features), 10)


def unet_bn(batch=8, size=64, width=16, depth=3):
    """A U-Net-like encoder-decoder: conv-BN-ReLU pairs, max pooling down,
    Conv2DTranspose up, skip connections concatenated; per-pixel binary loss."""
    layers = tf.keras.layers

    def block(h, filters):
        for _ in range(2):
            h = layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
            h = layers.ReLU()(layers.BatchNormalization()(h))
        return h

    inputs = tf.keras.Input((size, size, 3))
    h, skips = inputs, []
    for level in range(depth):
        h = block(h, width * 2**level)
        skips.append(h)
        h = layers.MaxPooling2D(2)(h)
    h = block(h, width * 2**depth)
    for level in reversed(range(depth)):
        h = layers.Conv2DTranspose(width * 2**level, 2, strides=2, padding="same")(h)
        h = block(layers.Concatenate()([h, skips[level]]), width * 2**level)
    model = tf.keras.Model(inputs, layers.Conv2D(1, 1)(h))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch, size, size, 3), dtype=np.float32))
    y = tf.constant((rng.random((batch, size, size, 1)) > 0.5).astype(np.float32))
    loss = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    return _train_step(model, loss), (x, y)


def mobilenet_v2(batch=32, size=96, alpha=0.5):
    """Keras MobileNetV2 (depthwise-separable inverted residuals, ReLU6)."""
    model = tf.keras.applications.MobileNetV2(
        weights=None, input_shape=(size, size, 3), alpha=alpha, classes=10)
    loss = tf.keras.losses.SparseCategoricalCrossentropy()  # ends in softmax
    return _train_step(model, loss), _classification_batch(batch, (size, size, 3), 10)


def densenet121(batch=16, size=64):
    """Keras DenseNet121: every layer of a dense block reads the concatenation of
    all earlier ones."""
    model = tf.keras.applications.DenseNet121(
        weights=None, input_shape=(size, size, 3), classes=10)
    loss = tf.keras.losses.SparseCategoricalCrossentropy()
    return _train_step(model, loss), _classification_batch(batch, (size, size, 3), 10)


def efficientnet_b0(batch=16, size=64):
    """Keras EfficientNetB0: MBConv blocks with squeeze-excite and swish."""
    model = tf.keras.applications.EfficientNetB0(
        weights=None, input_shape=(size, size, 3), classes=10)
    loss = tf.keras.losses.SparseCategoricalCrossentropy()
    return _train_step(model, loss), _classification_batch(batch, (size, size, 3), 10)


def text_cnn(batch=64, seq=256, vocab=20000, dim=128, filters=256):
    """An embedding, Conv1D with ReLU, global max pooling, dropout, dense 2: sparse
    gradients of the embedding (IndexedSlices) and a random op."""
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((seq,), dtype="int32"),
        layers.Embedding(vocab, dim),
        layers.Conv1D(filters, 5, activation="relu"),
        layers.Conv1D(filters, 5, activation="relu"),
        layers.GlobalMaxPooling1D(),
        layers.Dropout(0.5),
        layers.Dense(2),
    ])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, vocab, size=(batch, seq), dtype=np.int32))
    y = tf.constant(rng.integers(0, 2, size=(batch,), dtype=np.int32))
    return _train_step(model, _XENT), (x, y)


def wavenet(batch=42, steps=2048, channels=32, layers=10):
    """A WaveNet-like stack: a causal Conv1D, then `layers` gated units (tanh and
    sigmoid dilated causal convolutions, dilation 1, 2, 4, ..., multiplied), each
    with a residual and a skip 1x1 convolution; the skips summed, ReLU, two 1x1
    convolutions to 256 logits per step (sparse cross-entropy at every step).
    Its backward reads every gate, so plans swap and recompute many same-sized
    tensors whose order TF's executor is free to change."""
    layers_ = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    inp = tf.keras.Input((steps, 1))
    x = layers_.Conv1D(channels, 2, padding="causal")(inp)
    skips = []
    for i in range(layers):
        f = layers_.Conv1D(channels, 2, dilation_rate=2**i, padding="causal",
                           activation="tanh")(x)
        g = layers_.Conv1D(channels, 2, dilation_rate=2**i, padding="causal",
                           activation="sigmoid")(x)
        h = layers_.Multiply()([f, g])
        skips.append(layers_.Conv1D(channels, 1)(h))
        x = layers_.Add()([x, layers_.Conv1D(channels, 1)(h)])
    s = layers_.Activation("relu")(layers_.Add()(skips))
    s = layers_.Conv1D(64, 1, activation="relu")(s)
    model = tf.keras.Model(inp, layers_.Conv1D(256, 1)(s))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, steps, 1)).astype(np.float32))
    y = tf.constant(rng.integers(0, 256, size=(batch, steps), dtype=np.int32))
    return _train_step(model, _XENT), (x, y)


def bidirectional_lstm(batch=72, steps=200, vocab=10000, dim=64, units=(128, 64)):
    """A text classifier: Embedding (mask_zero, the last steps padding) into two
    Bidirectional LSTMs, dense 64 with dropout, 5 classes. TF runs each layer's two
    directions side by side, and every loop pushes one element per step onto its
    TensorLists: BFC's regions fill with small chunks and holes, and near the cap
    the large gradients after the loops find no chunk to fit in."""
    layers_ = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    inp = tf.keras.Input((steps,), dtype="int32")
    x = layers_.Embedding(vocab, dim, mask_zero=True)(inp)
    x = layers_.Bidirectional(layers_.LSTM(units[0], return_sequences=True))(x)
    x = layers_.Bidirectional(layers_.LSTM(units[1]))(x)
    x = layers_.Dropout(0.2)(layers_.Dense(64, activation="relu")(x))
    model = tf.keras.Model(inp, layers_.Dense(5)(x))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=(batch, steps)).astype(np.int32)
    tokens[:, -25:] = 0  # padding
    y = tf.constant(rng.integers(0, 5, size=(batch,), dtype=np.int32))
    return _train_step(model, _XENT), (tf.constant(tokens), y)


def v1_session_cnn(batch=128, size=32, width=32):
    """A tf.compat.v1 graph run by a Session: conv-ReLU-conv-ReLU-maxpool twice,
    dense 256, dense 10, softmax cross-entropy, Momentum (v1 optimizer). The
    Session gets the rewrite options the caller's tf.function graphs would get
    (tfmemopt.enable()), so the pass runs on it exactly as configured.
    Returns (step, ()): step() runs one training step."""
    from tfmemopt import _eager_context

    v1 = tf.compat.v1
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [batch, size, size, 3], name="x")
        y = v1.placeholder(tf.int32, [batch], name="y")
        init = v1.glorot_uniform_initializer(seed=0)
        h, channels = x, 3
        for stage in range(2):
            for conv in range(2):
                filters = width * 2**stage
                w = v1.get_variable(f"conv{stage}_{conv}", [3, 3, channels, filters],
                                    initializer=init)
                b = v1.get_variable(f"bias{stage}_{conv}", [filters],
                                    initializer=v1.zeros_initializer())
                h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, 1, "SAME"), b))
                channels = filters
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.reshape(h, [batch, -1])
        w1 = v1.get_variable("fc1", [h.shape[1], 256], initializer=init)
        h = tf.nn.relu(tf.matmul(h, w1))
        w2 = v1.get_variable("fc2", [256, 10], initializer=init)
        logits = tf.matmul(h, w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        train = v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
        init_op = v1.global_variables_initializer()
    config = v1.ConfigProto()
    config.graph_options.rewrite_options.CopyFrom(_eager_context.current_rewrite_options())
    session = v1.Session(graph=graph, config=config)
    session.run(init_op)
    feed = {x: rng.random((batch, size, size, 3), dtype=np.float32),
            y: rng.integers(0, 10, size=(batch,), dtype=np.int32)}

    def step():
        return session.run([loss, train], feed)[0]

    # What the step runs, for tools that plan it without running it (tfmemopt's
    # analyze_metagraph in benchmarks/fits_means_trains.py).
    step.graph, step.fetches = graph, [loss.name, train.name]
    return step, ()


MODELS = {
    "seed_cnn": seed_cnn,
    "mlp": mlp,
    "cifar_resnet10": cifar_resnet,
    "resnet50_64px": resnet50,
    "lstm": lstm_classifier,
    "transformer": transformer_encoder,
    "unet": unet_bn,
    "mobilenet_v2": mobilenet_v2,
    "densenet121": densenet121,
    "efficientnet_b0": efficientnet_b0,
    "text_cnn": text_cnn,
    "v1_session_cnn": v1_session_cnn,
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


def builder(name):
    """The model function called `name`: a benchmark model of MODELS, or any other
    model function of this module. Raises ValueError naming what is allowed."""
    build = MODELS.get(name) or globals().get(name)
    if not callable(build):
        raise ValueError(f"model {name!r}; allowed: {', '.join(MODELS)} or a function of "
                         f"benchmarks/models.py")
    return build
