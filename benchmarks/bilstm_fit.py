"""A bidirectional text classifier trained with Keras `fit` near its memory cap: with
`tfmemopt.enable()` (which gives `fit` the feedback loop, fit_retries=3), with
`enable(fit_retries=0)` (the plan alone: Keras's own step, nothing retried), with the
Keras callback, and without tfmemopt.

The model is benchmarks/models.py::bidirectional_lstm (Embedding with mask_zero into
two Bidirectional LSTMs) compiled for `fit`. TF runs each layer's two directions side
by side, so where BFC places the loops' elements, and where their holes are, differs
from process to process (docs/loops.md, Limits). Each trial runs in a fresh process
under TF's BFC CPU allocator with the given cap, trains `--epochs` steps of one batch
and reports whether it trained, what the plan said (fits, predicted peak), the
measured peak and the losses as hex; with `--uncapped` the same batch also trains
once without tfmemopt and without a cap, and the losses of every trial that trained
are compared with it bit for bit.

Usage: python benchmarks/bilstm_fit.py --batches 85 96 --modes enable enable_no_retry callback
           [--processes 2] [--cap-mb 256] [--budget B] [--samples N]
           [--assume-batch-size N] [--uncapped] [--json]
"""
import argparse
import json
import os
import subprocess
import sys

MIB = 2.0**20

CHILD = r'''
import json, sys
mode, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
budget = json.loads(sys.argv[4])  # None: the default (0.9 of the device)
samples, assume_batch_size = int(sys.argv[5]) or batch, int(sys.argv[6])
fields = {"assume_batch_size": assume_batch_size} if assume_batch_size else {}
import tfmemopt
if mode == "enable":
    tfmemopt.enable(budget, log_level=0, **fields)
elif mode == "enable_no_retry":
    tfmemopt.enable(budget, log_level=0, fit_retries=0, **fields)
retries = []
import logging
class _Retries(logging.Handler):
    def emit(self, record):
        if "retrying the batch (retry" in record.getMessage():  # not "not retrying"
            retries.append(record.getMessage())
import numpy as np
import tensorflow as tf
import keras

# The classifier of benchmarks/models.py::bidirectional_lstm, its data made the same way.
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
steps, vocab = 200, 10000
layers_ = keras.layers
inputs = keras.Input((steps,), dtype="int32")
x = layers_.Embedding(vocab, 64, mask_zero=True)(inputs)
x = layers_.Bidirectional(layers_.LSTM(128, return_sequences=True))(x)
x = layers_.Bidirectional(layers_.LSTM(64))(x)
x = layers_.Dropout(0.2)(layers_.Dense(64, activation="relu")(x))
model = keras.Model(inputs, layers_.Dense(5)(x))
xs = rng.integers(0, vocab, size=(samples, steps)).astype("int32")
xs[:, -rng.integers(0, 50):] = 0  # padding
ys = rng.integers(0, 5, size=(samples,)).astype("int32")
model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callbacks = []
if mode == "callback":
    import tfmemopt.keras
    callbacks = [tfmemopt.keras.MemoryOptimizer(budget, **fields)]
out = {"mode": mode, "batch": batch}
tf.get_logger().addHandler(_Retries())
try:
    history = model.fit(xs, ys, batch_size=batch, epochs=epochs,
                        shuffle=False, verbose=0, callbacks=callbacks)
    out["outcome"] = "trained"
    out["losses"] = [float(v).hex() for v in history.history["loss"]]
except tf.errors.ResourceExhaustedError:
    out["outcome"] = "out of memory"
out["peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
out["retries"] = len(retries)
if mode != "plain":
    # Keras's own step, or the one-batch step the feedback loop calls; the last plan.
    step_reports = [r for r in tfmemopt.reports() if r.graph_id.startswith(
        ("__inference_multi_step", "__inference_one_step_on_data"))]
    if step_reports:
        report = step_reports[-1]
        device = [d for d in report.to_dict()["devices"] if d["device"].endswith("CPU:0")][0]
        out.update(fits=report.fits, predicted_bytes=device["peak_after_bytes"],
                   budget_bytes=device["budget_bytes"])
print("RESULT " + json.dumps(out))
'''


def _budget(text):
    """--budget as enable() takes it: an int of bytes, a fraction, or a size string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def trial(mode, batch, epochs, cap_mb, budget=None, samples=0, assume_batch_size=0):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mb), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(batch), str(epochs),
                           json.dumps(budget), str(samples), str(assume_batch_size)],
                          capture_output=True, text=True, env=env, timeout=1800)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"mode": mode, "batch": batch, "outcome": "error",
                "error": proc.stderr[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[85, 96, 112, 128])
    parser.add_argument("--modes", nargs="+", default=["enable", "enable_no_retry", "callback"],
                        choices=["enable", "enable_no_retry", "callback", "plain"])
    parser.add_argument("--processes", type=int, default=2, help="trials per batch and mode")
    parser.add_argument("--cap-mb", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--uncapped", action="store_true",
                        help="compare the losses with an uncapped run without tfmemopt")
    parser.add_argument("--budget", type=_budget, default=None,
                        help="tfmemopt's budget as for enable(): bytes, a size like 190MiB, "
                             "or a fraction like 0.8 (default: 0.9 of the device)")
    parser.add_argument("--samples", type=int, default=0,
                        help="samples per epoch (default: one batch); more than a multiple "
                             "of the batch ends each epoch in a partial batch, for which "
                             "Keras traces its step with an unknown batch dimension")
    parser.add_argument("--assume-batch-size", type=int, default=0,
                        help="tfmemopt's assume_batch_size (the callback sets it itself)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results = []
    for batch in args.batches:
        reference = (trial("plain", batch, args.epochs, 1 << 16, samples=args.samples)
                     if args.uncapped else None)
        for mode in args.modes:
            for _ in range(args.processes):
                result = trial(mode, batch, args.epochs, args.cap_mb, args.budget,
                               args.samples, args.assume_batch_size)
                if reference is not None and result.get("outcome") == "trained":
                    result["bitwise_equal_uncapped"] = (
                        result["losses"] == reference.get("losses"))
                results.append(result)
                said = ("" if "fits" not in result else
                        f"says {'fits' if result['fits'] else 'does not fit'} "
                        f"({result['predicted_bytes'] / MIB:.1f} MiB)")
                print(f"batch {batch:4d} {mode:9s} {result['outcome']:14s} "
                      f"peak {result.get('peak_bytes', 0) / MIB:6.1f} MiB {said}"
                      + ("" if "bitwise_equal_uncapped" not in result else
                         f" bitwise equal uncapped: {result['bitwise_equal_uncapped']}"),
                      flush=True)
    claims = [r for r in results if r.get("fits")]

    def per_mode(rows, outcome):
        return {mode: sum(r["mode"] == mode and r["outcome"] == outcome for r in rows)
                for mode in args.modes}

    summary = {
        "cap_mb": args.cap_mb, "budget": args.budget, "trials": len(results),
        "claims": len(claims),
        # A claim is the last plan's: after a retry, the plan that was retried with.
        "fits_but_oom": sum(r["outcome"] == "out of memory" for r in claims),
        "fits_but_oom_by_mode": per_mode(claims, "out of memory"),
        "trained": per_mode(results, "trained"),
        "trained_after_retry": per_mode([r for r in results if r.get("retries")], "trained"),
        "results": results,
    }
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
