"""Predicted vs measured peak memory of training steps, per benchmark model.

Each model trains in its own interpreter on TF's BFC CPU allocator
(TF_CPU_ALLOCATOR_USE_BFC=true), with the pass in ANALYZE_ONLY mode; the predicted
peak is the pass's report for the train-step graph.

What is measured is the peak a training run reaches: the allocator's peak over
--steps steps (default 5) after --warmup steps (default 2), each step's peak read
after a reset_memory_stats, so graph building and the first steps' one-off
allocations are excluded. A single step is not representative: the executor's
order and the allocator's fragmentation move the peak from step to step, and
between processes (the order of a node's out edges is arbitrary in TF, so one
process may run the same graph in another order than the next). The benchmark
therefore trains each model in --runs processes (default 5) and reports the
median of their peaks as "measured", with the lowest and highest beside it.

Usage: python benchmarks/peak_accuracy.py [--models NAME ...] [--inter-op N]
           [--warmup N] [--steps N] [--runs N] [--json]
With --json, the last line of stdout is one JSON object:
{"models": {name: {"predicted", "measured", "error", "runs", "step_peaks"}},
 "max_abs_error", "inter_op", "warmup", "steps"}.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_TRIAL = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
inter_op = int(sys.argv[3])
if inter_op:
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
import tfmemopt
from models import MODELS
tf.keras.utils.set_random_seed(0)
tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
step, (x, y) = MODELS[sys.argv[2]]()
for _ in range(int(sys.argv[4])):
    step(x, y)
step_peaks = []
for _ in range(int(sys.argv[5])):
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(x, y)
    step_peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")]
report = reports[-1]
print("TRIAL " + json.dumps({
    "predicted": report.predicted_peak_bytes["after"]["CPU:0"],
    "measured": max(step_peaks),
    "step_peaks": step_peaks,
    "nodes": report.num_nodes,
    "unresolved": report.unresolved_tensors,
}))
'''


def run_trial(name, inter_op=0, warmup=2, steps=5, timeout=1800):
    """Trains `name` in a fresh interpreter; returns its predicted and measured peaks."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")
    proc = subprocess.run(
        [sys.executable, "-c", _TRIAL, HERE, name, str(inter_op), str(warmup), str(steps)],
        capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("TRIAL "):
            return json.loads(line[len("TRIAL "):])
    raise RuntimeError(f"{name}: trial failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def run_model(name, inter_op=0, warmup=2, steps=5, runs=3):
    """The median over `runs` processes of the peak each reaches."""
    trials = [run_trial(name, inter_op, warmup, steps) for _ in range(runs)]
    measured = int(statistics.median_low(t["measured"] for t in trials))
    predicted = trials[-1]["predicted"]
    return {
        "predicted": predicted,
        "measured": measured,
        "error": (predicted - measured) / measured,
        "runs": [t["measured"] for t in trials],
        "step_peaks": [t["step_peaks"] for t in trials],
        "unresolved": trials[-1]["unresolved"],
    }


def main():
    sys.path.insert(0, HERE)
    from models import MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--inter-op", type=int, default=0,
                        help="inter_op_parallelism_threads (0 = TF's default)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    parser.add_argument("--steps", type=int, default=5, help="steps measured (peak over all)")
    parser.add_argument("--runs", type=int, default=5, help="processes per model (median)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mib = 2.0**20
    results = {}
    print(f"{'model':<16} | {'predicted':>9} | {'measured':>9} | {'error %':>7} | runs (MiB)",
          flush=True)
    for name in args.models:
        r = run_model(name, args.inter_op, args.warmup, args.steps, args.runs)
        results[name] = r
        runs = " ".join(f"{m / mib:.1f}" for m in sorted(r["runs"]))
        print(f"{name:<16} | {r['predicted'] / mib:>9.1f} | {r['measured'] / mib:>9.1f} | "
              f"{r['error'] * 100:>+7.1f} | {runs}", flush=True)
    if args.json:
        print(json.dumps({
            "models": {n: {k: r[k] for k in ("predicted", "measured", "error", "runs", "step_peaks")}
                       for n, r in results.items()},
            "max_abs_error": max(abs(r["error"]) for r in results.values()),
            "inter_op": args.inter_op,
            "warmup": args.warmup,
            "steps": args.steps,
            "runs": args.runs,
        }))


if __name__ == "__main__":
    main()
