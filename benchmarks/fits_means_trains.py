"""Does "fits" mean it trains? Every claim of the report checked by a real run.

For each model of benchmarks/peak_accuracy.py (benchmarks/models.py), or with
--unseen of benchmarks/unseen_models.py (Keras applications and layer mixes the pass
was not tuned for, each trained by tfmemopt.demo.keras_train_step), under a memory
cap (TF's BFC CPU allocator limited to --cap-mb, or the model's own cap below):

  1. the unplanned limit: the largest batch that trains without tfmemopt, to within
     --tolerance (doubling from the model's start size, then bisection; one interpreter per
     trial, tfmemopt.maxbatch.run_trial);
  2. from that limit upward (each size --growth times the last, at least one more),
     a trial with tfmemopt at its defaults (budget: 0.9 of the cap) until the report
     first says the budget cannot be met (report "fits" false), at most --sizes sizes.
     Every size the report says fits is a claim, and the trial runs --steps real steps.
     A trial that dies out of memory (TF sometimes crashes instead of raising when a
     oneDNN kernel runs out of memory) leaves no report: then tfmemopt.analyze plans
     the same step under the same cap without running it, and what its report says
     decides (row "analyzed"); a step it cannot analyze is listed, not counted.

A claim that runs out of memory is a failure ("fits_but_oom"). Without --retry the trials
run the plan alone (enable(function_retries=0): nothing retries the plain tf.function
step). With --retry the steps
run through tfmemopt's re-plan-on-OOM wrapper (tfmemopt.function, when the installed
tfmemopt has it); a claim that trains after a re-plan counts as "trained_after_retry"
(0 while tfmemopt has no such wrapper), and a claim whose step measured over its
budget and was re-planned lower for the steps after it counts as "calibrated" (the
wrapper's calibrator, tfmemopt.feedback.Calibrator). A claim's first attempt runs the plan exactly as
a run without the wrapper does, so "first_attempt_oom" (claims that were retried or
failed) is what a run without --retry would have counted, and "models_without_oom" the
models with claims where no first attempt ran out of memory. max_abs_error is the largest |predicted -
measured| / measured over the claims that trained, where predicted is the report's
peak after the plan and measured the highest of the steps' own allocator peaks
after the first step.

Usage: python benchmarks/fits_means_trains.py [--models NAME ...] [--unseen] [--cap-mb N]
           [--growth 1.15] [--tolerance 0.03] [--sizes 8] [--steps 3] [--retry]
           [--json]
       python benchmarks/fits_means_trains.py --merge LOG [LOG ...] [--json]
--merge combines runs over disjoint sets of models (the logs of `--json` runs, e.g.
the same command run on two machines or in two processes) into one summary.
With --json, the last line of stdout is one JSON object:
{"models", "claims", "fits_but_oom", "trained_after_retry", "calibrated", "first_attempt_oom",
 "models_without_oom", "max_abs_error",
 "failures": [{"model", "batch", "predicted", "error"}], "per_model": {...}}.
"""

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tfmemopt import Report  # noqa: E402
from results import last_json  # noqa: E402
from tfmemopt.maxbatch import TrialError, run_trial  # noqa: E402
import unseen_models  # noqa: E402

# Per model: (cap in MiB, a batch that trains under it). The caps are small, so that
# a step takes a second or less on a CPU and each model's sweep a few minutes; models
# not listed get DEFAULT.
SETTINGS = {
    "seed_cnn": (256, 128),
    "mlp": (128, 1024),
    "cifar_resnet10": (256, 32),
    "resnet50_64px": (512, 16),
    "lstm": (64, 128),
    "transformer": (384, 8),
    "unet": (128, 8),
    "mobilenet_v2": (256, 16),
    "densenet121": (256, 8),
    "efficientnet_b0": (256, 8),
    "text_cnn": (128, 16),
    "v1_session_cnn": (128, 64),
    # --unseen: a cap a few times the model's step at its start batch, as above.
    "mobilenetv3small": (128, 16),
    "efficientnetv2b0": (256, 8),
    "nasnetmobile": (256, 4),
    "resnet50v2": (512, 4),
    "inceptionv3": (512, 4),
    "xception": (512, 4),
    "vit_tiny": (128, 8),
    "conv_autoencoder": (64, 8),
    "bidirectional_gru": (64, 32),
    "embedding_attention": (64, 32),
    "gpt_mini": (128, 16),
    "seq2seq_lstm": (128, 32),
    "groupnorm_resnet": (256, 8),
    "conv3d_video": (128, 8),
}
DEFAULT = (256, 8)
# --unseen sweeps these; VGG16 and ConvNeXtTiny hold 0.5 to 1 GiB of weights and Adam
# state at any batch, too slow a sweep for a CPU (name them with --models).
UNSEEN = ["mobilenetv3small", "efficientnetv2b0", "nasnetmobile", "resnet50v2",
          "inceptionv3", "xception", "vit_tiny", "conv_autoencoder", "bidirectional_gru",
          "embedding_attention", "gpt_mini", "seq2seq_lstm", "groupnorm_resnet", "conv3d_video"]


