"""Our recompute-only plans against the Checkmate MILP optimum (issue 6).

Graphs: small real models (MLPs, a residual MLP, tiny CNNs, a gated MLP, an
autoencoder, an MLP with dropout) and generated DAGs (random layer graphs with
branches and skips), each a tf.function train step with plain SGD (`w.assign_sub`)
on a fixed batch. Each step's graph goes through TF's own Grappler passes first
(tf_optimizer.OptimizeGraph, our pass in ANALYZE_ONLY), so it is the graph TF would
hand us; then tfmemopt._ext.run_pass runs our pass once on it, exporting the tensor
table the planner analyzed. Nothing is executed.

Size of a graph ("nodes"): the nodes that own a non-persistent buffer of more than 0
bytes (what the MILP decides about). Not counted: nodes whose outputs are only
persistent or empty (constants, VarHandleOp, ReadVariableOp forwarding the variable,
NoOp, variable updates without outputs) and forwarding ops (Identity, Reshape...),
which are contracted onto their source buffer. "stages" also counts the reader-only
steps the MILP keeps (variable updates, forwarding ops) because they free buffers.
Every graph has at most 40 nodes.

Budgets: for each graph, the lowest peak the MILP can reach (solved by the MILP with
the peak as objective: `floor`) and the unplanned peak (`before`, the simulator's);
the budgets are floor + f * (before - floor) for f in --fractions (0.2, 0.5, 0.8).

Each case: our pass (mode AUTO, recompute only: enable_swap=False, enable_schedule=False
(Checkmate fixes the order; no scheduling edges either), min_tensor_bytes=0 so that no
tensor is too small to consider) and the Checkmate MILP
(benchmarks/checkmate_milp.py, its docstring states how its memory model matches the
simulator's), solved by scipy.optimize.milp (HiGHS) with --time-limit seconds per
solve. The MILP's decision space is our planner's: a forward node may be recomputed
for the backward pass, i.e. in the stage of a backward node (solve(backward_only=True));
our recompute pass clones a node only to feed backward readers, so a forward-stage
recomputation (dropping a forward activation between two forward readers and
recomputing it for the second) is outside what it can produce. Unlike our planner,
the MILP may recompute a node in several stages. Checkmate's own, wider space
(recomputation in any stage) is solved too for every case and reported apart
(*_any_stage keys, "any ms" column), not hidden. Ratios count only cases where HiGHS
proves the optimum and our plan fits: ratio = our added compute (the report's
recompute.added_seconds) / the MILP's; 0/0 = 1 and ours > 0 with MILP 0 is inf.
Cases where the MILP meets the budget and our plan does not are failures, listed
apart ("missed"); for them the MILP is solved again with each node recomputed at most
once (our planner's own limit) to tell whether a plan of our kind exists.

Checks per case (any failure is printed and counted in "check_failures"):
* the MILP's schedule, rewritten as a table and replayed by a plain-Python
  re-implementation of the simulator's rules (checkmate_milp.simulate: in-place
  reuse, caller-held inputs, copy-on-write of variable updates, kernels' extra
  buffers), peaks within the budget;
* the unplanned table, replayed in its order (the executor order the simulator
  emulates, exported with the table), peaks exactly at peak_before_bytes; our output
  graph, analyzed afresh as the verify stage does (run_pass on it, export_table) and
  replayed the same way in its own executor order, peaks exactly at the planner's
  planned_peak_bytes and the verify stage's peak_after_bytes; the planner's "fits"
  agrees with the replay, and our clones cost the report's added_seconds;
* when our plan keeps the table's order (checkmate_exact), our plan written as
  Checkmate's R (each clone in the stage of the next original node) is feasible for
  the MILP at the budget: the optimum is then a true lower bound on our cost.

Our plans often do not keep the order: in the executor's order a clone runs when it
is ready, and the original nodes around it can move too. Checkmate (like the paper)
fixes the order, so for those plans the optimum is the best fixed-order schedule, not
a lower bound: ratios below 1 then come from the reordering ("below_optimum",
"reordered"; the *_same_order keys count only plans that keep the order). It cuts
both ways: a MILP schedule runs in the table's order, which a rewritten graph only
follows if control edges enforce it (Checkmate's rewrite does; our recompute pass
adds only the clones' trigger edges), and the executor may run our clone's backward
reader later than the MILP's stage order does, past other big steps. Ratios above 1
on reordered plans come from that (e.g. dag7: recomputing `add` alone for
gradient_tape/mul/Mul, the MILP's 0.35 ms plan, raises the peak from 26.29 to 26.86
MiB in the executor's order of the rewritten graph, whether the clone's trigger edge
comes from the reader's backward input gradient_tape/mul_1/Mul or from another
backward node just before it; hand-made rewrites, replayed like our plans).

Known reasons for "missed" budgets (the MILP fits, our plan does not): the MILP may
recompute a node several times; it may keep the original for early backward readers
and recompute for later ones (our clone serves all backward readers); and our planner
never recomputes an input of an AddN of 3+ inputs (pinned, so that the sum's order
and its last bits do not change), which the MILP does not know about (dag4).

Usage: python benchmarks/optimality.py [--json] [--time-limit 30] [--only NAME ...]
--json prints one JSON object as the last line:
{"cases": int, "proven_optimal": int, "max_ratio": float, "mean_ratio": float, ...}.
"""

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import checkmate_milp as cm  # noqa: E402

