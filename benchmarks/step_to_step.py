"""What a planned step holds, step after step: the allocator's bytes in use after each
step and its peak during it, next to the pass's prediction.

A plan is made once, but the step runs many times, and each run starts from what the
previous one left in TF's allocator. A step that copies a variable before updating it
(copy-on-write, docs/allocator.md#variable-copies) leaves the variable in another
chunk each time, so the bytes in use between steps, and the peaks, move. This script
shows whether they do.

The pass plans as if the device had --cap-mb MiB (it reads TF_CPU_BFC_MEM_LIMIT_IN_MB
when it plans); TF's allocator keeps a 16 GiB limit, so a step that would run out of
memory under the cap still runs to its full peak.

Usage: python benchmarks/step_to_step.py MODEL [--batch N] [--cap-mb 1024] [--steps 8] [--off]
MODEL: a name of models.MODELS or a function of benchmarks/models.py. --off: without
tfmemopt. The last line of stdout is one JSON object: {"in_use": [...], "peaks": [...],
"predicted": bytes or null, "fits": bool or null}.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2.0**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, help="the model's batch size (default: its own)")
    parser.add_argument("--cap-mb", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--off", action="store_true", help="without tfmemopt")
    args = parser.parse_args()

    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = "16384"
    sys.path.insert(0, HERE)
    import tensorflow as tf
    import tfmemopt
    import models

    try:
        build = models.builder(args.model)
    except ValueError as err:
        parser.error(str(err))
    if not args.off:
        tfmemopt.enable(log_level=1)
    step, step_args = build(**({"batch": args.batch} if args.batch else {}))
    tf.constant(0.0) + 1.0  # TF's allocator now exists, with its own limit
    os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(args.cap_mb)
    in_use, peaks = [], []
    for i in range(args.steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        step(*step_args)
        info = tf.config.experimental.get_memory_info("CPU:0")
        in_use.append(info["current"])
        peaks.append(info["peak"])
        print(f"step {i}: in use after {info['current'] / MIB:.1f} MiB, peak "
              f"{info['peak'] / MIB:.1f} MiB", flush=True)
    predicted = fits = None
    reports = tfmemopt.reports()
    if reports and not args.off:
        report = max(reports, key=lambda r: r.num_nodes)
        predicted = report.predicted_peak_bytes["after"]["CPU:0"]
        fits = report.fits
        print(f"predicted peak {predicted / MIB:.1f} MiB (fits: {fits}); measured "
              f"{min(peaks[1:] or peaks) / MIB:.1f} to {max(peaks[1:] or peaks) / MIB:.1f} MiB "
              f"after the first step")
    print(json.dumps({"in_use": in_use, "peaks": peaks, "predicted": predicted, "fits": fits}))


if __name__ == "__main__":
    main()