def model_step(model, size):
    """(step, args) of `model` at batch `size`: benchmarks/models.py's, or
    benchmarks/unseen_models.py's Keras train step."""
    import models

    if model in models.MODELS:
        return models.MODELS[model](batch=size)
    return unseen_models.train_step(model, size)


def make_step(size, model, retry=False):
    """The benchmark model `model` at batch `size`, as tfmemopt.maxbatch trials run it.
    Each step returns (loss, the allocator's peak during the step), so that the trial
    records every step's own peak beside the trial's. retry: wrap the step in
    tfmemopt.function (re-plan on out-of-memory), when the installed tfmemopt has it."""
    import numpy as np
    import tensorflow as tf

    step, args = model_step(model, size)
    wrapped = None
    if retry:
        import tfmemopt

        wrap = getattr(tfmemopt, "function", None)
        inner = getattr(step, "python_function", None)
        if wrap is not None and inner is not None:
            step = wrapped = wrap(inner)

    def measured_step(*step_args):
        tf.config.experimental.reset_memory_stats("CPU:0")
        loss = step(*step_args)
        loss = float(loss.numpy() if hasattr(loss, "numpy") else loss)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        if not retry:
            return np.float64(loss), np.float64(peak)
        # With --retry, a third output: the re-plans so far (the wrapper's
        # retries_done; 0 without a wrapper); a fourth: the re-plans of steps that
        # measured over their budget without running out of memory (its calibrator).
        done = len(getattr(wrapped, "retries_done", None) or [])
        calibrated = sum(1 for c in getattr(getattr(wrapped, "calibrator", None), "done", [])
                         if not c.get("reverted"))
        return np.float64(loss), np.float64(peak), np.float64(done), np.float64(calibrated)

    return measured_step, args


def analyze_step(size, model):
    """For a trial that died before it could return its report: what tfmemopt says
    of the same step under the same cap, planned by tfmemopt.analyze without running
    it. The one "step" returns (predicted peak after the plan, 1.0 if the report says
    fits else 0.0)."""
    import numpy as np
    import tfmemopt

    step, args = model_step(model, size)
    if hasattr(step, "graph"):
        # A v1 Session step: its graph, placed as the Session places it, fetching
        # what the step runs.
        from tensorflow.core.protobuf import meta_graph_pb2
        from tfmemopt.analysis import _default_device, analyze_metagraph

        metagraph = meta_graph_pb2.MetaGraphDef()
        metagraph.graph_def.CopyFrom(step.graph.as_graph_def())
        for node in metagraph.graph_def.node:
            node.device = node.device or _default_device()
        metagraph.collection_def["train_op"].node_list.value.extend(step.fetches)
        report = analyze_metagraph(metagraph)
    else:
        report = tfmemopt.analyze(step, *args)
    devices = report.to_dict().get("devices", [])
    predicted = max((d["peak_after_bytes"] for d in devices), default=0)

    def say():
        return np.float64(predicted), np.float64(1.0 if report.fits else 0.0)

    return say, ()


def _analyzed(model, size, cap_mb):
    """(fits, predicted) for a step whose trial died, from analyze_step; (None,
    None) when the step cannot be analyzed."""
    trial = run_trial(analyze_step, size, cap_mb=cap_mb, steps=1,
                      step_kwargs={"model": model})
    if trial.status != "ok" or not trial.outputs or len(trial.outputs[0]) != 2:
        return None, None
    predicted, fits = trial.outputs[0]
    return bool(fits), int(predicted)


def _retried(report):
    """Whether the trial's report says a step was re-planned after running out of
    memory (a field of tfmemopt's feedback loop, if its report has one; the wrapper's
    own count, retries_done, is read by make_step)."""
    if not report:
        return False
    for key in ("retries", "replans", "oom_retries"):
        value = report.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return True
        if isinstance(value, list) and value:
            return True
    return False


