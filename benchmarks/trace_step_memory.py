"""Where a train step's memory really goes, allocation by allocation, next to the model.

Trains a benchmark model's tf.function step as the benchmark does (TF's BFC CPU
allocator, the pass in ANALYZE_ONLY mode), profiles one step after the warm-up
with TF's profiler, and reads the allocator's own trace from it: every
MemoryAllocation/MemoryDeallocation event, with the kernel that made it, the
bytes requested and the chunk handed out, and the bytes in use after it. It
prints

  * the measured peak of the profiled step next to the predicted peak;
  * the chunks live at the measured peak, largest first;
  * kernel scratch memory (allocations of region "temp"), by kernel;
  * kernels whose output allocations differ from the model's replay of the same
    kernel (the pass's replay of the measured step, read from its VLOG(2) log):
    an output the model allocates but TF forwarded in place, or the reverse;
  * the variables copied before an in-place update (copy-on-write), and their bytes.

With --order FILE it also writes the kernels in the order the executor started
them (the profiler's host trace at level 3), one node name per line.

Usage: python benchmarks/trace_step_memory.py MODEL [--inter-op N] [--warmup N]
           [--top 15] [--order FILE] [--budget BYTES] [--batch N] [--plan-cap-mb MIB]
With --budget the pass plans under that budget and the prediction is the plan's.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2.0**20
# Kernels that update a resource variable in place (TF's PrepareToUpdateVariable).
_UPDATE_OP = re.compile(r"Assign(Add|Sub)?VariableOp$|Resource(Sparse)?Apply|ResourceScatter")


def _stats(plane, event):
    names = {k: v.name for k, v in plane.stat_metadata.items()}
    out = {}
    for stat in event.stats:
        kind = stat.WhichOneof("value")
        value = getattr(stat, kind)
        out[names.get(stat.metadata_id, str(stat.metadata_id))] = (
            names.get(value, value) if kind == "ref_value" else value)
    return out


def read_trace(logdir):
    """Allocation events and kernel starts, in time order, from the profile in logdir."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0], "rb") as f:
        space.ParseFromString(f.read())
    events, kernels = [], []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "")
                start = line.timestamp_ns * 1000 + event.offset_ps
                if name in ("MemoryAllocation", "MemoryDeallocation"):
                    stats = _stats(plane, event)
                    stats.update(kind=name, t=start)
                    events.append(stats)
                elif ":" in name and "::" not in name and " " not in name:
                    kernels.append((start, name.rsplit(":", 1)[0]))
    events.sort(key=lambda e: e["t"])
    kernels.sort()
    return events, [name for _, name in kernels]


def peak_live_set(events):
    live, best = {}, (-1, {})
    for e in events:
        if e["kind"] == "MemoryAllocation":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
        if e["bytes_allocated"] > best[0]:
            best = (e["bytes_allocated"], dict(live))
    return best


