"""What keeping loops in step costs: recurrent models' planned steps with and without the pace stage.

For each model (benchmarks/models.py's models with a loop), the unplanned peak is
predicted (ANALYZE_ONLY), then the step is planned at --ratio of it twice, with
`pace_loops` on (the default) and off, and both are timed in turn
(tfmemopt.maxbatch.time_interleaved: one interpreter per configuration on TF's BFC
CPU allocator capped at --cap-mb, --rounds rounds of --steps-per-round steps each, after a warm-up).
Printed per model: the median step time of each, their ratio (the overhead of pacing)
and the highest BFC peak each process saw, against the plan's prediction.

Usage: python benchmarks/loop_pacing.py [--models lstm stacked_lstm stacked_gru]
           [--ratio 0.5] [--rounds 6] [--steps-per-round 2] [--cap-mb 4096] [--json]
--json prints one JSON object as the last line of stdout: {"ratio", "models": {name:
{"budget_bytes", "predicted_bytes", "paced": Timing, "unpaced": Timing, "overhead"}},
(a Timing's dict without the report, with "graph_changed" and "pacing_edges")
"max_overhead"}.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CONFIGS = {"paced": {}, "unpaced": {"pace_loops": False}}
# benchmarks/models.py's models with a loop: "lstm" is one small LSTM layer.
RECURRENT = ("lstm", "stacked_lstm", "stacked_gru")


def _predicted(make_step, ratio):
    """(the unplanned predicted peak, the plan's predicted peak at `ratio` of it)."""
    import tfmemopt

    step, args = make_step()
    before = tfmemopt.analyze(step, *args, mode="ANALYZE_ONLY").predicted_peak_bytes
    before = max(before["before"].values())
    step, args = make_step()
    after = tfmemopt.analyze(step, *args, budget=int(ratio * before)).predicted_peak_bytes
    return before, max(after["after"].values())


def _brief(timing):
    """A Timing without the pass's full report: its status and pacing edges only."""
    out = timing.to_dict()
    report = out.pop("report", None) or {}
    out["graph_changed"] = report.get("graph_changed")
    out["pacing_edges"] = len(report.get("loop_pacing", {}).get("edges", []))
    return out


def main(argv=None):
    import models
    from tfmemopt.maxbatch import time_interleaved

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(RECURRENT), choices=RECURRENT)
    parser.add_argument("--ratio", type=float, default=0.5,
                        help="budget as a fraction of the unplanned predicted peak")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cap-mb", type=int, default=4096,
                        help="TF's BFC CPU allocator's limit (high: nothing runs out)")
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio {args.ratio}: allowed 0 < ratio <= 1")

    out = {"ratio": args.ratio, "models": {}}
    for name in args.models:
        make_step = models.MODELS[name]
        before, predicted = _predicted(make_step, args.ratio)
        budget = int(args.ratio * before)
        configs = {label: {"fields": {"budget_bytes": budget, **fields}}
                   for label, fields in CONFIGS.items()}
        batch = make_step.__defaults__[0]
        timings = time_interleaved(make_step, batch, configs, cap_mb=args.cap_mb,
                                   rounds=args.rounds,
                                   steps_per_round=args.steps_per_round, progress=False)
        paced, unpaced = timings["paced"], timings["unpaced"]
        overhead = (paced.median_seconds / unpaced.median_seconds - 1
                    if paced.median_seconds and unpaced.median_seconds else None)
        out["models"][name] = {"budget_bytes": budget, "predicted_bytes": predicted,
                               "paced": _brief(paced), "unpaced": _brief(unpaced),
                               "overhead": overhead}
        mib = 2.0 ** 20
        for label, timing in timings.items():
            if timing.median_seconds is None:
                print(f"{name} {label}: {timing.status}: {timing.error[:300]}", flush=True)
                continue
            peak = timing.peak_bytes
            print(f"{name} {label}: {timing.median_seconds:.3f} s/step, peak "
                  f"{peak / mib:.1f} MiB ({(peak / predicted - 1) * 100:+.1f} % from the "
                  f"predicted {predicted / mib:.1f} MiB)", flush=True)
        if overhead is not None:
            print(f"{name}: pacing {overhead * 100:+.1f} % step time", flush=True)
    overheads = [m["overhead"] for m in out["models"].values() if m["overhead"] is not None]
    out["max_overhead"] = max(overheads) if overheads else None
    if args.json:
        print(json.dumps(out))
    return 0 if len(overheads) == len(args.models) else 1


if __name__ == "__main__":
    sys.exit(main())
