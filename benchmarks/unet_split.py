"""Largest U-Net batch under a memory cap, with and without splitting (issue 18).

A U-Net-like segmentation model (benchmarks/models.py: unet; 128x128x3 inputs,
three levels of two 3x3 convolutions, a bottleneck, transposed convolutions up,
skip concatenations, a per-pixel binary cross-entropy, Adam) under a capped CPU
allocator. Its activations at full resolution are most of its memory, so keeping,
swapping and recomputing stop at the largest op's working set; splitting per-sample
work along the batch goes past it. For each configuration the largest batch that
trains is searched by bisection, one subprocess per trial (tfmemopt.maxbatch);
then the configurations are timed at the baseline's largest batch, interleaved.

Configurations: "baseline" (without tfmemopt), "no_split" (tfmemopt with
enable_split=False: keep, swap, recompute) and "split" (tfmemopt, every field at
its default). split_ratio = max_batch_split / max_batch_no_split (issue 18 asks
for >= 1.5).

Usage: python benchmarks/unet_split.py [--cap-mb 1024] [--lo 8] [--hi 1024]
           [--size 128] [--json] [--quick]
--json prints one JSON object as the last line of stdout:
{"max_batch_baseline", "max_batch_no_split", "max_batch_split", "split_ratio",
"overhead_split", "overhead_no_split", ...}.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402
from tfmemopt.maxbatch import compare, table  # noqa: E402

CONFIGS = {"baseline": None, "no_split": {"enable_split": False}, "split": {}}
DEFAULTS = dict(cap_mb=1024, lo=8, hi=1024, size=128, width=16, steps=2, rounds=6)
QUICK = dict(cap_mb=256, lo=4, hi=4, size=32, width=4, steps=2, rounds=2)


def main():
    args, settings = models.benchmark_settings(
        __doc__.splitlines()[0], DEFAULTS, QUICK,
        {"lo": "smallest batch searched", "hi": "largest batch searched",
         "size": "image height and width", "width": "channels of the first level"})
    cap_mb = settings["cap_mb"]
    step_kwargs = {"size": settings["size"], "width": settings["width"]}
    print(f"unet_split: U-Net {settings['size']}x{settings['size']}, width "
          f"{settings['width']}, cap {cap_mb} MiB, batches {settings['lo']}..{settings['hi']} "
          f"(bisection), {settings['steps']} steps per trial", flush=True)
    comparison = compare(
        models.unet, settings["lo"], settings["hi"],
        {name: {"fields": fields} for name, fields in CONFIGS.items()}, "baseline",
        cap_mb=cap_mb, steps=settings["steps"], step_kwargs=step_kwargs,
        rounds=settings["rounds"])
    results = comparison.searches
    print("\n" + table(results))
    if comparison.timing:
        print("\n" + comparison.timing_text())
    print()
    sizes = {name: result.max_batch for name, result in results.items()}
    for name, result in results.items():
        limit = ("" if result.min_failing_batch is not None or result.max_batch is None
                 else f" (batch {settings['hi']} trains: the limit is above --hi)")
        print(f"largest batch {name}: {result.max_batch}{limit}")
    ratio = None
    if sizes.get("split") and sizes.get("no_split"):
        ratio = sizes["split"] / sizes["no_split"]
        print(f"split / no_split: {ratio:.2f}x")
    for name, value in comparison.overhead.items():
        if value is not None:
            print(f"overhead of {name} at batch {comparison.size}: {value * 100:+.1f} %")
    if comparison.error:
        print(f"search stopped: {comparison.error}")
    if args.json:
        print(json.dumps({
            "max_batch_baseline": sizes.get("baseline"),
            "max_batch_no_split": sizes.get("no_split"),
            "max_batch_split": sizes.get("split"),
            "split_ratio": ratio,
            "overhead_split": comparison.overhead.get("split"),
            "overhead_no_split": comparison.overhead.get("no_split"),
            "settings": settings,
            "configs": CONFIGS,
            **comparison.brief(),
        }))
    return 1 if comparison.error else 0


if __name__ == "__main__":
    sys.exit(main())