def model_replay(log_path, num_nodes):
    """The pass's replay of the train step's measured step: node -> (op, bytes
    allocated, scratch bytes). The log holds one replay per graph the pass saw; the
    train step's is the last one with its number of nodes."""
    replays, current = [], None
    pattern = re.compile(r"\] step (\d+) (\S+) \((\S+)\) alloc (\d+) temp (\d+)")
    with open(log_path, errors="replace") as f:
        for line in f:
            m = pattern.search(line)
            if not m:
                continue
            if m.group(1) == "0":
                current = {}
                replays.append(current)
            current[m.group(2)] = (m.group(3), int(m.group(4)), int(m.group(5)))
    mine = [r for r in replays if len(r) == num_nodes]
    return mine[-1] if mine else {}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sys.path.insert(0, HERE)
    parser.add_argument("model")
    parser.add_argument("--inter-op", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--order", help="write the executor's kernel order here")
    parser.add_argument("--budget", type=int, default=0,
                        help="plan under this many bytes (default: ANALYZE_ONLY)")
    parser.add_argument("--batch", type=int, help="the model's batch size (default: its own)")
    parser.add_argument("--plan-cap-mb", type=int, metavar="MIB",
                        help="plan as if the device had this much memory (the pass reads "
                             "TF_CPU_BFC_MEM_LIMIT_IN_MB when it plans) while TF's allocator "
                             "keeps its own, larger limit: a plan that runs out of memory "
                             "under that cap can be traced to its full peak")
    parser.add_argument("--events", metavar="REGEX",
                        help="also print every allocation and free by kernels matching REGEX")
    args = parser.parse_args()

    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "liveness_simulator=2"
    # The pass logs its replay through TF's C++ logging, to file descriptor 2.
    log = tempfile.NamedTemporaryFile(prefix="tfmemopt_replay_", suffix=".log", delete=False)
    saved_stderr = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        import tensorflow as tf
        if args.inter_op:
            tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
        import tfmemopt
        import models

        try:
            build = models.builder(args.model)
        except ValueError as err:
            os.dup2(saved_stderr, 2)  # the message is the user's, not the log's
            parser.error(str(err))
        tf.keras.utils.set_random_seed(0)
        if args.budget:
            tfmemopt.enable(budget=args.budget, log_level=0)
        else:
            tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
        kwargs = {"batch": args.batch} if args.batch else {}
        step, step_args = build(**kwargs)
        if args.plan_cap_mb:
            tf.constant(0.0) + 1.0  # TF's allocator now exists, with its own limit
            os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(args.plan_cap_mb)
        for _ in range(args.warmup):
            step(*step_args)
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)  # the train step
    predicted = report.predicted_peak_bytes["after"]["CPU:0"]

    logdir = tempfile.mkdtemp(prefix="tfmemopt_trace_")
    tf.config.experimental.reset_memory_stats("CPU:0")
    tf.profiler.experimental.start(
        logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
    step(*step_args)
    tf.profiler.experimental.stop()
    measured = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    events, kernels = read_trace(logdir)
    shutil.rmtree(logdir, ignore_errors=True)

    print(f"{args.model}: measured peak {measured / MIB:.1f} MiB (this step), predicted "
          f"{predicted / MIB:.1f} MiB (model's live tensors {report.to_dict()['devices'][0]['live_peak_bytes'] / MIB:.1f} MiB)")
    if args.budget:
        guard = report.order_guard
        print(f"plan: {len(report.recomputed_ops)} ops recomputed, {len(report.swapped_tensors)} "
              f"tensors swapped, {len(guard.get('edges', []))} order edges (worst inline "
              f"choice {guard.get('worst_peak_before_bytes', {}).get('CPU:0', 0) / MIB:.1f} MiB "
              f"unpinned)")
    first = events[0]
    before = first["bytes_allocated"] - (first["allocation_bytes"] if first["kind"] == "MemoryAllocation"
                                         else -first["allocation_bytes"])
    in_use, live = peak_live_set(events)
    print(f"in use before the step {before / MIB:.1f} MiB (persistent {report.persistent_bytes['CPU:0'] / MIB:.1f}"
          f" MiB in the model); at the traced peak {in_use / MIB:.1f} MiB, chunks live:")
    for e in sorted(live.values(), key=lambda e: -e["allocation_bytes"])[:args.top]:
        print(f"  {e['allocation_bytes'] / MIB:8.2f} MiB (requested {e['requested_bytes'] / MIB:7.2f})"
              f"  {e.get('region_type', ''):<6} {e.get('shape', ''):<18} {e.get('tf_op', '')}")

    scratch = collections.Counter()
    outputs = collections.Counter()
    for e in events:
        if e["kind"] != "MemoryAllocation":
            continue
        if e.get("region_type") == "output":
            outputs[e.get("tf_op", "")] += e["requested_bytes"]
        else:
            scratch[e.get("tf_op", "")] += e["requested_bytes"]
    if args.events:
        pattern = re.compile(args.events)
        for e in events:
            if pattern.search(e.get("tf_op", "")):
                sign = "+" if e["kind"] == "MemoryAllocation" else "-"
                print(f"  {sign}{e['allocation_bytes'] / MIB:8.2f} MiB  in use "
                      f"{e['bytes_allocated'] / MIB:8.2f}  {e.get('region_type', ''):<6} "
                      f"{e.get('shape', ''):<18} {e.get('tf_op', '')}")
    print("kernel scratch memory (region 'temp'):")
    for op, size in scratch.most_common(args.top):
        if size >= 1024:
            print(f"  {size / MIB:8.3f} MiB  {op}")

    replay = model_replay(log.name, report.num_nodes)
    os.unlink(log.name)
    # Copy-on-write: a kernel that updates a variable in place first copies it (a
    # temporary of the variable's size) when a read of its value is still held
    # (docs/allocator.md#variable-copies).
    copies = [e for e in events if e["kind"] == "MemoryAllocation"
              and e.get("region_type") == "temp"
              and _UPDATE_OP.match(replay.get(e.get("tf_op", ""), ("",))[0])]
    print(f"variable copies in this step: {len(copies)}, "
          f"{sum(e['requested_bytes'] for e in copies) / MIB:.1f} MiB requested in "
          f"{sum(e['allocation_bytes'] for e in copies) / MIB:.1f} MiB of chunks")
    print("kernels whose outputs the model allocates differently (>= 64 KiB):")
    shown = 0
    for node, (op, modelled, _) in replay.items():
        real = outputs.get(node, 0)
        if "while" in node or max(real, modelled) < 65536:
            continue  # loop bodies run once per iteration in TF, once in the model
        if abs(real - modelled) > 0.5 * max(real, modelled):
            print(f"  model {modelled / MIB:7.2f} MiB  TF {real / MIB:7.2f} MiB  {op:<20} {node}")
            shown += 1
            if shown >= args.top:
                break
    if args.order:
        with open(args.order, "w") as f:
            f.write("\n".join(kernels) + "\n")
        print(f"executor order ({len(kernels)} kernels) written to {args.order}")


if __name__ == "__main__":
    main()
