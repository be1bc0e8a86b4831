"""How long the pass takes to plan a large training graph (issue 6).

A CIFAR-shaped ResNet deep enough for its train step to have about 10,000 nodes after
TF's own Grappler passes (benchmarks/models.py: cifar_resnet; 34 blocks by default).
The pass first analyzes it alone (ANALYZE_ONLY: its predicted peak), then plans it
under a budget of --fraction of that peak, with every mechanism on (AUTO), through
Grappler's own entry point (tfmemopt.analyze: nothing is trained). The time printed is
the pass's own, from its report (total_seconds: analysis, simulation, planning,
rewrite and verification), so TF's built-in passes are not counted.

Usage: python benchmarks/plan_time.py [--blocks 34] [--batch 128] [--fraction 0.5] [--json]
--json prints one JSON object as the last line: {"nodes": int, "plan_seconds": float, ...}.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=34, help="residual blocks")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="budget as a fraction of the graph's predicted peak")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction {args.fraction}: allowed: (0, 1]")

    import tfmemopt

    step, (x, y) = models.cifar_resnet(blocks=args.blocks, batch=args.batch)
    concrete = step.get_concrete_function(x, y)
    analysis = tfmemopt.analyze(concrete, mode="ANALYZE_ONLY", log_level=0)
    device = analysis.devices[0]
    peak = analysis.predicted_peak_bytes["before"][device]
    budget = int(args.fraction * peak)
    report = tfmemopt.analyze(concrete, budget=budget, log_level=0)
    after = report.predicted_peak_bytes["after"][device]
    result = {
        "nodes": report.num_nodes,
        "plan_seconds": report.total_seconds,
        "stage_seconds": report.stage_seconds,
        "analysis_only_seconds": analysis.total_seconds,
        "peak_before_bytes": peak,
        "budget_bytes": budget,
        "peak_after_bytes": after,
        "fits": report.fits,
        "recomputed_ops": len(report.recomputed_ops),
        "swapped_tensors": len(report.swapped_tensors),
        "order_guard": {k: (len(v) if k == "edges" else v) for k, v in report.order_guard.items()},
        "simulations": report.recompute.get("simulations", 0),
        "blocks": args.blocks,
        "batch": args.batch,
    }
    mib = 2.0**20
    print(f"train step of a {args.blocks}-block ResNet, batch {args.batch}: {report.num_nodes} nodes")
    print(f"analysis alone: {analysis.total_seconds:.2f} s")
    print(f"planning for {budget / mib:.1f} MiB ({args.fraction:.0%} of {peak / mib:.1f} MiB): "
          f"{report.total_seconds:.2f} s for the whole pass "
          f"({', '.join(f'{k} {v:.2f} s' for k, v in report.stage_seconds.items())}), "
          f"{result['simulations']} plans simulated")
    print(f"predicted peak {after / mib:.1f} MiB ({'fits' if report.fits else 'does not fit'}), "
          f"{result['recomputed_ops']} ops recomputed, {result['swapped_tensors']} tensors swapped")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
