"""A recurrent model that fits its budget as predicted, with and without its loops paced.

The pass paces a graph it does not otherwise change when the iterations its loops may
run ahead could take it over its budget (docs/loops.md#pacing). This trains
benchmarks/models.py's MODEL (default "lstm") under --ratio (default 1.05) times its
predicted peak, --processes fresh interpreters with `pace_loops` on and as many with
it off (peak_accuracy.run_trial: TF's BFC CPU allocator, 2 warm-up steps then 5
measured ones), and prints each process's step peaks against the prediction and the
budget.

Usage: python benchmarks/pace_near_budget.py [--model lstm] [--ratio 1.05]
           [--processes 3] [--inter-op 0] [--json]
--json prints one JSON object as the last line of stdout: {"model", "ratio",
"predicted_bytes", "budget_bytes", "paced": [trial, ...], "unpaced": [...],
"over_budget": {"paced": N, "unpaced": N}} (processes with a step over the budget),
a trial being peak_accuracy.run_trial's dict ("step_peaks", "graph_changed",
"pacing_edges", ...).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peak_accuracy import run_trial  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lstm")
    parser.add_argument("--ratio", type=float, default=1.05)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--inter-op", type=int, default=0,
                        help="inter_op_parallelism_threads (0 = TF's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    predicted = run_trial(args.model, args.inter_op)["predicted"]
    budget = int(args.ratio * predicted)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"{args.model}: predicted {mib(predicted)} MiB, budget {mib(budget)} MiB "
          f"({args.ratio}x), inter-op threads {args.inter_op or 'default'}", flush=True)
    out = {"model": args.model, "ratio": args.ratio, "inter_op": args.inter_op,
           "predicted_bytes": predicted, "budget_bytes": budget, "paced": [], "unpaced": []}
    for _ in range(args.processes):
        for name, pace in (("paced", True), ("unpaced", False)):
            t = run_trial(args.model, args.inter_op, budget=budget, fields={"pace_loops": pace})
            out[name].append(t)
            print(f"  {name:<8} changed {str(t['graph_changed']):<5} edges {t['pacing_edges']:>3}  "
                  f"step peaks (MiB) {' '.join(mib(p) for p in t['step_peaks'])}", flush=True)
    out["over_budget"] = {name: sum(max(t["step_peaks"]) > budget for t in out[name])
                          for name in ("paced", "unpaced")}
    print(f"processes with a step over the budget: paced {out['over_budget']['paced']}, "
          f"unpaced {out['over_budget']['unpaced']} (of {args.processes} each)")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
