"""Step time of Keras fit on a tf.data pipeline, without and with tfmemopt's guard.

Under tfmemopt.enable() (fit_retries, on by default) the first `guard_steps` steps
after each plan read their batches beforehand and replay them through an iterator of
the pipeline's element spec (tfmemopt/keras.py: _Replay), so that a step that runs
out of memory can be retried with the same batches; later steps read Keras's iterator
directly. A small CNN (two 3x3 convolutions of 32 channels) on 64x64x3 images, batch
64, 60 steps; each configuration in its own interpreter; the median step time over
the steps after the tenth:

  plain:     fit without tfmemopt;
  enable:    tfmemopt.enable() (guard_steps 7: steps 1-7 replayed, then direct);
  guard_all: MemoryOptimizer(guard_steps=10**6): every step replayed.

Usage: python benchmarks/keras_guard_overhead.py [--runs 2] [--json]
--json prints {"plain_ms", "enable_ms", "guard_all_ms", "enable_ratio",
"guard_all_extra_ms"} (medians over --runs processes) as the last line.
"""

import argparse
import json
import statistics
import subprocess
import sys

_TRIAL = r"""
import json, statistics, sys, time
import numpy as np, tensorflow as tf, keras
mode = sys.argv[1]
keras.utils.set_random_seed(0)
callbacks = []
if mode == "enable":
    import tfmemopt
    tfmemopt.enable()
elif mode == "guard_all":
    from tfmemopt.keras import MemoryOptimizer
    callbacks = [MemoryOptimizer(guard_steps=10**6, print_report=False)]
model = keras.Sequential([keras.Input((64, 64, 3)),
                          keras.layers.Conv2D(32, 3, activation="relu"),
                          keras.layers.Conv2D(32, 3, activation="relu"),
                          keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
n = 64 * 30
dataset = tf.data.Dataset.from_tensor_slices(
    (rng.standard_normal((n, 64, 64, 3)).astype(np.float32), rng.integers(0, 10, n))).batch(64)
times = []
class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()
    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.start)
model.fit(dataset, epochs=2, verbose=0, callbacks=[Timer()] + callbacks)
print("RESULT " + json.dumps(1000 * statistics.median(times[10:])))
"""

MODES = ("plain", "enable", "guard_all")


def step_ms(mode):
    out = subprocess.run([sys.executable, "-c", _TRIAL, mode], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.split("RESULT ")[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    samples = {mode: [] for mode in MODES}
    for _ in range(args.runs):
        for mode in MODES:  # taking turns, so that the machine's drift hits all alike
            samples[mode].append(step_ms(mode))
            print(f"{mode}: {samples[mode][-1]:.1f} ms/step", flush=True)
    median = {mode: statistics.median(values) for mode, values in samples.items()}
    result = {"plain_ms": median["plain"], "enable_ms": median["enable"],
              "guard_all_ms": median["guard_all"],
              "enable_ratio": median["enable"] / median["plain"],
              "guard_all_extra_ms": median["guard_all"] - median["plain"],
              "runs": samples}
    print(f"enable() / plain: {result['enable_ratio']:.3f}; a replayed (guarded) step adds "
          f"{result['guard_all_extra_ms']:.1f} ms")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
