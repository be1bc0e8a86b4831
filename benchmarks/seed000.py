"""The seed-000 table on the CPU test bed: largest batch per memory optimizer (issue 6).

The seed CNN (conv32-conv64-maxpool-fc128-fc10 on 28x28x1, Adam;
tfmemopt.demo.seed_cnn_train_step) under a capped CPU allocator (1024 MiB by
default). For each of TF's built-in Grappler memory_optimization levels, and for
tfmemopt with its defaults (TFMEMOPT: memory_optimization left at TF's default), the
largest batch that trains is searched by bisection, one subprocess per trial
(tfmemopt.maxbatch). Then TFMEMOPT and NO_MEM_OPT are timed at NO_MEM_OPT's largest
batch in the same run, taking turns step by step:
overhead_at_baseline_max = t_TFMEMOPT / t_NO_MEM_OPT - 1 (medians).

How the level reaches Grappler: each trial sets RewriterConfig.memory_optimization in
the eager context's base config (tfmemopt._eager_context, the config that tf.function
calls hand to Grappler; tf.config.optimizer.set_experimental_options has no key for
it). Two checks per trial, printed in the "Grappler" column:
  1. the config the trial's tf.function calls carry is read back after training
     (Trial.rewrite_options): its memory_optimization must be the level asked for
     (TFMEMOPT: DEFAULT_MEM_OPT, with TfMemOpt among the custom optimizers);
  2. TF's meta-optimizer log (TF_CPP_VMODULE=meta_optimizer=1) for the train-step
     graph must list memory_optimizer for every level but NO_MEM_OPT, and TfMemOpt
     for TFMEMOPT. The log also tells what memory_optimizer did to the graph
     ("Graph size after: N nodes (change), M edges (change)").

Usage: python benchmarks/seed000.py [--cap-mb 1024] [--lo 256] [--hi 16384]
           [--options NAME ...] [--json] [--quick]
--json prints one JSON object as the last line of stdout:
{"max_batch": {option: int, ..., "TFMEMOPT": int}, "floor_batch": int,
 "floor_batch_split": int,
 "overhead_at_baseline_max": float, ...}.
"""

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402
from tfmemopt.maxbatch import compare, table  # noqa: E402

BUILT_IN = ("NO_MEM_OPT", "DEFAULT_MEM_OPT", "SWAPPING_HEURISTICS",
            "RECOMPUTATION_HEURISTICS", "SCHEDULING_HEURISTICS", "HEURISTICS")
OPTIONS = BUILT_IN + ("TFMEMOPT",)
BASELINE = "NO_MEM_OPT"
# --hi reaches past 2.5 x NO_MEM_OPT's 1820: splitting (issue 18) goes beyond the
# largest op's working set.
DEFAULTS = dict(cap_mb=1024, lo=256, hi=16384, steps=2, rounds=10, options=list(OPTIONS))
# --quick: two options, one trial each and two timed steps, so that a test can run it fast.
QUICK = dict(cap_mb=256, lo=64, hi=64, steps=2, rounds=2, options=[BASELINE, "TFMEMOPT"])
_STEP_GRAPH = "__inference_train_step"
_SIZE_CHANGE = re.compile(r"Graph size after: \d+ nodes \((-?\d+)\), \d+ edges \((-?\d+)\)")


def config(option):
    """find_max_batch / time_interleaved keywords of an option."""
    if option == "TFMEMOPT":
        return {"fields": {}, "memory_optimization": None}
    return {"fields": None, "memory_optimization": option}


def grappler_check(option, trial):
    """(passed, what was seen) for one trial: see the module docstring."""
    rewrite = trial.rewrite_options or {}
    want_level = "DEFAULT_MEM_OPT" if option == "TFMEMOPT" else option
    problems = []
    if rewrite.get("memory_optimization") != want_level:
        problems.append(f"call config has memory_optimization="
                        f"{rewrite.get('memory_optimization')}, not {want_level}")
    has_pass = "TfMemOpt" in rewrite.get("custom_optimizers", [])
    if has_pass != (option == "TFMEMOPT"):
        problems.append(f"TfMemOpt {'is' if has_pass else 'is not'} in the call config")
    steps = [runs for graph, runs in (trial.grappler or {}).items()
             if graph.startswith(_STEP_GRAPH)]
    if not steps:
        return False, "no meta-optimizer log for the train step graph"
    names = [line.split(":", 1)[0] for line in steps[0]]
    memory = [line for line in steps[0] if line.startswith("memory_optimizer:")]
    if bool(memory) != (option != "NO_MEM_OPT"):
        problems.append(f"memory_optimizer {'ran' if memory else 'did not run'}")
    if ("TfMemOpt" in names) != (option == "TFMEMOPT"):
        problems.append(f"TfMemOpt {'ran' if 'TfMemOpt' in names else 'did not run'}")
    if memory:
        changes = [_SIZE_CHANGE.search(line) for line in memory]
        nodes = sum(int(m.group(1)) for m in changes if m)
        edges = sum(int(m.group(2)) for m in changes if m)
        seen = f"memory_optimizer ran ({nodes:+d} nodes, {edges:+d} edges)"
    else:
        seen = "memory_optimizer off"
    if "TfMemOpt" in names:
        seen += ", TfMemOpt ran"
    return not problems, seen + ("" if not problems else "; MISMATCH: " + "; ".join(problems))


