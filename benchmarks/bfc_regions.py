"""How many equal tensors TF's BFC allocator holds at once under a cap (the CPU test bed).

BFC grows its pool in regions that start at 2 MiB and double (allow_growth), never
merged, and a tensor must fit in one region. Under a 1024 MiB cap the regions can be
2 + 4 + ... + 256 + 512 MiB: three tensors of 255.9 MiB fit, three of 256.1 MiB do
not, although 768.3 MiB is far below the cap. A training step that needs three such
tensors at once (seed000's ReluGrad: [B, 24, 24, 64] floats, its two inputs and its
output) therefore runs out of memory at B = 1821 whatever is freed or swapped around
it. This benchmark measures it with real allocations, one fresh interpreter per trial
(a process's regions are never given back). --reserve first reserves the pool as one
region, as tfmemopt.enable() does (tfmemopt.memory_pool.reserve_cpu_pool(),
docs/allocator.md#reserving-the-pool): then a tensor may be as large as the free bytes.

Usage:
  python benchmarks/bfc_regions.py [--cap-mb 1024] [--mib 255.9 256.1] [--count 3] [--reserve] [--json]
  python benchmarks/bfc_regions.py --per-sample-bytes 147456 --count 3 \
      --persistent-mib 13.7 --lo 1024 --hi 3072 [--json]
The first form tries `count` tensors of each size; the second bisects the largest batch
B at which `persistent-mib` (allocated first, as one tensor) and then `count` tensors of
per-sample-bytes x B bytes are held at once.
--json prints one JSON object as the last line of stdout:
{"cap_mb", "count", "reserve", "trials": [{"mib", "held", "fits"}], "max_batch" (second form)}.
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys
sizes, reserve = json.loads(sys.argv[1]), sys.argv[2] == "1"
if reserve:
    import tfmemopt.memory_pool
    print("RESERVED", tfmemopt.memory_pool.reserve_cpu_pool()["region_bytes"])
import tensorflow as tf
held = []
for size in sizes:
    try:
        held.append(tf.zeros([size // 4], tf.float32))
        held[-1].numpy()[:1]  # make sure the buffer exists
    except tf.errors.ResourceExhaustedError:
        break
print("HELD", len(held))
"""


def hold(cap_mb, sizes, reserve=False):
    """How many of `sizes` (bytes, allocated in turn and all kept) a fresh process holds,
    after reserving the pool as one region if `reserve`."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mb), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(sizes), "1" if reserve else "0"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("HELD ")]
    if not lines:
        raise RuntimeError(f"bfc_regions: the trial process failed:\n{proc.stderr[-2000:]}")
    return int(lines[-1].split()[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mb", type=int, default=1024, help="CPU allocator cap in MiB")
    parser.add_argument("--mib", type=float, nargs="+", default=[255.9, 256.1],
                        help="tensor sizes to try, MiB")
    parser.add_argument("--count", type=int, default=3, help="tensors held at once")
    parser.add_argument("--per-sample-bytes", type=int,
                        help="bisect the largest batch instead (bytes per sample of each tensor)")
    parser.add_argument("--persistent-mib", type=float, default=0.0,
                        help="allocated first and kept (variables), MiB")
    parser.add_argument("--lo", type=int, default=1, help="smallest batch (bisection)")
    parser.add_argument("--hi", type=int, default=4096, help="largest batch (bisection)")
    parser.add_argument("--reserve", action="store_true",
                        help="reserve the pool as one region first, as tfmemopt.enable() does")
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON line, last")
    args = parser.parse_args()
    for name in ("cap_mb", "count", "lo", "hi"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    persistent = [int(args.persistent_mib * 2**20)] if args.persistent_mib > 0 else []

    trials, max_batch = [], None

    def trial(tensor_bytes, label):
        held = (hold(args.cap_mb, persistent + [tensor_bytes] * args.count, args.reserve)
                - len(persistent))
        fits = held == args.count
        trials.append({"mib": tensor_bytes / 2**20, "held": max(held, 0), "fits": fits,
                       **label})
        print(f"{args.count} x {tensor_bytes / 2**20:.2f} MiB{''.join(f', {k} {v}' for k, v in label.items())}: "
              f"{'fit' if fits else f'only {max(held, 0)} held'} (cap {args.cap_mb} MiB"
              f"{f', after {args.persistent_mib} MiB persistent' if persistent else ''}"
              f"{', pool reserved as one region' if args.reserve else ''})",
              flush=True)
        return fits

    if args.per_sample_bytes:
        lo, hi = args.lo, args.hi
        if not trial(args.per_sample_bytes * lo, {"batch": lo}):
            max_batch = None
        elif trial(args.per_sample_bytes * hi, {"batch": hi}):
            max_batch = hi
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if trial(args.per_sample_bytes * mid, {"batch": mid}):
                    lo = mid
                else:
                    hi = mid
            max_batch = lo
        print(f"largest batch: {max_batch}")
    else:
        for mib in args.mib:
            trial(int(mib * 2**20), {})
    if args.json:
        print(json.dumps({"cap_mb": args.cap_mb, "count": args.count, "reserve": args.reserve,
                          "persistent_mib": args.persistent_mib, "trials": trials,
                          "max_batch": max_batch}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
