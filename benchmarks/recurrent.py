"""Largest batch of a recurrent model that trains under a memory cap, with and without
tfmemopt (issue 19).

Models (benchmarks/models.py, recurrent block): two stacked LSTM or GRU layers of
--units over --steps time steps of --features features, dense 10, Adam, trained
with a GradientTape step on the CPU test bed (TF_CPU_ALLOCATOR_USE_BFC, capped at
--cap-mb).

Near its limit a recurrent model trains in one process and runs out of memory in the
next: the executor runs a loop's iterations ahead of each other as far as its
threads' timing allows, and BFC's fragmentation follows, so the same graph peaks a
few percent differently from process to process (measured: the stacked LSTM at
batch 300 under 768 MiB ran out of memory in 3 of 5 processes without tfmemopt).
A single trial per size, as tfmemopt.maxbatch's search makes, then compares two
draws of a coin. Here a size counts as training only if --repeats fresh processes
all train it (--steps-per-trial steps each); the search grows from --lo by doubling
until a size fails, then bisects. Every trial is listed in the output.

Then, unless --no-equality: both configurations train --check-steps steps at
--check-batch in one process (uncapped), and the losses and weights are compared bit
for bit; with tfmemopt, the budget is half the predicted peak, so that the plan acts.
Then both are timed at the baseline's largest batch, interleaved
(tfmemopt.maxbatch.time_interleaved), or at 97, 94 or 90 % of it if either runs out
of memory there (a timing runs more steps than a trial).

Usage: python benchmarks/recurrent.py [--model stacked_gru|stacked_lstm] [--steps 200]
           [--units 256] [--features 64] [--cap-mb 768] [--lo 64] [--hi 4096]
           [--repeats 3] [--rounds 6] [--json] [--quick]
--json prints one JSON object as the last line of stdout: {"model", "settings",
"max_batch_baseline", "max_batch_tfmemopt", "ratio", "trials": {config: [...]},
"equal", "losses", "overhead_at_baseline_max", "timed_at", "timing_attempts",
"step_seconds", "timing_status"}.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tfmemopt.maxbatch import run_trial, time_interleaved  # noqa: E402

DEFAULTS = dict(model="stacked_gru", steps=200, units=256, features=64, cap_mb=768, lo=64,
                hi=4096, repeats=3, steps_per_trial=2, rounds=6, check_batch=64,
                check_steps=3)
# --quick: a small model, one process per size, for tests.
QUICK = dict(model="stacked_lstm", steps=20, units=32, features=8, cap_mb=16, lo=64, hi=2048,
             repeats=1, steps_per_trial=2, rounds=2, check_batch=16, check_steps=3)

_EQUALITY = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import tensorflow as tf
import tfmemopt
import models
spec = json.loads(sys.argv[2])

def train(use):
    if use:
        # A budget of half the predicted peak, so that the plan must move the loops' lists.
        step, (x, y) = models.RECURRENT_MODELS[spec["model"]](batch=spec["batch"], **spec["kwargs"])
        peak = tfmemopt.analyze(step, x, y, mode="ANALYZE_ONLY").predicted_peak_bytes["before"]["CPU:0"]
        tfmemopt.enable(budget=int(0.5 * peak), min_tensor_bytes=4096, log_level=0)
    else:
        tfmemopt.disable()
    step, (x, y) = models.RECURRENT_MODELS[spec["model"]](batch=spec["batch"], **spec["kwargs"])
    losses = [float(step(x, y).numpy()) for _ in range(spec["steps"])]
    weights = [v.numpy() for v in step.get_concrete_function(x, y).variables]
    return losses, weights

base_losses, base_weights = train(False)
losses, weights = train(True)
report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")][-1]
# Two models of the same architecture: their variables, in the order each step
# captured them; compared as a multiset of (shape, bytes).
key = lambda ws: sorted((w.shape, w.tobytes()) for w in ws)
print("EQUALITY " + json.dumps({
    "base_losses": base_losses, "losses": losses,
    "equal": base_losses == losses and key(base_weights) == key(weights),
    "graph_changed": report.graph_changed,
    "lists_swapped": sum(l["swapped"] for loop in report.to_dict().get("loops", []) for l in loop["lists"]),
}))
'''


def trains(ref, size, settings, fields, log):
    """True if `repeats` fresh processes all train `size` (stops at the first that
    does not). Appends every trial to `log`."""
    for _ in range(settings["repeats"]):
        trial = run_trial(ref, size, cap_mb=settings["cap_mb"], steps=settings["steps_per_trial"],
                          use_tfmemopt=fields is not None,
                          step_kwargs=step_kwargs(settings), **(fields or {}))
        log.append({"size": size, "status": trial.status,
                    "peak_mib": round(trial.peak_bytes / 2**20, 1) if trial.peak_bytes else None,
                    "error": trial.error[-300:] if trial.status not in ("ok", "oom") else ""})
        print(f"  {size}: {trial.status}"
              + (f" (peak {trial.peak_bytes / 2**20:.1f} MiB)" if trial.peak_bytes else ""),
              flush=True)
        if trial.status not in ("ok", "oom"):
            raise RuntimeError(f"trial at {size} failed: {trial.status}: {trial.error[-500:]}")
        if trial.status != "ok":
            return False
    return True


def largest(ref, settings, fields, log):
    """Grows from lo by doubling, then bisects; None if lo does not train."""
    lo, hi = settings["lo"], settings["hi"]
    if not trains(ref, lo, settings, fields, log):
        return None
    good, bad, size = lo, None, lo
    while bad is None and size < hi:
        size = min(2 * size, hi)
        if trains(ref, size, settings, fields, log):
            good = size
        else:
            bad = size
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if trains(ref, mid, settings, fields, log):
            good = mid
        else:
            bad = mid
    return good


def step_kwargs(settings):
    return {"steps": settings["steps"], "units": settings["units"],
            "features": settings["features"]}


def equality(settings):
    """Trains check_steps steps without and with tfmemopt in one process."""
    spec = {"model": settings["model"], "batch": settings["check_batch"],
            "steps": settings["check_steps"], "kwargs": step_kwargs(settings)}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB="16384")
    proc = subprocess.run([sys.executable, "-c", _EQUALITY, HERE, json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("EQUALITY "):
            return json.loads(line[len("EQUALITY "):])
    raise RuntimeError(f"equality check failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["stacked_gru", "stacked_lstm"])
    for name in ("steps", "units", "features", "cap_mb", "lo", "hi", "repeats",
                 "steps_per_trial", "rounds", "check_batch", "check_steps"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    parser.add_argument("--no-equality", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help=f"a tiny configuration: {QUICK}")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else DEFAULTS)
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    ref = f"{os.path.join(HERE, 'models.py')}:{settings['model']}"

    print(f"recurrent: {settings['model']}, {settings['steps']} steps x {settings['features']} "
          f"features, {settings['units']} units, cap {settings['cap_mb']} MiB; a size trains if "
          f"{settings['repeats']} processes all train it", flush=True)
    trials, results = {}, {}
    for name, fields in (("baseline", None), ("tfmemopt", {})):
        print(f"{name}:", flush=True)
        trials[name] = []
        results[name] = largest(ref, settings, fields, trials[name])
        print(f"largest batch {name}: {results[name]}", flush=True)
    base, mine = results["baseline"], results["tfmemopt"]
    settings["max_batch_baseline"] = base
    ratio = mine / base if base and mine else None
    if ratio is not None:
        print(f"ratio: {ratio:.2f}x", flush=True)

    check = None
    if not args.no_equality:
        check = equality(settings)
        print(f"after {settings['check_steps']} steps at batch {settings['check_batch']}: losses "
              f"and weights {'bitwise equal' if check['equal'] else 'DIFFER'} "
              f"({check['lists_swapped']} loop lists swapped)", flush=True)

    # Timed at the baseline's largest batch; a timing runs more steps than a trial,
    # and at its limit either configuration may run out of memory in one process and
    # not the next, so smaller batches are tried after a failure (every attempt is
    # listed).
    overhead, timing, timed_at, attempts = None, {}, None, []
    for size in sorted({base, int(0.97 * base), int(0.94 * base), int(0.9 * base)},
                       reverse=True) if base else []:
        timing = time_interleaved(ref, size, {"baseline": {"fields": None}, "tfmemopt": {"fields": {}}},
                                  cap_mb=settings["cap_mb"], rounds=settings["rounds"],
                                  step_kwargs=step_kwargs(settings), progress=False)
        attempts.append({"size": size, **{n: t.status for n, t in timing.items()}})
        t0, t1 = timing["baseline"].median_seconds, timing["tfmemopt"].median_seconds
        if t0 and t1:
            timed_at, overhead = size, t1 / t0 - 1
            print(f"step time at batch {size}: baseline {t0:.3f} s, tfmemopt {t1:.3f} s "
                  f"({overhead * 100:+.1f} %)", flush=True)
            break
        print(f"timing at batch {size}: baseline {timing['baseline'].status}, tfmemopt "
              f"{timing['tfmemopt'].status}", flush=True)
    if args.json:
        print(json.dumps({
            "model": settings["model"], "settings": settings,
            "max_batch_baseline": base, "max_batch_tfmemopt": mine, "ratio": ratio,
            "trials": trials, "equal": check["equal"] if check else None,
            "losses": check, "overhead_at_baseline_max": overhead, "timed_at": timed_at,
            "timing_attempts": attempts,
            "step_seconds": {n: t.median_seconds for n, t in timing.items()},
            "timing_status": {n: t.status for n, t in timing.items()},
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