MAX_NODES = 40
LR = 0.01


# ---- Graphs ----------------------------------------------------------------------

def _tf():
    import tensorflow as tf
    return tf


def _variables(*shapes):
    tf = _tf()
    return [tf.Variable(tf.zeros(shape)) for shape in shapes]


def _sgd_step(forward, variables, x, y):
    """A tf.function train step: loss = forward(x, y); w -= LR * dloss/dw."""
    tf = _tf()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = forward(x, y)
        grads = tape.gradient(loss, variables)
        for w, g in zip(variables, grads):
            w.assign_sub(LR * g)
        return loss

    return step, (x, y)


def _batch(batch, features, classes=10):
    tf = _tf()
    x = tf.zeros((batch,) + tuple(features))
    y = tf.zeros((batch,), tf.int32) if classes else tf.zeros((batch,) + tuple(features))
    return x, y


def _xent(logits, y):
    tf = _tf()
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def mlp(widths, activation="relu", batch=2048, bias=False):
    tf = _tf()
    act = getattr(tf.nn, activation)
    shapes = list(zip(widths[:-1], widths[1:])) + [(widths[-1], 10)]
    ws = _variables(*shapes)
    bs = _variables(*[(o,) for _, o in shapes[:-1]]) if bias else []

    def forward(x, y):
        h = x
        for i, w in enumerate(ws[:-1]):
            h = h @ w
            if bias:
                h = tf.nn.bias_add(h, bs[i])
            h = act(h)
        return _xent(h @ ws[-1], y)

    return _sgd_step(forward, ws + bs, *_batch(batch, (widths[0],)))


def mlp_dropout(width=256, layers=2, batch=2048, rate=0.5):
    tf = _tf()
    ws = _variables(*([(width, width)] * layers + [(width, 10)]))

    def forward(x, y):
        h = x
        for w in ws[:-1]:
            h = tf.nn.dropout(tf.nn.relu(h @ w), rate=rate, seed=1)
        return _xent(h @ ws[-1], y)

    return _sgd_step(forward, ws, *_batch(batch, (width,)))


def residual_mlp(width=256, blocks=2, batch=2048):
    tf = _tf()
    ws = _variables(*([(width, width)] * (1 + blocks) + [(width, 10)]))

    def forward(x, y):
        h = tf.nn.relu(x @ ws[0])
        for w in ws[1:-1]:
            h = h + tf.nn.relu(h @ w)
        return _xent(h @ ws[-1], y)

    return _sgd_step(forward, ws, *_batch(batch, (width,)))


def gated_mlp(width=256, batch=2048, layers=1):
    tf = _tf()
    ws = _variables(*([(width, width), (width, width)] * layers + [(width, 10)]))

    def forward(x, y):
        h = x
        for i in range(layers):
            h = (h @ ws[2 * i]) * tf.nn.sigmoid(h @ ws[2 * i + 1])
        return _xent(h @ ws[-1], y)

    return _sgd_step(forward, ws, *_batch(batch, (width,)))


