"""Models the pass was not tuned for: same results, and how right the prediction is.

Keras applications and small models built from layers that benchmarks/models.py does
not use (grouped and separable convolutions, overlapping max pooling, SE blocks,
hard-swish, GELU, LayerScale,
attention with dropout, masking, bidirectional GRUs, transposed convolutions, spatial
dropout, SELU/ELU/softplus). For each model, in fresh processes on TF's BFC CPU
allocator (default threads, uncapped):

  * plain: three training steps (Adam) without tfmemopt; the measured peak is the
    highest per-step peak after the first step;
  * planned: the same steps with tfmemopt.enable(budget=--ratio x that peak).

A row compares the planned run with the plain one bit for bit (losses and every
variable after three steps; where they differ, plain runs again, and a plain run that
does not repeat itself is reported as such, not as a mismatch; then plain twice and
planned once more with one inter-op thread, where TF runs one op at a time in an order
fixed per graph, to tell a rewrite that changes values from one that only changes
which ops overlap; and where the report names sums that TF adds in the order their
terms finish (Report.arrival_order_sums), plain twice and planned once more with TF's
memory optimizer off, tfmemopt.set_tf_memory_optimization("NO_MEM_OPT"), which keeps
those sums AddNs added in a fixed order), notes a fall-back, and sets each prediction next to
what was measured: unplanned (the report's peak before the plan against the plain
run) and planned (the peak after the plan against the planned run; "fits" when the
report says it meets the budget, the claim a user relies on).

Usage: python benchmarks/unseen_models.py [--models NAME ...] [--ratio 0.6] [--json]
With --json the last line is {"models": N, "bitwise_equal": N, "mismatches": [...],
"mismatches_one_inter_op_thread": [...], "arrival_order_sums": {name: [sum, ...]},
"mismatches_fixed_order_sums": [...],
"plain_not_repeatable": [...], "fallbacks": [...], "errors": [...], "max_abs_error_unplanned",
"max_abs_error_planned_fits", "rows": {name: {...}}}.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def _batch(batch, shape, classes=10, seed=0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    return (tf.constant(rng.random((batch,) + tuple(shape), dtype=np.float32)),
            tf.constant(rng.integers(0, classes, size=(batch,), dtype=np.int32)))


def _application(name, size, batch, **kwargs):
    def build(batch=batch):
        import keras

        model = getattr(keras.applications, name)(
            weights=None, input_shape=(size, size, 3), classes=10, **kwargs)
        # Keras applications end in a softmax.
        return model, keras.losses.SparseCategoricalCrossentropy(), _batch(batch, (size, size, 3))
    return build


def vit_tiny(batch=16):
    """Patch embedding and three pre-norm blocks: attention with dropout, GELU MLP."""
    import keras

    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Reshape((64, 128))(keras.layers.Conv2D(128, 8, strides=8)(inputs))
    for _ in range(3):
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.Dropout(0.1)(keras.layers.MultiHeadAttention(4, 32, dropout=0.1)(h, h))
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.Dense(128)(keras.layers.Dense(256, activation="gelu")(h))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(x))
    return (keras.Model(inputs, outputs),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            _batch(batch, (64, 64, 3)))


def conv_autoencoder(batch=16):
    """ELU and SELU convolutions, spatial dropout, batch norm, a transposed convolution,
    upsampling, softplus, global max pooling."""
    import keras

    L = keras.layers
    inputs = keras.Input((64, 64, 3))
    x = L.Conv2D(32, 3, strides=2, padding="same", activation="elu")(inputs)
    x = L.SpatialDropout2D(0.2)(x)
    x = L.BatchNormalization()(L.Conv2D(64, 3, strides=2, padding="same", activation="selu")(x))
    x = L.UpSampling2D()(L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(x))
    x = L.GlobalMaxPooling2D()(L.Conv2D(16, 3, padding="same", activation="softplus")(x))
    return (keras.Model(inputs, L.Dense(10)(x)),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            _batch(batch, (64, 64, 3)))


def bidirectional_gru(batch=32):
    """Masking, a bidirectional GRU returning sequences, an LSTM with dropout."""
    import keras

    L = keras.layers
    inputs = keras.Input((60, 16))
    x = L.Bidirectional(L.GRU(64, return_sequences=True))(L.Masking()(inputs))
    x = L.LSTM(64, dropout=0.1)(x)
    return (keras.Model(inputs, L.Dense(10)(x)),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), _batch(batch, (60, 16)))


def embedding_attention(batch=32):
    """Token embedding, Conv1D, dot-product attention, dropout."""
    import keras
    import numpy as np
    import tensorflow as tf

    L = keras.layers
    inputs = keras.Input((100,), dtype="int32")
    x = L.Conv1D(64, 5, padding="same", activation="relu")(L.Embedding(5000, 64)(inputs))
    x = L.Dropout(0.3)(L.GlobalAveragePooling1D()(L.Attention()([x, x])))
    rng = np.random.default_rng(0)
    data = (tf.constant(rng.integers(0, 5000, size=(batch, 100), dtype=np.int32)),
            tf.constant(rng.integers(0, 10, size=(batch,), dtype=np.int32)))
    return (keras.Model(inputs, L.Dense(10)(x)),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), data)


def gpt_mini(batch=16):
    """A causal decoder: token and position embeddings, two pre-norm blocks of
    causally masked attention and a ReLU MLP, a loss over every position's next token."""
    import keras
    import numpy as np
    import tensorflow as tf

    L = keras.layers
    seq, vocab, width = 64, 2000, 128
    class AddPositions(L.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(seq, width), initializer="glorot_uniform")

        def call(self, x):
            return x + self.table

    tokens = keras.Input((seq,), dtype="int32")
    x = AddPositions()(L.Embedding(vocab, width)(tokens))
    for _ in range(2):
        h = L.LayerNormalization(epsilon=1e-5)(x)
        x = x + L.MultiHeadAttention(4, 32)(h, h, use_causal_mask=True)
        h = L.LayerNormalization(epsilon=1e-5)(x)
        x = x + L.Dense(width)(L.Dense(4 * width, activation="relu")(h))
    logits = L.Dense(vocab)(L.LayerNormalization(epsilon=1e-5)(x))
    rng = np.random.default_rng(0)
    data = (tf.constant(rng.integers(0, vocab, size=(batch, seq), dtype=np.int32)),
            tf.constant(rng.integers(0, vocab, size=(batch, seq), dtype=np.int32)))
    return (keras.Model(tokens, logits),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), data)


