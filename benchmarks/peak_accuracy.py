"""Predicted vs measured peak memory of training steps, per benchmark model,
unplanned and planned.

Each model trains in its own interpreter on TF's BFC CPU allocator
(TF_CPU_ALLOCATOR_USE_BFC=true). Two measurements per model:

  * unplanned: the pass in ANALYZE_ONLY mode; the prediction is the report's peak;
  * planned: the pass plans (every field at its default) under a budget of
    --budget-ratio (default 0.6) times the unplanned measured peak; the prediction
    is the report's predicted peak after the plan.

The report read is the one of the largest graph the pass saw (the train step).

What is measured is the peak a training run reaches: the allocator's peak over
--steps steps (default 5) after --warmup steps (default 2), each step's peak read
after a reset_memory_stats, so graph building and the first steps' one-off
allocations are excluded. A single step is not representative: the executor's
order and the allocator's fragmentation move the peak from step to step, and
between processes (the order of a node's out edges is arbitrary in TF, so one
process may run the same graph in another order than the next). The benchmark
therefore trains each model in --runs processes (default 5) and reports the
median of their peaks as "measured", with the lowest and highest beside it.

Models whose peak TF's default threads leave unpredictable (APART: their
measured peak moves by more than the acceptance margin from step to step) are
measured with default threads and with one inter-op thread, and reported apart:
they do not count in max_abs_error.

A plain step whose peak is set per process (its --runs processes' peaks spread wider
than --margin allows one prediction: highest / lowest > (1 + margin) / (1 - margin))
has no single figure to predict. Its unplanned row is then reported with its groups
of processes (from the lowest peak up, each as wide as one prediction can cover),
the prediction's error against each group's median beside the overall one, and it does
not count in max_abs_error_unplanned; its planned row still counts, since a plan
pins the executor's order where the sampled orders differ (docs/accuracy.md).

Usage: python benchmarks/peak_accuracy.py [--models NAME ...] [--inter-op N]
           [--budget-ratio R] [--no-planned] [--warmup N] [--steps N] [--runs N]
           [--reserve-memory] [--json]
With --json, the last line of stdout is one JSON object:
{"models": {name: {"unplanned": M, "planned": M}}, "apart": {name: {"default":
{"unplanned": M, "planned": M}, "inter_op_1": {...}}}, "max_abs_error",
"max_abs_error_unplanned", "max_abs_error_planned", "set_per_process": {name:
{"predicted", "groups": [[bytes, ...], [...]], "medians", "errors"}}, "margin",
"inter_op", ...}, where each
M is {"predicted", "measured", "error", "runs", "step_peaks", "in_use_before"
(bytes in use before the first step, per run), "budget", "fits",
"nodes"}.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# Models that need one inter-op thread to be predictable (see the docstring).
APART = ("lstm",)

_TRIAL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
inter_op = int(sys.argv[3])
if inter_op:
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
import tfmemopt
from models import MODELS
tf.keras.utils.set_random_seed(0)
budget, reserve = int(sys.argv[6]), sys.argv[8] == "1"
if budget:
    tfmemopt.enable(budget=budget, log_level=0, reserve_memory=reserve, **json.loads(sys.argv[7]))
else:
    tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0, reserve_memory=reserve,
                    **json.loads(sys.argv[7]))
step, args = MODELS[sys.argv[2]]()
# What the model, its data and its variables hold before the first step (it tells
# whether TF copied the caller's NumPy-made inputs into its allocator: docs/allocator.md).
in_use_before = tf.config.experimental.get_memory_info("CPU:0")["current"]
for _ in range(int(sys.argv[4])):
    step(*args)
step_peaks = []
for _ in range(int(sys.argv[5])):
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(*args)
    step_peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)  # the train step
if report.status != "ok":
    sys.exit(f"the pass fell back in stage {report.failed_stage}: {report.message}")
print("TRIAL " + json.dumps({
    "predicted": report.predicted_peak_bytes["after"]["CPU:0"],
    "predicted_before": report.predicted_peak_bytes["before"]["CPU:0"],
    "measured": max(step_peaks),
    "step_peaks": step_peaks,
    "in_use_before": in_use_before,
    "nodes": report.num_nodes,
    "fits": report.fits,
    "graph_changed": report.graph_changed,
    "pacing_edges": len(report.loop_pacing.get("edges", [])),
    "unresolved": report.unresolved_tensors,
}))
"""