def autoencoder(width=512, code=64, batch=2048):
    tf = _tf()
    ws = _variables((width, width // 2), (width // 2, code), (code, width // 2),
                    (width // 2, width))

    def forward(x, y):
        h = tf.nn.relu(x @ ws[0])
        h = tf.nn.relu(h @ ws[1])
        h = tf.nn.relu(h @ ws[2])
        return tf.reduce_mean(tf.square(tf.nn.sigmoid(h @ ws[3]) - y))

    x, _ = _batch(batch, (width,))
    return _sgd_step(forward, ws, x, x)


def cnn(channels=(8, 8, 16), pool_after=1, size=32, batch=64, pool="max"):
    """3x3 convolutions with ReLU (channels[i] filters each), one 2x2 pooling after
    the first pool_after of them, then a dense classifier."""
    tf = _tf()
    shapes = [(3, 3, 1, channels[0])]
    for a, b in zip(channels[:-1], channels[1:]):
        shapes.append((3, 3, a, b))
    side = size // 2
    shapes.append((side * side * channels[-1], 10))
    ws = _variables(*shapes)
    pooling = tf.nn.max_pool2d if pool == "max" else tf.nn.avg_pool2d

    def forward(x, y):
        h = x
        for i, w in enumerate(ws[:-1]):
            h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
            if i + 1 == pool_after:
                h = pooling(h, 2, 2, "VALID")
        h = tf.reshape(h, (batch, -1))
        return _xent(h @ ws[-1], y)

    return _sgd_step(forward, ws, *_batch(batch, (size, size, 1)))


def random_dag(seed, layers=5, batch=2048):
    """A random layer graph: each layer is a dense layer (relu, tanh or sigmoid) of an
    earlier layer, or the sum or product of two earlier layers (skips and branches);
    the layers nobody reads are summed into the classifier."""
    tf = _tf()
    rng = np.random.default_rng(seed)
    width = int(rng.choice([128, 256, 384]))
    spec = []
    for i in range(layers):
        earlier = list(range(max(-1, i - 4), i))  # -1: the input
        kinds = ["dense"] if i < 2 else ["dense", "dense", "add", "mul"]
        kind = str(rng.choice(kinds))
        if kind == "dense":
            spec.append(("dense", str(rng.choice(["relu", "tanh", "sigmoid"])),
                         [int(rng.choice(earlier))]))
        else:
            a, b = rng.choice(earlier, size=2, replace=False)
            spec.append((kind, None, [int(a), int(b)]))
    dense_count = sum(1 for kind, _, _ in spec if kind == "dense")
    ws = _variables(*([(width, width)] * dense_count + [(width, 10)]))
    read = {j for _, _, inputs in spec for j in inputs}
    sinks = [i for i in range(layers) if i not in read]

    def forward(x, y):
        outs = []
        w = iter(ws)

        def value(j):
            return x if j < 0 else outs[j]

        for kind, act, inputs in spec:
            if kind == "dense":
                outs.append(getattr(tf.nn, act)(value(inputs[0]) @ next(w)))
            elif kind == "add":
                outs.append(value(inputs[0]) + value(inputs[1]))
            else:
                outs.append(value(inputs[0]) * value(inputs[1]))
        h = outs[sinks[0]]
        for j in sinks[1:]:
            h = h + outs[j]
        return _xent(h @ ws[-1], y)

    return _sgd_step(forward, ws, *_batch(batch, (width,)))


GRAPHS = {
    "mlp2_relu": lambda: mlp([256, 256, 256]),
    "mlp3_relu": lambda: mlp([256, 256, 256, 256]),
    "mlp4_tanh": lambda: mlp([256, 256, 256, 256, 256], "tanh"),
    "mlp3_wide_narrow": lambda: mlp([128, 512, 128, 512]),
    "mlp3_bias_sigmoid": lambda: mlp([256, 256, 256, 256], "sigmoid", bias=True),
    "mlp2_dropout": lambda: mlp_dropout(),
    "resmlp2": lambda: residual_mlp(blocks=2),
    "resmlp3": lambda: residual_mlp(width=128, blocks=3),
    "gated_mlp": lambda: gated_mlp(),
    "autoencoder": lambda: autoencoder(),
    "cnn_max": lambda: cnn(channels=(8, 8, 8, 16), pool_after=3),
    "cnn_avg": lambda: cnn(channels=(8, 8, 16, 16), pool_after=2, pool="avg"),
}
for _seed in range(10):
    # The largest of 6, 5, 4 layers that stays within MAX_NODES (see load()).
    GRAPHS[f"dag{_seed}"] = tuple((lambda s, n: lambda: random_dag(s, layers=n))(_seed, n)
                                  for n in (6, 5, 4))


# ---- Our pass --------------------------------------------------------------------

def tf_optimized_metagraph(step, args):
    """The step's MetaGraphDef after TF's own Grappler passes (our pass analyze-only),
    with the same train_op collection."""
    import tfmemopt
    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow.python.grappler import cluster as grappler_cluster
    from tensorflow.python.grappler import tf_optimizer
    from tfmemopt.analysis import metagraph_of

    metagraph = metagraph_of(step.get_concrete_function(*args))
    config = tfmemopt.config_proto(mode="ANALYZE_ONLY", log_level=0)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    graph = tf_optimizer.OptimizeGraph(
        config, metagraph, cluster=grappler_cluster.Cluster(disable_detailed_stats=True))
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(metagraph)
    out.graph_def.CopyFrom(graph)
    return out.SerializeToString()


def run_pass(metagraph_bytes, **fields):
    """Our pass once on the graph: (report dict, output GraphDef, table dict)."""
    import tfmemopt
    from tensorflow.core.framework import graph_pb2

    config = tfmemopt.make_config(log_level=0, enable_swap=False, enable_schedule=False,
                                  enable_split=False, min_tensor_bytes=0, **fields)
    entry = tfmemopt.config.custom_optimizer_entry(config).SerializeToString()
    error, ok, report, graph_bytes, table = tfmemopt._ext.run_pass(
        metagraph_bytes, entry, export_table=True)
    if not ok:
        raise RuntimeError(f"run_pass failed: {error}")
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(graph_bytes)
    return json.loads(report), graph, json.loads(table)


def output_table(metagraph_bytes, graph):
    """The table of our output graph, analyzed afresh as the verify stage does (its
    `order` is the executor order the simulator replays it in)."""
    from tensorflow.core.protobuf import meta_graph_pb2

    metagraph = meta_graph_pb2.MetaGraphDef()
    metagraph.ParseFromString(metagraph_bytes)
    metagraph.graph_def.CopyFrom(graph)
    _, _, table = run_pass(metagraph.SerializeToString(), mode="ANALYZE_ONLY")
    return table


def load(name):
    """The graph's TF-optimized MetaGraphDef bytes; of several variants (largest
    first), the first with at most MAX_NODES nodes (else the last)."""
    builders = GRAPHS[name]
    builders = builders if isinstance(builders, tuple) else (builders,)
    for build in builders:
        metagraph = tf_optimized_metagraph(*build())
        _, _, table = run_pass(metagraph, mode="ANALYZE_ONLY")
        if cm.build_model(table).allocating_nodes <= MAX_NODES:
            break
    return metagraph


# ---- One graph ---------------------------------------------------------------------

def ratio_of(ours, milp):
    if milp <= 0:
        return 1.0 if ours <= 0 else math.inf
    return ours / milp


def evaluate(name, metagraph_bytes, fractions, time_limit, log=print):
    """The cases of one graph: a dict per budget, plus the graph's figures."""
    report, _, table = run_pass(metagraph_bytes, mode="ANALYZE_ONLY")
    model = cm.build_model(table)
    device = report["devices"][0]
    before = device["peak_before_bytes"]
    checks = []
    base = cm.replay(model, cm.base_steps(model))
    if base != before:
        checks.append(f"{name}: unplanned replay {base} != peak_before_bytes {before}")
    floor = cm.solve(model, minimize_peak=True, time_limit=time_limit, backward_only=True)
    once_floor = cm.solve(model, minimize_peak=True, time_limit=time_limit, once=True,
                          backward_only=True)
    lowest, _, _ = run_pass(metagraph_bytes, budget_bytes=1)
    graph = {"graph": name, "nodes": model.allocating_nodes, "stages": model.n,
             "before": before, "floor": floor.peak_bytes, "floor_status": floor.status,
             "floor_seconds": floor.solve_seconds, "once_floor": once_floor.peak_bytes,
             "once_floor_status": once_floor.status,
             "ours_floor": lowest["devices"][0]["planned_peak_bytes"]}
    log(f"{name}: {graph['nodes']} nodes, {graph['stages']} stages; peak unplanned "
        f"{before / cm.MIB:.2f} MiB, lowest: MILP {_mib(floor.peak_bytes)} ({floor.status}), "
        f"MILP recomputing each node at most once {_mib(once_floor.peak_bytes)} "
        f"({once_floor.status}), ours {_mib(graph['ours_floor'])}")
    if floor.peak_bytes is None:
        checks.append(f"{name}: the peak-minimizing MILP found no schedule ({floor.message})")
        return graph, [], checks
    cases = []
    for f in fractions:
        budget = int(floor.peak_bytes + f * (before - floor.peak_bytes))
        case = {"graph": name, "nodes": model.allocating_nodes, "fraction": f,
                "budget": budget, "before": before, "floor": floor.peak_bytes}
        ours_report, ours_graph, _ = run_pass(metagraph_bytes, budget_bytes=budget)
        recompute = ours_report["recompute"]
        planned = recompute["planned"]
        case["ours_status"] = ours_report["status"]
        if ours_report["status"] != "ok":
            # The pass fell back to the original graph: nothing is recomputed.
            case["ours_message"] = f"{ours_report['failed_stage']}: {ours_report['message']}"
            case["ours_fits"] = before <= budget
            case["ours_seconds"] = 0.0
            case["ours_recomputed"] = []
            case["ours_peak"] = before
            case["ours_planned"] = list(recompute["nodes"])
        else:
            ours_device = ours_report["devices"][0]
            case["ours_fits"] = bool(recompute["feasible"]) if planned else before <= budget
            case["ours_seconds"] = float(recompute["added_seconds"])
            case["ours_recomputed"] = list(recompute["nodes"])
            case["ours_peak"] = ours_device["planned_peak_bytes"] if planned else before
            # The verify stage's own topological order of the output graph.
            case["ours_verify_peak"] = ours_device["peak_after_bytes"]
            # Control edges that pin the executor to the order the plan assumed.
            case["ours_order_edges"] = len(ours_report["plan_choice"].get("order_edges", []))
        ours = cm.our_schedule(model, output_table(metagraph_bytes, ours_graph))
        ours_replay = cm.replay(model, ours.steps)
        case["ours_replay"] = ours_replay
        case["ours_checkmate_exact"] = ours.checkmate_exact
        if ours_replay != case["ours_peak"]:
            checks.append(f"{name}@{f}: our plan replays to {ours_replay}, the planner "
                          f"predicted {case['ours_peak']}")
        if "ours_verify_peak" in case and ours_replay != case["ours_verify_peak"]:
            checks.append(f"{name}@{f}: our plan replays to {ours_replay}, the verify stage "
                          f"says {case['ours_verify_peak']}")
        if case["ours_fits"] != (ours_replay <= budget):
            checks.append(f"{name}@{f}: the planner says the plan fits: {case['ours_fits']}, "
                          f"its replay peaks at {ours_replay} for budget {budget}")
        if abs(ours.clone_seconds - case["ours_seconds"]) > 1e-12 + 1e-9 * ours.clone_seconds:
            checks.append(f"{name}@{f}: our clones cost {ours.clone_seconds} s, the report says "
                          f"{case['ours_seconds']}")
        sol = cm.solve(model, budget, time_limit=time_limit, backward_only=True)
        case["milp_status"] = sol.status
        case["milp_seconds"] = sol.added_seconds
        case["solve_seconds"] = sol.solve_seconds
        case["variables"] = sol.variables
        case["mip_gap"] = sol.mip_gap
        for key, solution in (("milp", sol), ("any", None)):
            if key == "any":
                # Checkmate's own decision space: recomputation in forward stages too.
                solution = cm.solve(model, budget, time_limit=time_limit)
                case["any_status"] = solution.status
                case["any_seconds"] = solution.added_seconds
            if not solution.schedule:
                continue
            replayed = cm.replay(model, cm.milp_steps(model, solution.schedule))
            case[f"{key}_replay"] = replayed
            case[f"{key}_recomputed"] = [[model.name(i) for i in run if i != t]
                                         for t, run in solution.schedule if len(run) > 1]
            if replayed > budget:
                checks.append(f"{name}@{f}: the {key} MILP's schedule replays to {replayed} > "
                              f"budget {budget}")
        any_sol_proven = case["any_status"] == "optimal"
        if case["ours_fits"] and ours.checkmate_exact:
            # Our plan written as Checkmate's R: feasible at the budget, and no cheaper
            # than the optimum (the optimum is a lower bound on the same model).
            as_milp = cm.solve(model, budget, fixed_recompute=ours.fixed, time_limit=time_limit)
            case["ours_in_milp"] = as_milp.status
            backward = all(model.table["nodes"][model.stage_nodes[t]]["backward"]
                           for t, _ in ours.fixed)
            bounds = [case["any_seconds"]] if any_sol_proven else []
            if backward and sol.proven_optimal:
                bounds.append(sol.added_seconds)
            if as_milp.status != "optimal":
                checks.append(f"{name}@{f}: our fitting plan is not a feasible Checkmate "
                              f"schedule ({as_milp.status})")
            elif any(as_milp.added_seconds < bound * (1 - 1e-6) for bound in bounds):
                checks.append(f"{name}@{f}: our plan costs {as_milp.added_seconds} in the MILP, "
                              f"below its optimum {max(bounds)}")
        if any_sol_proven and case["ours_fits"]:
            case["any_ratio"] = ratio_of(case["ours_seconds"], case["any_seconds"])
        if sol.proven_optimal and sol.added_seconds is not None:
            if case["ours_fits"]:
                case["ratio"] = ratio_of(case["ours_seconds"], sol.added_seconds)
            else:
                once = cm.solve(model, budget, time_limit=time_limit, once=True,
                                backward_only=True)
                case["once_status"] = once.status
                case["once_seconds"] = once.added_seconds
                case["once_recomputed"] = ([[model.name(i) for i in run if i != t]
                                            for t, run in once.schedule if len(run) > 1]
                                           if once.schedule else None)
        log(_row(case))
        cases.append(case)
    return graph, cases, checks


# ---- Output --------------------------------------------------------------------------

HEADER = (f"{'graph':<18} {'nodes':>5} {'budget MiB':>10} {'MILP ms':>9} {'ours ms':>9} "
          f"{'ratio':>6} {'solve s':>7} {'any ms':>9}  note")


def _mib(size):
    return "-" if size is None else f"{size / cm.MIB:.2f} MiB"


def _ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:9.3f}"


def _row(case):
    ratio = case.get("ratio")
    note = ""
    if case["milp_status"] != "optimal":
        note = f"MILP {case['milp_status']}"
    elif case["ours_status"] != "ok":
        note = (f"ours fell back ({case['ours_message']}); "
                f"once-only MILP: {case.get('once_status')} {_ms(case.get('once_seconds')).strip()} ms")
    elif not case["ours_fits"]:
        note = (f"ours misses (peak {case['ours_peak'] / cm.MIB:.2f} MiB); "
                f"once-only MILP: {case.get('once_status')} {_ms(case.get('once_seconds')).strip()} ms")
    return (f"{case['graph']:<18} {case['nodes']:>5} {case['budget'] / cm.MIB:>10.2f} "
            f"{_ms(case['milp_seconds']):>9} {_ms(case['ours_seconds']) if case['ours_fits'] else '(miss)':>9} "
            f"{'-' if ratio is None else f'{ratio:6.3f}':>6} {case['solve_seconds']:>7.1f} "
            f"{_ms(case['any_seconds']) if case['any_status'] == 'optimal' else case['any_status']:>9}"
            f"  {note}")


def summarize(cases, checks):
    proven = [c for c in cases if c["milp_status"] == "optimal"]
    ratios = [c["ratio"] for c in proven if "ratio" in c]
    missed = [c for c in proven if not c["ours_fits"]]
    finite = [r for r in ratios if math.isfinite(r)]
    same = [c["ratio"] for c in proven if "ratio" in c and c["ours_checkmate_exact"]]
    any_ratios = [c["any_ratio"] for c in cases if "any_ratio" in c]
    return {
        "cases": len(cases),
        "proven_optimal": len(proven),
        "max_ratio": max(ratios) if ratios else None,
        "mean_ratio": (sum(ratios) / len(ratios)) if ratios else None,
        "ratios_counted": len(ratios),
        "infinite_ratios": len(ratios) - len(finite),
        "missed_budget": len(missed),
        "missed_once_feasible": sum(1 for c in missed if c.get("once_status") == "optimal"),
        "missed": [f"{c['graph']}@{c['fraction']}" for c in missed],
        "within_1_10": sum(1 for r in ratios if r <= 1.10),
        # Our plan keeps the table's order (and so is a Checkmate schedule, bounded
        # below by the optimum) or reorders it (a clone delays its backward reader in
        # the executor's order), which Checkmate's fixed order does not allow.
        "ratios_same_order": len(same),
        "max_ratio_same_order": max(same) if same else None,
        "mean_ratio_same_order": (sum(same) / len(same)) if same else None,
        "reordered": len(ratios) - len(same),
        "below_optimum": sum(1 for r in ratios if r < 1 - 1e-6),
        "fallbacks": sum(1 for c in cases if c["ours_status"] != "ok"),
        "verify_order_over_budget": sum(1 for c in cases if c["ours_fits"]
                                        and c.get("ours_verify_peak", 0) > c["budget"]),
        # Checkmate's own decision space (recomputation in forward stages too).
        "proven_optimal_any_stage": sum(1 for c in cases if c.get("any_status") == "optimal"),
        "max_ratio_any_stage": max(any_ratios) if any_ratios else None,
        "mean_ratio_any_stage": (sum(any_ratios) / len(any_ratios)) if any_ratios else None,
        "ratios_counted_any_stage": len(any_ratios),
        "check_failures": len(checks),
        "graphs": len({c["graph"] for c in cases}),
        "max_nodes": max((c["nodes"] for c in cases), default=0),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per MILP solve")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    parser.add_argument("--only", nargs="+", default=None, help="graph names")
    parser.add_argument("--details", default=None, help="write every case as JSON here")
    args = parser.parse_args()
    for f in args.fractions:
        if not 0 <= f <= 1:
            parser.error(f"--fractions {f}: allowed: [0, 1]")
    names = args.only or list(GRAPHS)
    unknown = [n for n in names if n not in GRAPHS]
    if unknown:
        parser.error(f"--only {unknown}: allowed: {', '.join(GRAPHS)}")

    start = time.perf_counter()
    all_cases, all_checks, graphs = [], [], []
    print(HEADER)
    for name in names:
        metagraph = load(name)
        graph, cases, checks = evaluate(name, metagraph, args.fractions, args.time_limit)
        if graph["nodes"] > MAX_NODES:
            checks.append(f"{name}: {graph['nodes']} nodes > {MAX_NODES}")
        graphs.append(graph)
        all_cases.extend(cases)
        all_checks.extend(checks)
        for check in checks:
            print(f"  CHECK FAILED: {check}")
    summary = summarize(all_cases, all_checks)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(f"\n{summary['graphs']} graphs (at most {summary['max_nodes']} nodes), "
          f"{summary['cases']} cases, {summary['proven_optimal']} solved to proven optimality; "
          f"ratio over {summary['ratios_counted']}: max {summary['max_ratio']}, "
          f"mean {summary['mean_ratio']}")
    print(f"missed budgets (MILP fits, ours does not): {summary['missed_budget']} "
          f"{summary['missed']}; of these a plan recomputing each node at most once exists "
          f"in {summary['missed_once_feasible']}")
    print(f"Checkmate's own space (recomputation in any stage): "
          f"{summary['proven_optimal_any_stage']} proven optimal; ratio over "
          f"{summary['ratios_counted_any_stage']}: max {summary['max_ratio_any_stage']}, "
          f"mean {summary['mean_ratio_any_stage']}")
    print(f"check failures: {summary['check_failures']}")
    if args.details:
        with open(args.details, "w") as out:
            json.dump({"graphs": graphs, "cases": all_cases, "checks": all_checks}, out,
                      indent=1, default=str)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