def seq2seq_lstm(batch=32):
    """An LSTM encoder whose final states start an LSTM decoder (teacher forcing), a
    time-distributed projection, a loss per decoded step."""
    import keras
    import numpy as np
    import tensorflow as tf

    L = keras.layers
    source_len, target_len, vocab = 40, 30, 500
    source = keras.Input((source_len,), dtype="int32")
    target = keras.Input((target_len,), dtype="int32")
    _, h, c = L.LSTM(128, return_state=True)(L.Embedding(vocab, 64)(source))
    decoded = L.LSTM(128, return_sequences=True)(L.Embedding(vocab, 64)(target),
                                                 initial_state=[h, c])
    logits = L.TimeDistributed(L.Dense(vocab))(decoded)
    rng = np.random.default_rng(0)
    data = ((tf.constant(rng.integers(0, vocab, size=(batch, source_len), dtype=np.int32)),
             tf.constant(rng.integers(0, vocab, size=(batch, target_len), dtype=np.int32))),
            tf.constant(rng.integers(0, vocab, size=(batch, target_len), dtype=np.int32)))
    return (keras.Model([source, target], logits),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), data)


def groupnorm_resnet(batch=16):
    """Residual blocks with group normalization, swish, a dilated convolution, a
    concatenated shortcut and average pooling."""
    import keras

    L = keras.layers
    inputs = keras.Input((64, 64, 3))
    x = L.Conv2D(32, 3, padding="same")(inputs)
    for filters, dilation in ((32, 1), (64, 2), (64, 1)):
        h = L.Activation("swish")(L.GroupNormalization(8)(x))
        h = L.Conv2D(filters, 3, padding="same", dilation_rate=dilation)(h)
        h = L.Activation("swish")(L.GroupNormalization(8)(h))
        h = L.Conv2D(filters, 3, padding="same")(h)
        x = L.Concatenate()([x, h]) if filters != x.shape[-1] else L.Add()([x, h])
        x = L.AveragePooling2D(2)(x)
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(x))
    return (keras.Model(inputs, outputs),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            _batch(batch, (64, 64, 3)))


def conv3d_video(batch=8):
    """Clips of 8 frames: 3-D convolutions with batch norm, 3-D max pooling, a
    (2+1)-D factorised block."""
    import keras

    L = keras.layers
    inputs = keras.Input((8, 32, 32, 3))
    x = L.Conv3D(16, 3, padding="same", activation="relu")(inputs)
    x = L.MaxPooling3D((1, 2, 2))(L.BatchNormalization()(x))
    x = L.Conv3D(32, (1, 3, 3), padding="same", activation="relu")(x)
    x = L.Conv3D(32, (3, 1, 1), padding="same", activation="relu")(x)
    x = L.MaxPooling3D()(L.BatchNormalization()(x))
    outputs = L.Dense(10)(L.GlobalAveragePooling3D()(x))
    return (keras.Model(inputs, outputs),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            _batch(batch, (8, 32, 32, 3)))


