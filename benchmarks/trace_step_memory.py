"""Where a train step's memory really goes: per-kernel allocations of TF's executor.

Takes a benchmark model's train step exactly as the pass sees it (the graph that
tfmemopt.analyze() optimizes), runs it in a v1 Session with one inter-op thread and
FULL_TRACE, and prints the allocator's peak next to the pass's prediction, then the
kernels whose allocations exceed their outputs (scratch/workspace memory: what the
memory model must add) and the bytes in use along the executor's real order.

Usage: TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=8192 \
       python benchmarks/trace_step_memory.py MODEL [--top 15]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402
from tensorflow.python.grappler import cluster as grappler_cluster  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

import tfmemopt  # noqa: E402
from models import MODELS  # noqa: E402
from tfmemopt.analysis import metagraph_of  # noqa: E402


def optimized_step(name):
    step, (x, y) = MODELS[name]()
    concrete = step.get_concrete_function(x, y)
    metagraph = metagraph_of(concrete)
    config = tfmemopt.config_proto(log_level=0, mode="ANALYZE_ONLY")
    config.graph_options.rewrite_options.min_graph_nodes = -1
    graph_def = tf_optimizer.OptimizeGraph(
        config, metagraph, cluster=grappler_cluster.Cluster(disable_detailed_stats=True))
    report = [r for r in tfmemopt.reports() if r.graph_id == "graph_to_optimize"][-1]
    inputs = [t.op.name for t in concrete.graph.inputs if t.dtype != tf.resource]
    fetch = [f.split(":")[0] for f in metagraph.collection_def["train_op"].node_list.value]
    return graph_def, report, inputs, fetch, (x.numpy(), y.numpy())


def trace(graph_def, inputs, fetch, feeds):
    with tf.Graph().as_default() as graph:
        tf.compat.v1.import_graph_def(graph_def, name="")
        init = [
            tf.raw_ops.AssignVariableOp(
                resource=graph.get_tensor_by_name(node.name + ":0"),
                value=tf.zeros([d.size for d in node.attr["shape"].shape.dim],
                               tf.as_dtype(node.attr["dtype"].type)))
            for node in graph_def.node if node.op == "VarHandleOp"
        ]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
        config.graph_options.rewrite_options.disable_meta_optimizer = True  # already optimized
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(init)
            feed = {graph.get_tensor_by_name(n + ":0"): v for n, v in zip(inputs, feeds)}
            ops = [graph.get_operation_by_name(f) for f in fetch]
            sess.run(ops, feed)
            tf.config.experimental.reset_memory_stats("CPU:0")
            metadata = tf.compat.v1.RunMetadata()
            sess.run(ops, feed, run_metadata=metadata, options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    rows = []
    for device in metadata.step_stats.dev_stats:
        for stats in device.node_stats:
            out = sum(o.tensor_description.allocation_description.allocated_bytes for o in stats.output)
            total = sum(m.total_bytes for m in stats.memory)
            in_use = max([m.allocator_bytes_in_use for m in stats.memory] + [0])
            op = stats.timeline_label.split("=")[-1].split("(")[0].strip()
            rows.append((stats.all_start_micros, stats.node_name, op, total - out, out, in_use))
    rows.sort()
    return peak, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "true":
        parser.error("set TF_CPU_ALLOCATOR_USE_BFC=true (and TF_CPU_BFC_MEM_LIMIT_IN_MB) first")
    graph_def, report, inputs, fetch, feeds = optimized_step(args.model)
    peak, rows = trace(graph_def, inputs, fetch, feeds)
    mib = 2.0**20
    print(f"{args.model}: measured peak {peak / mib:.1f} MiB (one inter-op thread), "
          f"predicted {report.predicted_peak_bytes['after']['CPU:0'] / mib:.1f} MiB, "
          f"{len(rows)} kernels traced")
    print("kernels allocating beyond their outputs (scratch memory):")
    for _, node, op, extra, out, in_use in sorted(rows, key=lambda r: -r[3])[:args.top]:
        if extra <= 0:
            break
        print(f"  {extra / mib:8.1f} MiB  {op:<24} out {out / mib:7.1f} MiB  in use {in_use / mib:7.1f} MiB  {node}")
    top = max(rows, key=lambda r: r[5])
    print(f"most bytes in use after a kernel: {top[5] / mib:.1f} MiB after {top[1]} ({top[2]})")


if __name__ == "__main__":
    main()
