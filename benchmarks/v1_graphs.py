"""TF1-style training graphs in a v1 Session: predicted vs measured peak, and the
peak under a budget of half the unplanned one.

The seeds' users write graphs like these: variables from tf.compat.v1.get_variable
(reference variables under tf.compat.v1.disable_resource_variables(), the TF1
default; resource variables otherwise), tf.nn ops, tf.gradients and a
tf.compat.v1.train optimizer. Two graphs, both a CIFAR ResNet without batch norm
(3 stages of `blocks` residual blocks, width 16/32/64, a dense head, plain gradient
descent):

  ref_double_gradients: reference variables; tf.gradients called twice with the
      same arguments, only the second result fed to the optimizer (as some scripts
      do; Grappler's deduplication keeps the copy named "gradients_1/");
  resource_unused_head: resource variables; a second loss (an L2 penalty) is
      differentiated too and never fetched, so the step's graph holds a gradient
      subgraph that no fetch needs (the executor never runs it).

For each graph, in fresh interpreters on TF's BFC CPU allocator (TF's default
threads): the unplanned step (tfmemopt in ANALYZE_ONLY mode: predicted and measured
peak), then tfmemopt with budget = 0.5 x the measured unplanned peak (predicted and
measured), and the losses of 4 steps with and without tfmemopt under one inter-op
thread (TF's own results vary from run to run with a parallel executor when
reference variables are updated in place while the backward pass reads them).

Usage: python benchmarks/v1_graphs.py [--blocks 20] [--batch 128] [--graphs NAME ...]
           [--json] [--quick]
--json prints one JSON object as the last line of stdout:
{"graphs": {name: {"predicted", "measured", "error", "budget", "planned_predicted",
 "planned_measured", "losses_equal", ...}}, "max_abs_error": x}.
"""

import argparse
import json
import os
import subprocess
import sys

GRAPHS = ("ref_double_gradients", "resource_unused_head")
MIB = 2**20


def build(name, blocks=20, batch=128, width=16):
    """(graph, feeds {placeholder: value}, loss, train_op, init_op) of graph `name`.

    Call in a fresh interpreter: it switches TF to graph mode (v1 behaviour)."""
    import numpy as np
    import tensorflow as tf

    if name not in GRAPHS:
        raise ValueError(f"graph {name!r}; allowed: {', '.join(GRAPHS)}")
    tf.compat.v1.disable_eager_execution()
    if name.startswith("ref"):
        tf.compat.v1.disable_resource_variables()
    else:
        tf.compat.v1.enable_resource_variables()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 32, 32, 3], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [batch], name="y")
        init = tf.compat.v1.truncated_normal_initializer(stddev=0.02, seed=1)
        counter = [0]

        def conv(inp, filters, k, stride=1, relu=False):
            counter[0] += 1
            with tf.compat.v1.variable_scope(f"conv{counter[0]}"):
                kernel = tf.compat.v1.get_variable(
                    "kernel", [k, k, inp.shape[-1], filters], initializer=init)
                bias = tf.compat.v1.get_variable(
                    "bias", [filters], initializer=tf.compat.v1.zeros_initializer())
                out = tf.nn.bias_add(tf.nn.conv2d(inp, kernel, stride, "SAME"), bias)
            return tf.nn.relu(out) if relu else out

        h = conv(x, width, 3, relu=True)
        for stage, filters in enumerate([width, 2 * width, 4 * width]):
            for b in range(blocks):
                stride = 2 if stage > 0 and b == 0 else 1
                r = conv(conv(h, filters, 3, stride, relu=True), filters, 3)
                if stride != 1 or h.shape[-1] != filters:
                    h = conv(h, filters, 1, stride)
                h = tf.nn.relu(h + r)
        dense = tf.compat.v1.get_variable("dense/kernel", [4 * width, 10], initializer=init)
        logits = tf.matmul(tf.reduce_mean(h, axis=[1, 2]), dense)
        loss = tf.reduce_mean(tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits))
        params = tf.compat.v1.trainable_variables()
        if name == "ref_double_gradients":
            tf.gradients(loss, params)  # computed again below; only that one is used
        else:
            penalty = loss + 1e-4 * tf.add_n([tf.nn.l2_loss(p) for p in params])
            tf.gradients(penalty, params)  # never fetched
        grads = tf.gradients(loss, params)
        train = tf.compat.v1.train.GradientDescentOptimizer(0.01).apply_gradients(
            zip(grads, params))
        init_op = tf.compat.v1.global_variables_initializer()
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((batch, 32, 32, 3)).astype(np.float32),
             y: rng.integers(0, 10, batch).astype(np.int32)}
    return graph, feeds, loss, train, init_op


