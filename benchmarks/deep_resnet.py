"""Deepest ResNet that trains under a memory cap, without and with tfmemopt (issue 4).

The seed-001 experiment on the CPU test bed: a CIFAR-shaped ResNet (32x32x3 inputs,
`depth` residual blocks; benchmarks/models.py: cifar_resnet) at a fixed batch, under a
capped CPU allocator (TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB). For each
configuration, the largest depth that trains is searched by doubling from --lo, then
bisecting, up to --max-depth, one subprocess per trial (tfmemopt.maxbatch). Then all
configurations are timed at the baseline's largest depth in the same run, taking turns
step by step, and overhead_at_baseline_max = t_tfmemopt / t_baseline - 1 (medians).

Configurations: "baseline" (without tfmemopt), "tfmemopt" (recompute only:
enable_swap=False, other fields at their defaults) and "auto" (the joint planner:
keep, swap or recompute each tensor; every field at its default).

Usage: python benchmarks/deep_resnet.py [--batch 128] [--cap-mb 768] [--max-depth 200]
           [--plot peak_vs_depth.png] [--json] [--quick]
--json prints one JSON object as the last line of stdout:
{"max_depth_baseline", "max_depth_tfmemopt", "max_depth_auto",
"overhead_at_baseline_max" (tfmemopt's), "overhead_auto", ...}.
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
CONFIGS = {"baseline": None, "tfmemopt": {"enable_swap": False}, "auto": {}}
DEFAULTS = dict(batch=128, width=16, cap_mb=768, lo=1, max_depth=200, steps=2, rounds=10)
# --quick: a tiny network, one trial per configuration and two timed steps, so that a
# test can run the whole benchmark fast.
QUICK = dict(batch=16, width=8, cap_mb=64, lo=2, max_depth=2, steps=2, rounds=2)


def plot(results, cap_mb, batch, path):
    from matplotlib.ticker import MaxNLocator

    from tfmemopt.report import _matplotlib

    figure_class, canvas_class = _matplotlib()
    fig = figure_class(figsize=(8, 5), dpi=100, layout="constrained")
    canvas_class(fig)
    ax = fig.subplots()
    styles = (("o-", "#4c72b0"), ("s--", "#dd8452"), ("^:", "#55a868"))
    for (name, result), (style, color) in zip(results.items(), styles):
        ok = sorted((t.size, t.peak_bytes / 2**20) for t in result.trials if t.ok and t.peak_bytes)
        if ok:
            ax.plot(*zip(*ok), style, color=color, label=f"{name}: trains", alpha=0.8)
        oom = sorted(t.size for t in result.trials if t.status == "oom")
        if oom:
            ax.plot(oom, [cap_mb] * len(oom), "x", color=color, markersize=10,
                    label=f"{name}: out of memory")
    ax.axhline(cap_mb, color="#c44e52", linestyle="--", linewidth=1, label=f"cap {cap_mb} MiB")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("residual blocks (depth)")
    ax.set_ylabel("measured BFC peak (MiB)")
    ax.set_title(f"CIFAR ResNet, batch {batch}: peak memory vs depth")
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def main():
    args, settings = models.benchmark_settings(
        __doc__.splitlines()[0], DEFAULTS, QUICK,
        {"width": "channels of the residual blocks", "lo": "first depth tried",
         "max_depth": "deepest network tried"},
        extra=lambda parser: parser.add_argument(
            "--plot", metavar="OUT.png", help="write peak vs depth as a PNG"))
    batch, cap_mb = settings["batch"], settings["cap_mb"]
    step_kwargs = {"batch": batch, "width": settings["width"]}

    print(f"deep_resnet: CIFAR ResNet (width {settings['width']}), batch {batch}, cap "
          f"{cap_mb} MiB, depths {settings['lo']}..{settings['max_depth']} (doubling, then "
          f"bisection), {settings['steps']} steps per trial", flush=True)
    comparison = compare(
        models.cifar_resnet, settings["lo"], settings["max_depth"],
        {name: {"fields": fields} for name, fields in CONFIGS.items()}, "baseline",
        cap_mb=cap_mb, steps=settings["steps"], strategy="grow", step_kwargs=step_kwargs,
        rounds=settings["rounds"])
    results = comparison.searches
    print("\n" + table(results, "depth"))
    base = results["baseline"].max_batch
    if comparison.timing:
        print("\n" + comparison.timing_text("depth"))
    print()
    for name, result in results.items():
        limit = ("" if result.min_failing_batch is not None or result.max_batch is None
                 else f" (depth {settings['max_depth']} trains: the limit is above --max-depth)")
        print(f"largest depth {name}: {result.max_batch}{limit}")
    for name, value in comparison.overhead.items():
        if value is not None:
            print(f"overhead of {name} at depth {comparison.size}: {value * 100:+.1f} %")
    overhead = comparison.overhead.get("tfmemopt")
    if comparison.error:
        print(f"search stopped: {comparison.error}")
    if args.plot:
        print(f"wrote {plot(results, cap_mb, batch, args.plot)}")
    if args.json:
        print(json.dumps({
            "max_depth_baseline": base,
            "max_depth_tfmemopt": results["tfmemopt"].max_batch if "tfmemopt" in results else None,
            "max_depth_auto": results["auto"].max_batch if "auto" in results else None,
            "overhead_auto": comparison.overhead.get("auto"),
            "overhead_at_baseline_max": overhead,
            "settings": settings,
            "configs": CONFIGS,
            **comparison.brief(),
        }))
    return 1 if comparison.error else 0


if __name__ == "__main__":
    sys.exit(main())
