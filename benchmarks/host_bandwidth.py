"""Throughput of the swap ops on this machine: the default host_bandwidth_bytes_per_sec.

For each size, a v1 graph x -> TfMemSwapOut -> TfMemSwapIn runs repeatedly, and each
op's kernel time is read from the step stats (RunMetadata), so Python and session
overheads do not count. The first run of a size is reported apart ("cold"): its
buffers are new pages. The steady state ("warm", median of the other runs) is what a
training loop sees from its second step on (the host pool reuses its blocks, the
BFC allocator its chunks). The measurement runs in a subprocess under the CPU test
bed's capped BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true, TF_CPU_BFC_MEM_LIMIT_IN_MB,
unless already set); --repeats runs it several times, as the machine may be shared.

Usage: python benchmarks/host_bandwidth.py [--sizes-mib 1 16 128] [--runs 9]
                                           [--repeats 3] [--json]
The figure to use is the lower of the warm swap-out and swap-in throughputs at the
largest size (median over repeats); --json prints everything as one JSON object on
the last line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

MIB = 1 << 20
TEST_BED_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "4096",
                "TF_CPP_MIN_LOG_LEVEL": "2"}


def measure(sizes_mib, runs):
    """In this process: kernel seconds of each op, per size and run."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2

    import tfmemopt  # registers the ops

    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
    trace = config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE)
    results = []
    for size in sizes_mib:
        with tf.Graph().as_default() as graph:
            var = tf.compat.v1.Variable(np.ones(size * MIB // 4, np.float32))
            x = var.read_value()
            stash = graph._create_op_internal(
                "TfMemSwapOut", [x], dtypes=[tf.float32], name="swap_out").outputs[0]
            swap_in = graph._create_op_internal(
                "TfMemSwapIn", [stash], dtypes=[tf.float32], name="swap_in")
            init = tf.compat.v1.global_variables_initializer()
        seconds = {"swap_out": [], "swap_in": []}
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(init)
            for _ in range(runs):
                metadata = config_pb2.RunMetadata()
                sess.run(swap_in, options=trace, run_metadata=metadata)
                for dev in metadata.step_stats.dev_stats:
                    for node in dev.node_stats:
                        if node.node_name in seconds:
                            ns = node.op_end_rel_nanos - node.op_start_rel_nanos
                            seconds[node.node_name].append(ns * 1e-9)
        assert tfmemopt.host_memory_stats()["bytes_in_use"] == 0
        results.append({"size_mib": size, "seconds": seconds})
    return results


def summarize(size_mib, seconds):
    row = {"size_mib": size_mib}
    for op, times in seconds.items():
        nbytes = size_mib * MIB
        row[f"{op}_cold"] = nbytes / times[0]
        row[f"{op}_warm"] = nbytes / statistics.median(times[1:])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--runs", type=int, default=9, help="runs per size (first is cold)")
    parser.add_argument("--repeats", type=int, default=3, help="subprocesses, one after another")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2 (the first run is cold)")

    if args.child:
        print(json.dumps(measure(args.sizes_mib, args.runs)))
        return

    env = dict(os.environ)
    for key, value in TEST_BED_ENV.items():
        env.setdefault(key, value)
    repeats = []
    for _ in range(args.repeats):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "--runs", str(args.runs),
             "--sizes-mib", *map(str, args.sizes_mib)],
            capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"host_bandwidth: the measurement failed:\n{proc.stderr[-2000:]}")
        raw = json.loads(proc.stdout.strip().splitlines()[-1])
        repeats.append([summarize(r["size_mib"], r["seconds"]) for r in raw])

    gbs = 1e9
    print(f"TF_CPU_ALLOCATOR_USE_BFC={env['TF_CPU_ALLOCATOR_USE_BFC']} "
          f"TF_CPU_BFC_MEM_LIMIT_IN_MB={env['TF_CPU_BFC_MEM_LIMIT_IN_MB']}, "
          f"{args.runs} runs per size, {args.repeats} repeats")
    print(f"{'repeat':>6} | {'MiB':>5} | {'out cold':>8} | {'out warm':>8} | {'in cold':>8} | "
          f"{'in warm':>8}   (GB/s)")
    for index, rows in enumerate(repeats):
        for row in rows:
            print(f"{index:>6} | {row['size_mib']:>5} | {row['swap_out_cold'] / gbs:>8.2f} | "
                  f"{row['swap_out_warm'] / gbs:>8.2f} | {row['swap_in_cold'] / gbs:>8.2f} | "
                  f"{row['swap_in_warm'] / gbs:>8.2f}")
    largest = [rows[-1] for rows in repeats]
    figure = min(statistics.median(r["swap_out_warm"] for r in largest),
                 statistics.median(r["swap_in_warm"] for r in largest))
    print(f"host_bandwidth_bytes_per_sec = {figure:.3g}  (lower of the median warm swap-out and "
          f"swap-in throughputs at {largest[0]['size_mib']} MiB)")
    if args.json:
        print(json.dumps({"host_bandwidth_bytes_per_sec": figure, "repeats": repeats}))


if __name__ == "__main__":
    main()