MODELS = {
    "vgg16": _application("VGG16", 64, 16),
    "resnet50v2": _application("ResNet50V2", 64, 8),
    "xception": _application("Xception", 71, 8),
    "inceptionv3": _application("InceptionV3", 75, 8),
    "mobilenetv3small": _application("MobileNetV3Small", 64, 16),
    "efficientnetv2b0": _application("EfficientNetV2B0", 64, 8),
    "convnext_tiny": _application("ConvNeXtTiny", 32, 4),
    "nasnetmobile": _application("NASNetMobile", 64, 4),
    "vit_tiny": vit_tiny,
    "conv_autoencoder": conv_autoencoder,
    "bidirectional_gru": bidirectional_gru,
    "embedding_attention": embedding_attention,
    "gpt_mini": gpt_mini,
    "seq2seq_lstm": seq2seq_lstm,
    "groupnorm_resnet": groupnorm_resnet,
    "conv3d_video": conv3d_video,
}


def train_step(name, batch=None):
    """Model `name`'s tf.function train step (Adam, tfmemopt.demo.keras_train_step)
    and its batch, at `batch` (default: the model's own), as benchmarks/models.py's
    MODELS give theirs: (step, (x, y))."""
    import keras
    from tfmemopt.demo import keras_train_step

    keras.utils.set_random_seed(0)
    model, loss, data = MODELS[name]() if batch is None else MODELS[name](batch=batch)
    return keras_train_step(model, loss), data


def child(name, budget):
    """One run in this process: prints one JSON line."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tfmemopt.demo import keras_train_step

    if os.environ.get("UNSEEN_INTER_OP"):
        tf.config.threading.set_inter_op_parallelism_threads(int(os.environ["UNSEEN_INTER_OP"]))
    if os.environ.get("UNSEEN_TF_MEMORY_OPTIMIZATION"):
        import tfmemopt

        tfmemopt.set_tf_memory_optimization(os.environ["UNSEEN_TF_MEMORY_OPTIMIZATION"])
    keras.utils.set_random_seed(0)
    if budget:
        import tfmemopt

        tfmemopt.enable(budget=budget)
    model, loss, (x, y) = MODELS[name]()
    step = keras_train_step(model, loss)
    out = {"losses": [], "peaks": []}
    try:
        for _ in range(STEPS):
            tf.config.experimental.reset_memory_stats("CPU:0")
            out["losses"].append(float(step(x, y).numpy()).hex())
            out["peaks"].append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    except Exception as err:  # noqa: BLE001 - reported as the row's error
        out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    digest = hashlib.sha256()
    for variable in model.variables:
        digest.update(np.ascontiguousarray(variable.numpy()).tobytes())
    out["weights"] = digest.hexdigest()
    if budget:
        import tfmemopt

        report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)  # the train step
        out["report"] = {"status": report.status, "message": report.message,
                         "changed": report.graph_changed,
                         "before": report.predicted_peak_bytes["before"]["CPU:0"],
                         "after": report.predicted_peak_bytes["after"]["CPU:0"],
                         "budget": report.budget_bytes["CPU:0"],
                         "arrival_order_sums": [s["name"] for s in report.arrival_order_sums]}
    print("RESULT " + json.dumps(out), flush=True)


def run_child(name, budget, timeout=1800, inter_op=None, tf_memory_optimization=None):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    if inter_op:
        env["UNSEEN_INTER_OP"] = str(inter_op)
    if tf_memory_optimization:
        env["UNSEEN_TF_MEMORY_OPTIMIZATION"] = tf_memory_optimization
    env.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name,
                               str(budget)], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"exit code {done.returncode}: {tail[0][:300]}"}
    return json.loads(lines[-1][len("RESULT "):])


def same_result(a, b):
    """Two runs' losses and final weights are bitwise equal."""
    return a.get("losses") == b.get("losses") and a.get("weights") == b.get("weights")


def equal_where_plain_repeats(name, budget, **settings):
    """Plain twice and planned once under `settings` (run_child's keywords): whether
    planned equals plain, or None when a run fails or plain does not repeat itself."""
    plain, again, planned = [run_child(name, b, **settings) for b in (0, 0, budget)]
    if any("error" in r for r in (plain, again, planned)) or not same_result(plain, again):
        return None
    return same_result(planned, plain)