def run_trial(name, inter_op=0, warmup=2, steps=5, budget=0, timeout=1800, fields=None,
              reserve=False):
    """Trains `name` in a fresh interpreter; returns its predicted and measured peaks.
    budget > 0: the pass plans under that many bytes; 0: ANALYZE_ONLY; either with
    tfmemopt.enable()'s other `fields` ({} by default). reserve:
    enable(reserve_memory=True)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")
    proc = subprocess.run(
        [sys.executable, "-c", _TRIAL, HERE, name, str(inter_op), str(warmup), str(steps),
         str(budget), json.dumps(fields or {}), "1" if reserve else "0"],
        capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("TRIAL "):
            return json.loads(line[len("TRIAL "):])
    raise RuntimeError(f"{name}: trial failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def run_model(name, inter_op=0, warmup=2, steps=5, runs=3, budget=0, reserve=False,
              fields=None):
    """The median over `runs` processes of the peak each reaches."""
    trials = [run_trial(name, inter_op, warmup, steps, budget, fields=fields, reserve=reserve)
              for _ in range(runs)]
    measured = int(statistics.median_low(t["measured"] for t in trials))
    predicted = trials[-1]["predicted"]
    return {
        "predicted": predicted,
        "predicted_before": trials[-1]["predicted_before"],
        "measured": measured,
        "error": (predicted - measured) / measured,
        "runs": [t["measured"] for t in trials],
        "step_peaks": [t["step_peaks"] for t in trials],
        "in_use_before": [t["in_use_before"] for t in trials],
        "budget": budget,
        "fits": trials[-1]["fits"],
        "graph_changed": trials[-1]["graph_changed"],
        "nodes": trials[-1]["nodes"],
        "unresolved": trials[-1]["unresolved"],
    }


def groups_set_per_process(peaks, margin):
    """None when one prediction can be within `margin` of every process's peak; else
    the peaks (sorted) in groups, each the longest run from its lowest peak that one
    prediction can be within `margin` of (highest / lowest <= (1 + m) / (1 - m))."""
    peaks, widest = sorted(peaks), (1 + margin) / (1 - margin)
    groups = []
    for peak in peaks:
        if groups and peak <= groups[-1][0] * widest:
            groups[-1].append(peak)
        else:
            groups.append([peak])
    return groups if len(groups) > 1 else None


def measure(name, inter_op, args):
    """{"unplanned": ..., "planned": ...} for one model at one thread setting."""
    reserve = args.reserve_memory
    out = {"unplanned": run_model(name, inter_op, args.warmup, args.steps, args.runs,
                                  reserve=reserve, fields=args.fields)}
    if args.planned:
        budget = int(args.budget_ratio * out["unplanned"]["measured"])
        out["planned"] = run_model(name, inter_op, args.warmup, args.steps, args.runs, budget,
                                   reserve=reserve, fields=args.fields)
    return out


def _row(label, kind, r):
    mib = 2.0**20
    runs = " ".join(f"{m / mib:.1f}" for m in sorted(r["runs"]))
    budget = f"{r['budget'] / mib:.1f}" if r["budget"] else "-"
    return (f"{label:<22} | {kind:<9} | {budget:>7} | {r['predicted'] / mib:>9.1f} | "
            f"{r['measured'] / mib:>9.1f} | {r['error'] * 100:>+7.1f} | {runs}")


def main():
    sys.path.insert(0, HERE)
    from models import MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--inter-op", type=int, default=0,
                        help="inter_op_parallelism_threads (0 = TF's default)")
    parser.add_argument("--budget-ratio", type=float, default=0.6,
                        help="planned budget, as a fraction of the unplanned measured peak")
    parser.add_argument("--no-planned", dest="planned", action="store_false",
                        help="measure unplanned only")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    parser.add_argument("--steps", type=int, default=5, help="steps measured (peak over all)")
    parser.add_argument("--runs", type=int, default=5, help="processes per model (median)")
    parser.add_argument("--reserve-memory", action="store_true",
                        help="tfmemopt.enable(reserve_memory=True): the pool is one region")
    parser.add_argument("--fields", type=json.loads, default={},
                        help="more tfmemopt.enable() fields, as JSON (e.g. "
                             "'{\"observe_allocator\": true}')")
    parser.add_argument("--margin", type=float, default=0.08,
                        help="acceptance margin: an unplanned step whose processes' peaks "
                             "no one prediction is within this of is reported per process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results, apart, per_process = {}, {}, {}
    print(f"{'model':<22} | {'kind':<9} | {'budget':>7} | {'predicted':>9} | {'measured':>9} | "
          f"{'error %':>7} | runs (MiB)", flush=True)
    for name in args.models:
        if name in APART and not args.inter_op:
            apart[name] = {}
            for label, threads in (("default", 0), ("inter_op_1", 1)):
                apart[name][label] = measure(name, threads, args)
                for kind, r in apart[name][label].items():
                    print(_row(f"{name} ({label})", kind, r), flush=True)
            continue
        results[name] = measure(name, args.inter_op, args)
        for kind, r in results[name].items():
            print(_row(name, kind, r), flush=True)
        unplanned = results[name]["unplanned"]
        groups = groups_set_per_process(unplanned["runs"], args.margin)
        if groups:
            medians = [int(statistics.median_low(g)) for g in groups]
            per_process[name] = {
                "predicted": unplanned["predicted"], "groups": groups, "medians": medians,
                "errors": [(unplanned["predicted"] - m) / m for m in medians]}
            print(f"{name}: plain step's peak set per process: "
                  + "; ".join(f"{len(g)} at {m / 2**20:.1f} MiB ({e * 100:+.1f} %)" for g, m, e
                              in zip(groups, medians, per_process[name]["errors"]))
                  + " (unplanned not counted)", flush=True)

    def worst(kind):
        errors = [abs(r[kind]["error"]) for n, r in results.items()
                  if kind in r and not (kind == "unplanned" and n in per_process)]
        return max(errors) if errors else None

    keys = ("predicted", "predicted_before", "measured", "error", "runs", "step_peaks",
            "in_use_before", "budget", "fits", "graph_changed", "nodes")
    slim = lambda m: {kind: {k: r[k] for k in keys} for kind, r in m.items()}  # noqa: E731
    summary = {
        "models": {n: slim(m) for n, m in results.items()},
        "apart": {n: {label: slim(m) for label, m in by.items()} for n, by in apart.items()},
        "max_abs_error_unplanned": worst("unplanned"),
        "max_abs_error_planned": worst("planned"),
        "set_per_process": per_process,
        "margin": args.margin,
        "inter_op": args.inter_op,
        "reserve_memory": args.reserve_memory,
        "budget_ratio": args.budget_ratio if args.planned else None,
        "warmup": args.warmup,
        "steps": args.steps,
        "runs": args.runs,
    }
    summary["max_abs_error"] = max(
        e for e in (summary["max_abs_error_unplanned"], summary["max_abs_error_planned"], 0.0)
        if e is not None)
    print(f"max_abs_error {summary['max_abs_error']:.3f} (unplanned "
          f"{summary['max_abs_error_unplanned']}, planned {summary['max_abs_error_planned']}) "
          f"over {len(results)} models; apart: {', '.join(apart) or 'none'}; unplanned peak set "
          f"per process: {', '.join(per_process) or 'none'}", flush=True)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