def floor_batch(cap_mb, batches=(256, 512), max_slices=64):
    """Two floors, from the pass's analysis of the seed CNN's train step
    (tfmemopt.analyze, nothing runs; both terms are linear in the batch, so two
    batches give them):
      * floor_batch, for plans that keep ops whole: the largest batch at which
        persistent memory plus the biggest single op's working set (its distinct
        inputs, outputs and scratch, as the pass's simulator sees them) fits the cap;
      * floor_batch_split, for plans that split per-sample work along the batch
        (issue 18): what stays at full batch is the step's inputs (the caller holds
        them), and each op's working set shrinks with the number of slices, at most
        `max_slices` (the planner's limit): the largest batch at which persistent
        memory plus the inputs plus the biggest working set / max_slices fits.
    Returns (floor, floor_split, details).
    """
    import tfmemopt

    points = []
    for batch in batches:
        step, (x, y) = models.seed_cnn(batch)
        report = tfmemopt.analyze(step, x, y, mode="ANALYZE_ONLY")
        device = report.devices[0]
        points.append((batch, report.persistent_bytes[device],
                       report.max_op_working_set_bytes[device],
                       report.to_dict()["devices"][0]["max_op_working_set_op"],
                       x.numpy().nbytes + y.numpy().nbytes))
    (b0, p0, w0, op, i0), (b1, _, w1, _, i1) = points
    per_sample = (w1 - w0) / (b1 - b0)
    fixed = w0 - per_sample * b0
    floor = int((cap_mb * 2**20 - p0 - fixed) // per_sample)
    inputs_per_sample = (i1 - i0) / (b1 - b0)
    split_per_sample = inputs_per_sample + per_sample / max_slices
    floor_split = int((cap_mb * 2**20 - p0 - fixed) // split_per_sample)
    return floor, floor_split, {
        "op": op, "persistent_bytes": p0, "working_set_bytes_per_sample": per_sample,
        "working_set_fixed_bytes": fixed, "input_bytes_per_sample": inputs_per_sample,
        "max_slices": max_slices}


def main():
    args, settings = models.benchmark_settings(
        __doc__.splitlines()[0], DEFAULTS, QUICK,
        {"lo": "smallest batch searched", "hi": "largest batch searched"},
        extra=lambda parser: parser.add_argument(
            "--options", nargs="+", choices=OPTIONS,
            help=f"options to search (default all; {BASELINE} is always included)"))
    options = [o for o in OPTIONS if o in settings["options"] or o == BASELINE]
    settings["options"] = options
    cap_mb = settings["cap_mb"]

    print(f"seed000: seed CNN, cap {cap_mb} MiB, batches {settings['lo']}..{settings['hi']} "
          f"(bisection), {settings['steps']} steps per trial", flush=True)
    comparison = compare(
        models.seed_cnn, settings["lo"], settings["hi"], {o: config(o) for o in options},
        BASELINE, cap_mb=cap_mb, steps=settings["steps"], rounds=settings["rounds"],
        grappler_log=True, timed=["TFMEMOPT"] if "TFMEMOPT" in options else [])
    results = comparison.searches
    checks = {}
    for option, result in results.items():
        # Trials that trained ran Grappler for sure (an OOM in make_step would not).
        verdicts = [grappler_check(option, t) for t in result.trials if t.ok]
        if verdicts:
            checks[option] = {"passed": all(ok for ok, _ in verdicts), "seen": verdicts[0][1],
                              "trials_checked": len(verdicts)}

    print("\n" + table(results))
    print(f"\n{'option':<25} | {'max batch':>9} | {'smallest OOM':>12} | {'trials':>6} | "
          f"Grappler (checked in every trial that trained)")
    for option, result in results.items():
        check = checks.get(option)
        verdict = (("ok: " if check["passed"] else "FAILED: ") + check["seen"]) if check else "-"
        print(f"{option:<25} | {str(result.max_batch):>9} | {str(result.min_failing_batch):>12} | "
              f"{len(result.trials):>6} | {verdict}")
    if comparison.timing:
        print("\n" + comparison.timing_text())
    overhead = comparison.overhead.get("TFMEMOPT")
    floor, floor_split, floor_details = floor_batch(cap_mb)
    print(f"\nfloor_batch: {floor} (persistent {floor_details['persistent_bytes'] / 2**20:.1f} MiB + "
          f"{floor_details['working_set_bytes_per_sample'] / 2**20:.3f} MiB per sample for "
          f"{floor_details['op']}: no plan that keeps ops whole beats it)")
    print(f"floor_batch_split: {floor_split} (the inputs, "
          f"{floor_details['input_bytes_per_sample'] / 2**10:.2f} KiB per sample, stay whole; "
          f"{floor_details['op']}'s working set split {floor_details['max_slices']} ways: no "
          f"plan that splits into at most {floor_details['max_slices']} slices beats it)")
    if overhead is not None:
        print(f"overhead of TFMEMOPT at batch {comparison.size}: {overhead * 100:+.1f} %")
    for option, result in results.items():
        if result.max_batch is not None and result.min_failing_batch is None:
            print(f"{option}: batch {settings['hi']} trains: the limit is above --hi")
    if comparison.error:
        print(f"search stopped: {comparison.error}")
    if args.json:
        print(json.dumps({
            "max_batch": comparison.max_sizes(),
            "floor_batch": floor,
            "floor_batch_split": floor_split,
            "floor_details": floor_details,
            "overhead_at_baseline_max": overhead,
            "grappler_check": checks,
            "settings": settings,
            **comparison.brief(),
        }))
    failed_check = any(not c["passed"] for c in checks.values())
    return 1 if comparison.error or failed_check else 0


if __name__ == "__main__":
    sys.exit(main())
