"""The allocator model plays every iteration of a loop (simulate/liveness_simulator.cc,
AllocatorListener's loop iterations).

A simulation runs a loop's body once. TF runs it once per iteration, and each
iteration's TensorList element is a chunk of its own between that iteration's
temporaries; a bidirectional layer's two loops run side by side and interleave their
elements. BFC's regions end up full of small chunks and holes, and near the cap the
large gradients after the loops find no chunk to fit in, though the bytes in use are
far below the cap. A model that allocated each list in one piece said such a step fits.

The model is the user's text classifier that found this: Embedding (mask_zero) into
two Bidirectional LSTMs, trained with Keras `fit` under a 256 MiB cap. Without
tfmemopt it trains batch 64; at 72 it ran out of memory in all but one of the
processes measured (which one depends on how TF's threads interleave the two
directions), at 80 in every one.
"""

from conftest import capped_allocator_env, run_python, subprocess_result

CAP_MB = 256

CODE = r'''
import json, sys
import numpy as np
mode, batch = sys.argv[1], int(sys.argv[2])
import tfmemopt
if mode == "analyze":
    tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
import tensorflow as tf
import keras
L = keras.layers
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
steps, vocab = 200, 10000
inp = keras.Input((steps,), dtype="int32")
x = L.Embedding(vocab, 64, mask_zero=True)(inp)
x = L.Bidirectional(L.LSTM(128, return_sequences=True))(x)
x = L.Bidirectional(L.LSTM(64))(x)
x = L.Dropout(0.2)(L.Dense(64, activation="relu")(x))
model = keras.Model(inp, L.Dense(5)(x))
xs = rng.integers(0, vocab, size=(batch, steps)).astype("int32")
xs[:, -rng.integers(0, 50):] = 0  # padding
ys = rng.integers(0, 5, size=(batch,)).astype("int32")
model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
out = {}
try:
    model.fit(xs, ys, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    out["outcome"] = "trained"
except tf.errors.ResourceExhaustedError:
    out["outcome"] = "out of memory"
if mode == "analyze":
    report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)
    device = [d for d in report.to_dict()["devices"] if d["device"].endswith("CPU:0")][0]
    out.update(fits=report.fits, peak=device["peak_before_bytes"],
               budget=device["budget_bytes"], text=report.to_text(),
               unresolved=report.unresolved_tensors,
               unresolved_variants=report.unresolved_variants)
print("RESULT " + json.dumps(out))
'''


def _run(mode, batch):
    proc = run_python(CODE, mode, batch, env=capped_allocator_env(
        CAP_MB, TF_CPP_MIN_LOG_LEVEL="2"), timeout=900)
    return subprocess_result(proc)


def test_where_tf_runs_out_of_memory_among_a_loops_elements_the_report_does_not_say_fits():
    plain = _run("plain", 80)
    assert plain["outcome"] == "out of memory"  # in BFC's holes: the bytes are below the cap
    analyzed = _run("analyze", 80)
    assert analyzed["fits"] is False, analyzed["text"][:1500]

    analyzed = _run("analyze", 72)
    # Each list allocated whole, the model predicted 226.7 MiB: under the 230.4 MiB
    # budget, "fits". Played iteration by iteration, it is over the budget.
    assert analyzed["fits"] is False, analyzed["text"][:1500]
    assert analyzed["peak"] > analyzed["budget"]


def test_a_batch_that_trains_is_still_said_to_fit():
    analyzed = _run("analyze", 56)
    assert analyzed["outcome"] == "trained"
    assert analyzed["fits"] is True, analyzed["text"][:1500]
    assert analyzed["peak"] < analyzed["budget"]
    # Every dense tensor is sized: the shape vectors the loops keep for their
    # gradients are a few bytes, not an unknown batch; what is left is variants (the
    # gradient loops' sums of lists), counted as empty and named as such.
    assert analyzed["unresolved"] == 0, analyzed["text"][:1500]
    assert "set assume_batch_size" not in analyzed["text"]
    assert analyzed["unresolved_variants"] > 0
    assert "lists or optionals of unknown contents" in analyzed["text"]
