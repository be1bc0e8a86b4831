"""The tfmemopt command line: `tfmemopt demo`, more subcommands as passes land.

Exit codes: 0 success, 1 the job ran but failed, 2 bad usage or input.
"""

import argparse
import json
import sys


def _format_mib(n):
    return f"{n / 2**20:.1f} MiB"


def _demo(args):
    from tfmemopt.demo import run_trial

    print(f"tfmemopt demo: seed CNN (conv32-conv64-maxpool-fc128-fc10, Adam), batch "
          f"{args.batch}, CPU allocator capped at {args.cap_mb} MiB "
          f"(TF_CPU_ALLOCATOR_USE_BFC), one subprocess per run\n", flush=True)
    without = run_trial(args.batch, args.cap_mb, use_tfmemopt=False, steps=args.steps)
    with_opt = run_trial(args.batch, args.cap_mb, use_tfmemopt=True, steps=args.steps)
    for name, trial in (("without tfmemopt", without), ("with tfmemopt", with_opt)):
        status = "trained" if trial["ok"] else f"FAILED ({trial.get('error', '')})"
        peak = trial.get("measured_peak_bytes")
        print(f"{name:>17}: {status}; measured peak "
              f"{_format_mib(peak) if peak is not None else 'n/a'}")
    report = with_opt.get("report")
    if report:
        print("\n" + with_opt["report_text"])
        predicted = report["devices"][0]["peak_before_bytes"]
        measured = with_opt["measured_peak_bytes"]
        print(f"\npredicted peak {_format_mib(predicted)} vs measured "
              f"{_format_mib(measured)} ({(predicted - measured) / measured * 100:+.1f} %)")
    if without["ok"] and with_opt["ok"]:
        same = without["losses"] == with_opt["losses"]
        print(f"losses with and without tfmemopt are {'bitwise equal' if same else 'DIFFERENT'}: "
              f"{with_opt['losses']}")
    if args.json:
        print(json.dumps({"without": without, "with": with_opt}))
    return 0 if with_opt["ok"] and report else 1


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfmemopt",
        description="tfmemopt: keep, swap or recompute every tensor of a TensorFlow "
                    "training graph under a memory budget.",
        epilog="Exit codes: 0 success, 1 the job ran but failed, 2 bad usage or input.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="train the seed CNN under a capped allocator, with and without tfmemopt",
        description="Train the seed-000 CNN under a capped CPU allocator, with and "
                    "without tfmemopt, and print the pass's report next to the "
                    "measured peak.")
    demo.add_argument("--batch", type=int, default=512, help="batch size (default 512)")
    demo.add_argument("--cap-mb", type=int, default=1024,
                      help="CPU allocator cap in MiB (default 1024)")
    demo.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    demo.add_argument("--json", action="store_true", help="also print the results as JSON")
    demo.set_defaults(run=_demo)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    for name in ("batch", "cap_mb", "steps"):
        if getattr(args, name, 1) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
