"""A recurrent model that fits its budget as predicted, with and without its loops paced.

The pass paces a graph it does not otherwise change when the iterations its loops may
run ahead could take it over its budget (docs/loops.md#pacing). This trains
benchmarks/models.py's MODEL (default "lstm") under --ratio (default 1.05) times its
predicted peak, --processes fresh interpreters with `pace_loops` on and as many with
it off, on TF's BFC CPU allocator, each 2 warm-up steps then 5 measured ones, and
prints each process's step peaks against the prediction and the budget.

Usage: python benchmarks/pace_near_budget.py [--model lstm] [--ratio 1.05]
           [--processes 3] [--inter-op 0] [--json]
--json prints one JSON object as the last line of stdout: {"model", "ratio",
"predicted_bytes", "budget_bytes", "paced": [{"peaks", "graph_changed",
"pacing_edges"}, ...], "unpaced": [...], "over_budget": {"paced": N, "unpaced": N}}
(processes with a step over the budget).
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_TRIAL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
if int(sys.argv[4]):
    tf.config.threading.set_inter_op_parallelism_threads(int(sys.argv[4]))
import tfmemopt
from models import MODELS
tf.keras.utils.set_random_seed(0)
budget = int(sys.argv[3])
if budget:
    tfmemopt.enable(budget=budget, log_level=0, pace_loops=sys.argv[5] == "on")
else:
    tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
step, args = MODELS[sys.argv[2]]()
for _ in range(2):
    step(*args)
peaks = []
for _ in range(5):
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(*args)
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)
print("TRIAL " + json.dumps({"peaks": peaks, "graph_changed": report.graph_changed,
                             "predicted": report.predicted_peak_bytes["after"]["CPU:0"],
                             "pacing_edges": len(report.loop_pacing.get("edges", []))}))
"""


def trial(model, budget, inter_op, pace):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")
    proc = subprocess.run([sys.executable, "-c", _TRIAL, HERE, model, str(budget),
                           str(inter_op), pace], capture_output=True, text=True, env=env,
                          timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("TRIAL "):
            return json.loads(line[len("TRIAL "):])
    raise RuntimeError(f"{model}: trial failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lstm")
    parser.add_argument("--ratio", type=float, default=1.05)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--inter-op", type=int, default=0,
                        help="inter_op_parallelism_threads (0 = TF's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    predicted = trial(args.model, 0, args.inter_op, "on")["predicted"]
    budget = int(args.ratio * predicted)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"{args.model}: predicted {mib(predicted)} MiB, budget {mib(budget)} MiB "
          f"({args.ratio}x), inter-op threads {args.inter_op or 'default'}", flush=True)
    out = {"model": args.model, "ratio": args.ratio, "inter_op": args.inter_op,
           "predicted_bytes": predicted, "budget_bytes": budget, "paced": [], "unpaced": []}
    for _ in range(args.processes):
        for name, pace in (("paced", "on"), ("unpaced", "off")):
            t = trial(args.model, budget, args.inter_op, pace)
            out[name].append(t)
            print(f"  {name:<8} changed {str(t['graph_changed']):<5} edges {t['pacing_edges']:>3}  "
                  f"step peaks (MiB) {' '.join(mib(p) for p in t['peaks'])}", flush=True)
    out["over_budget"] = {name: sum(max(t["peaks"]) > budget for t in out[name])
                          for name in ("paced", "unpaced")}
    print(f"processes with a step over the budget: paced {out['over_budget']['paced']}, "
          f"unpaced {out['over_budget']['unpaced']} (of {args.processes} each)")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