def unplanned_limit(model, cap_mb, lo, tolerance, log):
    """The largest batch that trains without tfmemopt, to within `tolerance` (a
    fraction): doubling from lo, then bisection. Returns (limit or None, trials)."""
    kwargs = {"model": model}
    trials = []

    def trains(size):
        trial = run_trial(make_step, size, cap_mb=cap_mb, steps=2, use_tfmemopt=False,
                          step_kwargs=kwargs)
        trials.append({"batch": size, "status": trial.status})
        if trial.status not in ("ok", "oom"):
            raise TrialError(f"{model} at batch {size} without tfmemopt: {trial.status}: "
                             f"{trial.error[:300]}", trial)
        return trial.ok

    if not trains(lo):
        return None, trials
    good, bad = lo, None
    while bad is None:
        size = 2 * good
        if trains(size):
            good = size
        else:
            bad = size
    while bad - good > max(1, int(tolerance * good)):
        mid = (good + bad) // 2
        if trains(mid):
            good = mid
        else:
            bad = mid
    return good, trials


def sweep(model, cap_mb, lo, growth, max_sizes, steps, retry, log, tolerance=0.03):
    """The claims for one model: [{batch, status, fits, predicted, measured, ...}]."""
    start = time.perf_counter()
    limit, searched = unplanned_limit(model, cap_mb, lo, tolerance, log)
    out = {"cap_mb": cap_mb, "unplanned_limit": limit, "limit_trials": searched,
           "trials": [], "claims": []}
    log(f"{model}: unplanned limit {limit} under {cap_mb} MiB ({len(searched)} trials)")
    if limit is None:
        out["seconds"] = time.perf_counter() - start
        return out
    size = limit
    kwargs = {"model": model, "retry": retry}
    mib = lambda b: f"{b / 2**20:.1f}" if b else "-"  # noqa: E731
    # Without --retry, the plan alone: enable()'s own retry of a plain tf.function off.
    fields = {} if retry else {"function_retries": 0}
    for _ in range(max_sizes):
        trial = run_trial(make_step, size, cap_mb=cap_mb, steps=steps, step_kwargs=kwargs,
                          **fields)
        report = trial.report
        devices = (report or {}).get("devices", [])
        predicted = max((d["peak_after_bytes"] for d in devices), default=None)
        fits = Report(report).fits if report else None
        # Each step's own peak (the first step also builds and optimizes the graph).
        step_peaks = [o[1] for o in trial.outputs if len(o) >= 2]
        replans = max((int(o[2]) for o in trial.outputs if len(o) >= 3), default=0)
        calibrations = max((int(o[3]) for o in trial.outputs if len(o) >= 4), default=0)
        measured = max(step_peaks[1:] or step_peaks) if step_peaks else None
        analyzed = False
        if report is None and trial.status == "oom":
            # The process died inside a kernel (oneDNN crashes instead of raising),
            # before it could return the report: ask tfmemopt.analyze what the
            # report says of the same step, so that a claim is never missed.
            fits, predicted = _analyzed(model, size, cap_mb)
            analyzed = fits is not None
        row = {"batch": size, "status": trial.status, "fits": fits, "predicted": predicted,
               "measured": measured, "trial_peak": trial.peak_bytes,
               "retried": replans > 0 or _retried(report), "calibrations": calibrations,
               "analyzed": analyzed,
               "error": trial.error[:300] if trial.error else ""}
        if trial.status == "ok" and predicted and measured:
            row["rel_error"] = (predicted - measured) / measured
        out["trials"].append(row)
        said = {True: "fits", False: "does not fit", None: "no report (the trial died)"}[fits]
        if analyzed:
            said += " (tfmemopt.analyze; the trial died)"
        log(f"  batch {size}: report {said} (predicted {mib(predicted)} MiB), trial "
            f"{trial.status} (step peak {mib(measured)} MiB)")
        if trial.status not in ("ok", "oom"):
            out["stopped"] = f"batch {size}: {trial.status}: {trial.error[:300]}"
            break
        if fits is False:
            break
        if fits:
            out["claims"].append(row)
        size = max(size + 1, int(math.ceil(size * growth)))
    out["seconds"] = time.perf_counter() - start
    return out


