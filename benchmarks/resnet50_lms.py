"""Largest ResNet-50 batch under a memory cap, without and with tfmemopt swapping (issue 5).

The seed-003 demo on the CPU test bed: Keras ResNet50(weights=None, 10 classes) on
synthetic 64x64 images, trained with a GradientTape step and Adam (benchmarks/models.py:
resnet50), under a capped CPU allocator (TF_CPU_ALLOCATOR_USE_BFC,
TF_CPU_BFC_MEM_LIMIT_IN_MB). For each configuration, the largest batch that trains is
searched by doubling from --lo, then bisecting, up to --hi, one subprocess per trial
(tfmemopt.maxbatch). Then all configurations are timed at the baseline's largest batch
in the same run, taking turns step by step, and
overhead_at_baseline_max = t_tfmemopt / t_baseline - 1 (medians; overhead_auto likewise).

Configurations: "baseline" (without tfmemopt), "tfmemopt" (swap only:
enable_recompute=False, other fields at their defaults), "auto" (the joint planner:
keep, swap or recompute each tensor; every field at its default) and "auto_exact"
(auto with split_batch_statistics=False: splitting along the batch never passes
through batch normalization's gradient, docs/split.md#batch-statistics). Splitting is
on in every tfmemopt configuration (the default), used only when nothing else fits.
Each trial calls tfmemopt.enable() with its fields, as a user's script would, so a
planned step that runs out of memory in its first calls is re-planned under a lower
budget and retried (function_retries, 3 by default; tfmemopt/function_guard.py); a
batch counts as training when its steps ran, retried or not.

--reserve-memory adds reserve_memory=True to every tfmemopt configuration: the pool is
reserved as one region first (docs/allocator.md#reserving-the-pool).

Usage: python benchmarks/resnet50_lms.py [--cap-mb 1024] [--lo 16] [--hi 1024]
           [--reserve-memory] [--json] [--quick]
--json prints one JSON object as the last line of stdout:
{"max_batch_baseline", "max_batch_tfmemopt", "max_batch_auto", "max_batch_auto_exact",
"overhead_at_baseline_max" (tfmemopt's), "overhead_auto", "overhead_auto_exact", ...}.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402
from tfmemopt.maxbatch import compare, table  # noqa: E402

# What each configuration passes to tfmemopt.enable(); None: without tfmemopt.
# "auto": the joint planner (swap and recompute, every field at its default).
CONFIGS = {"baseline": None, "tfmemopt": {"enable_recompute": False}, "auto": {},
           "auto_exact": {"split_batch_statistics": False}}
DEFAULTS = dict(size=64, cap_mb=1024, lo=16, hi=1024, steps=2, rounds=10)
# --quick: small images, one trial per configuration and two timed steps (ResNet-50's
# graph still takes tens of seconds to build in each trial).
QUICK = dict(size=32, cap_mb=512, lo=2, hi=2, steps=2, rounds=2)


def main():
    args, settings = models.benchmark_settings(
        __doc__.splitlines()[0], DEFAULTS, QUICK,
        {"size": "image height and width", "lo": "first batch tried",
         "hi": "largest batch tried"},
        extra=lambda parser: parser.add_argument(
            "--reserve-memory", action="store_true",
            help="reserve_memory=True in every tfmemopt configuration"))
    cap_mb = settings["cap_mb"]
    configs = {name: (None if fields is None else
                      {**fields, **({"reserve_memory": True} if args.reserve_memory else {})})
               for name, fields in CONFIGS.items()}

    print(f"resnet50_lms: Keras ResNet50 on {settings['size']}x{settings['size']} images, cap "
          f"{cap_mb} MiB, batches {settings['lo']}..{settings['hi']} (doubling, then "
          f"bisection), {settings['steps']} steps per trial", flush=True)
    comparison = compare(
        models.resnet50, settings["lo"], settings["hi"],
        {name: {"fields": fields} for name, fields in configs.items()}, "baseline",
        cap_mb=cap_mb, steps=settings["steps"], strategy="grow",
        step_kwargs={"size": settings["size"]}, rounds=settings["rounds"])
    results = comparison.searches
    print("\n" + table(results))
    if comparison.timing:
        print("\n" + comparison.timing_text())
    print()
    for name, result in results.items():
        limit = ("" if result.min_failing_batch is not None or result.max_batch is None
                 else f" (batch {settings['hi']} trains: the limit is above --hi)")
        print(f"largest batch {name}: {result.max_batch}{limit}")
    for name, value in comparison.overhead.items():
        if value is not None:
            print(f"overhead of {name} at batch {comparison.size}: {value * 100:+.1f} %")
    overhead = comparison.overhead.get("tfmemopt")
    if comparison.error:
        print(f"search stopped: {comparison.error}")
    if args.json:
        print(json.dumps({
            "max_batch_baseline": results["baseline"].max_batch,
            "max_batch_tfmemopt": results["tfmemopt"].max_batch if "tfmemopt" in results else None,
            "max_batch_auto": results["auto"].max_batch if "auto" in results else None,
            "max_batch_auto_exact":
                results["auto_exact"].max_batch if "auto_exact" in results else None,
            "overhead_auto": comparison.overhead.get("auto"),
            "overhead_auto_exact": comparison.overhead.get("auto_exact"),
            "overhead_at_baseline_max": overhead,
            "settings": settings,
            "configs": configs,
            "reserve_memory": args.reserve_memory,
            **comparison.brief(),
        }))
    return 1 if comparison.error else 0


if __name__ == "__main__":
    sys.exit(main())
