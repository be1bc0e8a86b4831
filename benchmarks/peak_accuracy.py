"""Predicted vs measured peak memory of one training step, per benchmark model.

Each model runs in its own interpreter on TF's BFC CPU allocator
(TF_CPU_ALLOCATOR_USE_BFC=true), with the pass in ANALYZE_ONLY mode. The measured
peak is the allocator's peak during the second step (after reset_memory_stats, so
graph building and the first step's one-off allocations are excluded); the
predicted peak is the pass's report for the train-step graph.

Usage: python benchmarks/peak_accuracy.py [--models NAME ...] [--inter-op N] [--json]
"""

import argparse
import json
import os
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
step(x, y)
tf.config.experimental.reset_memory_stats("CPU:0")
step(x, y)
measured = tf.config.experimental.get_memory_info("CPU:0")["peak"]
reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")]
report = reports[-1]
print("TRIAL " + json.dumps({
    "predicted": report.predicted_peak_bytes["after"]["CPU:0"],
    "measured": measured,
    "nodes": report.num_nodes,
    "unresolved": report.unresolved_tensors,
    "top": [t._asdict() for t in report.top_tensors_at_peak[:5]],
}))
'''


def run_model(name, inter_op=0, timeout=900):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")
    proc = subprocess.run(
        [sys.executable, "-c", _TRIAL, HERE, name, str(inter_op)],
        capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("TRIAL "):
            result = json.loads(line[len("TRIAL "):])
            result["error"] = (result["predicted"] - result["measured"]) / result["measured"]
            return result
    raise RuntimeError(f"{name}: trial failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def main():
    sys.path.insert(0, HERE)
    from models import MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--inter-op", type=int, default=0,
                        help="inter_op_parallelism_threads (0 = TF's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    print(f"{'model':<16} | {'predicted':>12} | {'measured':>12} | {'error %':>8}", flush=True)
    for name in args.models:
        r = run_model(name, args.inter_op)
        results[name] = r
        print(f"{name:<16} | {r['predicted'] / 2**20:>8.1f} MiB | {r['measured'] / 2**20:>8.1f} MiB"
              f" | {r['error'] * 100:>+8.1f}", flush=True)
    if args.json:
        print(json.dumps({
            "models": {n: {k: r[k] for k in ("predicted", "measured", "error")} for n, r in results.items()},
            "max_abs_error": max(abs(r["error"]) for r in results.values()),
            "inter_op": args.inter_op,
        }))


if __name__ == "__main__":
    main()