_TRIAL = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import tfmemopt
from v1_graphs import build
name, fields, kwargs, inter_op = sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
graph, feeds, loss, train, init_op = build(name, **kwargs)
config = (tfmemopt.config_proto(log_level=0, **fields) if fields is not None
          else tf.compat.v1.ConfigProto())
config.inter_op_parallelism_threads = inter_op
losses, peaks = [], []
with tf.compat.v1.Session(graph=graph, config=config) as sess:
    sess.run(init_op)
    for step in range(4):
        tf.config.experimental.reset_memory_stats("CPU:0")
        losses.append(float(sess.run([train, loss], feeds)[1]).hex())
        if step:
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
train_reports = [r for r in tfmemopt.reports() if r.graph_id == "tf_graph"]
report = max(train_reports, key=lambda r: r.num_nodes) if train_reports else None
print("TRIAL " + json.dumps({
    "losses": losses, "measured": max(peaks),
    "predicted_before": report.predicted_peak_bytes["before"]["CPU:0"] if report else None,
    "predicted_after": report.predicted_peak_bytes["after"]["CPU:0"] if report else None,
    "never_run_nodes": report.never_run_nodes if report else None,
    "changed": report.graph_changed if report else None,
    "recomputed": len(report.recomputed_ops) if report else 0,
    "swapped": len(report.swapped_tensors) if report else 0}))
'''


def trial(name, fields, kwargs, inter_op=0, cap_mb=8192):
    """Runs graph `name` for 4 steps in a fresh interpreter; its TRIAL dict."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mb), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", _TRIAL, here, name, json.dumps(fields), json.dumps(kwargs),
         str(inter_op)], capture_output=True, text=True, env=env, timeout=3600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("TRIAL ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} {fields}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("TRIAL "):])


def measure(name, kwargs, budget_fraction=0.5):
    unplanned = trial(name, {"mode": "ANALYZE_ONLY"}, kwargs)
    budget = int(unplanned["measured"] * budget_fraction)
    planned = trial(name, {"budget": budget}, kwargs)
    plain_1 = trial(name, None, kwargs, inter_op=1)
    planned_1 = trial(name, {"budget": budget}, kwargs, inter_op=1)
    return {
        "predicted": unplanned["predicted_before"], "measured": unplanned["measured"],
        "error": unplanned["predicted_before"] / unplanned["measured"] - 1,
        "never_run_nodes": unplanned["never_run_nodes"], "budget": budget,
        "planned_predicted": planned["predicted_after"], "planned_measured": planned["measured"],
        "planned_error": planned["predicted_after"] / planned["measured"] - 1,
        "recomputed": planned["recomputed"], "swapped": planned["swapped"],
        "losses_equal": plain_1["losses"] == planned_1["losses"],
        "losses": planned_1["losses"], "losses_without": plain_1["losses"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=GRAPHS)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="3 blocks, batch 32")
    args = parser.parse_args()
    kwargs = {"blocks": 3, "batch": 32} if args.quick else {"blocks": args.blocks, "batch": args.batch}
    results = {name: measure(name, kwargs) for name in args.graphs}
    print(f"{'graph':<24} {'predicted':>10} {'measured':>10} {'error':>7} {'budget':>9} "
          f"{'planned':>9} {'measured':>9} {'losses':>7}")
    for name, r in results.items():
        print(f"{name:<24} {r['predicted'] / MIB:9.1f}M {r['measured'] / MIB:9.1f}M "
              f"{100 * r['error']:+6.1f}% {r['budget'] / MIB:8.1f}M {r['planned_predicted'] / MIB:8.1f}M "
              f"{r['planned_measured'] / MIB:8.1f}M {'equal' if r['losses_equal'] else 'DIFFER':>7}")
    out = {"graphs": results, "kwargs": kwargs,
           "max_abs_error": max(max(abs(r["error"]), abs(r["planned_error"]))
                                for r in results.values())}
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
