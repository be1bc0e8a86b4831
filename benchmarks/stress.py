"""Stress the pass with random training graphs (tests/generated_graphs.py).

    python benchmarks/stress.py --cases 1000 [--seed S] [--json]
    python benchmarks/stress.py --replay-seed K      # one case again, in this process

Case i is `random_spec(S * 1_000_003 + i)`; then --split-cases more (default a fifth
of --cases), split case i `random_split_spec(S * 1_000_003 + i)`: the same model with a
batch and a budget that make the pass split work along the batch. Cases run in a worker process (one
inter-op thread, so TF itself is deterministic), restarted every 60 cases; a case
that kills or hangs its worker counts as a crash and the run goes on. Each failure
prints its seed, what went wrong and the spec (a reproducer) on stderr; with --json
the last line of stdout is
{"cases": N, "mismatches": N, "invalid_graphs": N, "crashes": N, ...}
with, after those four, how many of the crashes happened while training without the
pass (TF itself: the worker reports the phase it is in), the cases that violated
another property (stateful clone, orphan clone, second pass not idempotent, a 'fits'
claim above the budget), that fell back, that the generator got wrong, that the
pass rewrote, and in which it split work along the batch (split_through_batch_statistics:
of those, the ones split through a gradient of batch statistics, docs/split.md; their first losses are
compared bit for bit; the rest, if not bitwise equal, against a float64 run of the same
model without the pass: each at most generated_graphs.SPLIT_ERROR_FACTOR times as far
from it as the float32 run without the pass, counting that at least one float32
epsilon of the result; that float64 run adds about one training run to such a case).
"""

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import generated_graphs as gg  # noqa: E402

OUTCOME_KEYS = {"mismatch": "mismatches", "invalid_graph": "invalid_graphs",
                "crash": "crashes", "violation": "violations", "fallback": "fallbacks",
                "generator_error": "generator_errors", "error": "errors"}


def case_seed(seed, i):
    return seed * 1_000_003 + i


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    parser.add_argument("--split-cases", type=int,
                        help="cases drawn to make the pass split work along the batch "
                             "(generated_graphs.random_split_spec), run after the others; "
                             "default: a fifth of --cases")
    parser.add_argument("--replay-seed", type=int, help="run the case of this seed here")
    parser.add_argument("--replay-split-seed", type=int,
                        help="run the split case of this seed here")
    args = parser.parse_args(argv)

    if args.replay_seed is not None or args.replay_split_seed is not None:
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(1)
        spec = (gg.random_spec(args.replay_seed) if args.replay_seed is not None
                else gg.random_split_spec(args.replay_split_seed))
        print(json.dumps(spec))
        print(json.dumps(gg.run_case(spec), indent=1, default=str))
        return 0

    counts = collections.Counter()
    worker = gg.Worker()
    start = time.time()
    split_cases = args.cases // 5 if args.split_cases is None else args.split_cases
    cases = [(i, False) for i in range(args.cases)] + [(i, True) for i in range(split_cases)]
    try:
        for n, (i, split_case) in enumerate(cases):
            seed = case_seed(args.seed, i)
            spec = gg.random_split_spec(seed) if split_case else gg.random_spec(seed)
            try:
                result = worker.run(spec, timeout=args.timeout)
            except gg.WorkerDied as err:
                result = {"outcome": "crash", "problems": [str(err)], "rewritten": False}
                # TF itself died while training without the pass (e.g. seed 268).
                counts["crashes_without_tfmemopt"] += err.phase == "baseline"
            counts["cases"] += 1
            counts["split_cases"] += split_case
            counts["rewritten"] += bool(result.get("rewritten"))
            counts["split"] += bool(result.get("split"))
            counts["split_through_batch_statistics"] += bool(
                result.get("split_through_batch_statistics"))
            # TF did not repeat a step of this case (generated_graphs.REPEAT_ERROR_FACTOR).
            counts["tf_not_repeatable"] += "tf_not_repeatable" in result.get("details", {})
            outcome = result["outcome"]
            if outcome != "ok":
                counts[OUTCOME_KEYS[outcome]] += 1
                replay = "--replay-split-seed" if split_case else "--replay-seed"
                print(f"[{'split ' if split_case else ''}case {i}] {outcome}: seed {seed}\n  " +
                      "\n  ".join(p.strip() for p in result["problems"][:6]) +
                      f"\n  replay: python benchmarks/stress.py {replay} {seed}"
                      f"\n  spec: {json.dumps(spec)}", file=sys.stderr, flush=True)
            if (n + 1) % 50 == 0:
                print(f"{n + 1} cases, {time.time() - start:.0f} s: {dict(counts)}",
                      file=sys.stderr, flush=True)
    finally:
        worker.close()
    summary = {"cases": counts["cases"], "mismatches": counts["mismatches"],
               "invalid_graphs": counts["invalid_graphs"], "crashes": counts["crashes"]}
    for key in ("crashes_without_tfmemopt", "violations", "fallbacks", "generator_errors",
                "errors", "rewritten", "split_cases", "split", "split_through_batch_statistics",
                "tf_not_repeatable"):
        summary[key] = counts[key]
    summary["seconds"] = round(time.time() - start, 1)
    text = ", ".join(f"{k} {v}" for k, v in summary.items())
    print(f"stress: {text}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    failed = sum(summary[k] for k in summary
                 if k not in ("cases", "rewritten", "split_cases", "split", "seconds",
                              "split_through_batch_statistics", "crashes_without_tfmemopt",
                              "tf_not_repeatable"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