def summarize(per_model, retry):
    """The JSON summary of the sweeps `per_model` ({model: sweep()})."""
    claims = [dict(c, model=m) for m, r in per_model.items() for c in r.get("claims", [])]
    failures = [{k: c.get(k) for k in ("model", "batch", "predicted", "error")}
                for c in claims if c["status"] == "oom"]
    errors = [abs(c["rel_error"]) for c in claims if "rel_error" in c]
    # A claim's first attempt runs the plan as it runs without the wrapper: with
    # --retry, a claim that needed a re-plan (or failed anyway) ran out of memory there.
    first_oom = {m: sum(1 for c in r.get("claims", []) if c["status"] == "oom" or c["retried"])
                 for m, r in per_model.items()}
    return {
        "models": len([m for m, r in per_model.items() if r.get("claims")]),
        "models_swept": len(per_model),
        "claims": len(claims),
        "fits_but_oom": len(failures),
        "trained_after_retry": sum(1 for c in claims if c["status"] == "ok" and c["retried"]),
        # Claims whose step measured over its budget and was re-planned lower for the
        # next steps (the wrapper's calibrator, with --retry).
        "calibrated": sum(1 for c in claims if c.get("calibrations")),
        "first_attempt_oom": sum(first_oom.values()),
        "models_without_oom": sorted(m for m, r in per_model.items()
                                     if r.get("claims") and first_oom[m] == 0),
        "max_abs_error": max(errors) if errors else None,
        "failures": failures,
        "retry": retry,
        "per_model": per_model,
    }


def report(summary, log):
    log(f"{summary['claims']} claims on {summary['models']} models: "
        f"{summary['fits_but_oom']} ran out of memory, {summary['trained_after_retry']} "
        f"trained after a retry, {summary.get('calibrated', 0)} re-planned after measuring "
        f"over their budget; max |error| {summary['max_abs_error']}")
    log(f"first attempts out of memory: {summary['first_attempt_oom']}; models with claims "
        f"and none: {len(summary['models_without_oom'])} "
        f"({', '.join(summary['models_without_oom'])})")
    for f in summary["failures"]:
        log(f"  fits but OOM: {f['model']} batch {f['batch']} (predicted "
            f"{(f['predicted'] or 0) / 2**20:.1f} MiB): {f['error']}")


def main():
    import models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+",
                        choices=list(models.MODELS) + list(unseen_models.MODELS),
                        help="default: benchmarks/models.py's (with --unseen: "
                             + ", ".join(UNSEEN) + ")")
    parser.add_argument("--unseen", action="store_true",
                        help="sweep benchmarks/unseen_models.py's models by default")
    parser.add_argument("--cap-mb", type=int, help="one cap for every model (MiB)")
    parser.add_argument("--growth", type=float, default=1.15,
                        help="each batch size tried is this times the last")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="the unplanned limit's precision (a fraction of it)")
    parser.add_argument("--sizes", type=int, default=8, help="most sizes per model")
    parser.add_argument("--steps", type=int, default=3, help="training steps per trial")
    parser.add_argument("--retry", action="store_true",
                        help="run the steps through tfmemopt's re-plan-on-OOM wrapper")
    parser.add_argument("--merge", nargs="+", metavar="LOG",
                        help="do not run: combine the runs whose --json output is in these "
                             "logs (each model in one of them) into one summary")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.growth <= 1.0:
        parser.error(f"--growth {args.growth}: allowed: a number above 1")
    if not args.models:
        args.models = UNSEEN if args.unseen else list(models.MODELS)

    def log(text):
        print(text, flush=True)

    if args.merge:
        runs = [last_json(open(path).read()) for path in args.merge]
        bad = [path for path, run in zip(args.merge, runs) if run is None]
        if bad:
            parser.error(f"--merge: no JSON summary as the last line of {', '.join(bad)}")
        swept = [m for run in runs for m in run["per_model"]]
        twice = sorted({m for m in swept if swept.count(m) > 1})
        if twice:
            parser.error(f"--merge: models swept in more than one run: {', '.join(twice)}")
        if len({r.get("retry", False) for r in runs}) > 1:
            parser.error("--merge: runs with and without --retry")
        per_model = {m: r for run in runs for m, r in run["per_model"].items()}
        summary = summarize(per_model, runs[0].get("retry", False))
        report(summary, log)
        if args.json:
            print(json.dumps(summary))
        return 1 if summary["failures"] else 0

    per_model = {}
    for name in args.models:
        cap_mb, lo = SETTINGS.get(name, DEFAULT)
        if args.cap_mb:
            cap_mb = args.cap_mb
        try:
            per_model[name] = sweep(name, cap_mb, lo, args.growth, args.sizes, args.steps,
                                    args.retry, log, args.tolerance)
        except TrialError as err:
            per_model[name] = {"cap_mb": cap_mb, "stopped": str(err)[:500], "claims": []}
            log(f"{name}: stopped: {str(err)[:300]}")
    summary = summarize(per_model, args.retry)
    report(summary, log)
    if args.json:
        print(json.dumps(summary))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