def measure(name, ratio, log):
    plain = run_child(name, 0)
    row = {"steady_peak_bytes": None}
    if "error" in plain:
        row["error"] = "plain: " + plain["error"]
        return row
    peak = max(plain["peaks"][1:])
    row["steady_peak_bytes"] = peak
    planned = run_child(name, int(ratio * peak))
    if "error" in planned:
        row["error"] = "planned: " + planned["error"]
        if "report" not in planned:
            return row
    report = planned["report"]
    planned_peak = max(planned["peaks"][1:]) if len(planned["peaks"]) > 1 else None
    same = same_result(planned, plain)
    one_thread = fixed_order = None
    if not same:
        # Only a plain run that repeats itself can be compared bit for bit.
        if not same_result(run_child(name, 0), plain):
            same = None
        # With one inter-op thread TF runs one op at a time, in an order fixed per
        # graph: plain and planned compared there tell a rewrite that changes values
        # (a mismatch) from one that only changes which ops overlap.
        one_thread = equal_where_plain_repeats(name, int(ratio * peak), inter_op=1)
        # Sums TF adds in arrival order follow the execution order, which the rewrite
        # changes; with TF's memory optimizer off they are AddNs, added in a fixed order.
        if report.get("arrival_order_sums"):
            fixed_order = equal_where_plain_repeats(name, int(ratio * peak),
                                                    tf_memory_optimization="NO_MEM_OPT")
    row.update(
        bitwise_equal=same, one_inter_op_thread_equal=one_thread,
        arrival_order_sums=report.get("arrival_order_sums", []),
        fixed_order_sums_equal=fixed_order,
        fallback=report["status"] != "ok", changed=report["changed"],
        budget_bytes=report["budget"],
        unplanned={"predicted": report["before"], "measured": peak,
                   "error": report["before"] / peak - 1},
        planned={"predicted": report["after"], "measured": planned_peak,
                 "error": report["after"] / planned_peak - 1 if planned_peak else None,
                 "fits": report["after"] <= report["budget"]})
    verdict = {True: "bitwise equal", False: "DIFFERS", None: "plain TF differs between runs"}
    checks = [{True: "equal with one inter-op thread",
               False: "DIFFERS with one inter-op thread too"}.get(one_thread),
              {True: "equal with TF's sums in a fixed order",
               False: "DIFFERS with TF's sums in a fixed order too"}.get(fixed_order)]
    checks = "; ".join(c for c in checks if c)
    log(f"{name}: {verdict[row['bitwise_equal']]}{f' ({checks})' if checks else ''}; unplanned "
        f"{report['before'] / 2**20:.1f} MiB predicted / {peak / 2**20:.1f} measured; planned "
        f"{report['after'] / 2**20:.1f} / {(planned_peak or 0) / 2**20:.1f} MiB "
        f"({'fits' if row['planned']['fits'] else 'over'} the budget)")
    return row


def summarize(rows):
    done = {name: row for name, row in rows.items() if "bitwise_equal" in row}
    unplanned = [abs(r["unplanned"]["error"]) for r in done.values()]
    planned = [abs(r["planned"]["error"]) for r in done.values()
               if r["planned"]["fits"] and r["planned"]["error"] is not None]
    return {"models": len(rows),
            "bitwise_equal": sum(r["bitwise_equal"] is True for r in done.values()),
            "mismatches": sorted(n for n, r in done.items() if r["bitwise_equal"] is False),
            # of those, the ones that also differ with one inter-op thread
            "mismatches_one_inter_op_thread": sorted(
                n for n, r in done.items() if r.get("one_inter_op_thread_equal") is False),
            "arrival_order_sums": {n: r["arrival_order_sums"] for n, r in done.items()
                                   if r.get("arrival_order_sums")},
            # of the mismatches, the ones that also differ with TF's sums in a fixed order
            "mismatches_fixed_order_sums": sorted(
                n for n, r in done.items() if r.get("fixed_order_sums_equal") is False),
            "plain_not_repeatable": sorted(n for n, r in done.items()
                                           if r["bitwise_equal"] is None),
            "fallbacks": sorted(n for n, r in done.items() if r["fallback"]),
            "errors": sorted(f"{n}: {r['error']}" for n, r in rows.items() if "error" in r),
            "max_abs_error_unplanned": max(unplanned, default=None),
            "max_abs_error_planned_fits": max(planned, default=None),
            "rows": rows}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--ratio", type=float, default=0.6,
                        help="planned budget as a fraction of the plain run's peak")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 0.0 < args.ratio <= 1.0:
        parser.error(f"--ratio={args.ratio}; allowed: a fraction in (0, 1]")

    def log(text):
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = {name: measure(name, args.ratio, log) for name in args.models}
    summary = summarize(rows)
    summary["ratio"] = args.ratio
    if args.json:
        print(json.dumps(summary))
    else:
        print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
