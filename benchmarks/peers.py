"""Peers side by side: what a user could pick instead of tfmemopt, on the same models.

For each model (benchmarks/models.py) and each configuration below, in one run:
  max_batch   the largest batch that trains under a CPU allocator cap
              (tfmemopt.find_max_batch: bisection, one subprocess per trial,
              TF_CPU_ALLOCATOR_USE_BFC=true + TF_CPU_BFC_MEM_LIMIT_IN_MB=cap);
  step_s      the median step time at one batch that every configuration trains (the
              smallest max_batch among them), measured interleaved: one interpreter per
              configuration under the same cap, taking turns step by step, so that the
              machine's load hits all alike (as tfmemopt.maxbatch.time_interleaved);
              step_ratio = step_s / plain TF's step_s;
  loss_equal  the losses of the first 3 steps at that batch are bitwise equal to those of
              a separate plain-TF run (same seed, same data, same cap). Near the limit
              that fresh plain-TF run may run out of memory where the timed one did not;
              then the losses are compared at 90 %, 75 % or 50 % of the timed batch,
              each configuration in a process of its own (loss_batch in the JSON). Plain
              TF's own loss_equal says whether TF is deterministic from one process to
              the next; if it is not, every configuration's losses are taken again with
              one inter-op thread (loss_inter_op in the JSON says which). None when a
              configuration's losses could not be taken (its note says why).
              At the timed batch tfmemopt may leave the graph alone (it fits), so a
              configuration whose max_batch is above plain TF's also has
              loss_equal_at_max_batch: its losses at its own max_batch under the cap
              against plain TF's at that batch without a cap.

Configurations ("peers"):
  plain_tf              TF as installed: Grappler's default memory_optimization
                        (DEFAULT_MEM_OPT), no tfmemopt.
  grappler_LEVEL        TF's built-in Grappler memory optimizer at LEVEL (NO_MEM_OPT,
                        SWAPPING_HEURISTICS, RECOMPUTATION_HEURISTICS,
                        SCHEDULING_HEURISTICS, HEURISTICS), set in the eager context's
                        config that tf.function calls hand to Grappler (as
                        benchmarks/seed000.py; its grappler_check confirms in each
                        searched trial, from the call config and TF's meta-optimizer log,
                        that the level reached the train step's graph). A level whose
                        Grappler output for the model's train step is the same GraphDef,
                        byte for byte, as plain TF's (or an earlier level's) at every
                        batch compared (--lo, --hi and one between; tf_optimizer.
                        OptimizeGraph on the local cluster, whose CPU has TF's nominal
                        256 MiB as at run time) is not searched again: its row says
                        same_graph_as and has that configuration's figures, and one trial
                        at --lo checks that the level reaches the graph.
  keras_remat_MODE      Keras' own keras.RematScope(mode=MODE) around the model's
                        construction, MODE in full, larger_than (output_size_threshold
                        1024, Keras' default), activations, list_of_layers (the model's
                        Conv/Dense/LSTM layers). A mode that raises when the train step
                        is traced (graph mode) is recorded with its error.
  recompute_grad        tf.recompute_grad around each block: the model's layers are cut
                        at the tensors every later layer depends on alone (the residual
                        blocks of a ResNet, each layer of a Sequential model), pieces
                        without a Conv/Dense/LSTM layer joined to their neighbour, and
                        each piece but the output layer runs as tf.recompute_grad of a
                        sub-model made of the same layer objects (so the weights are the
                        plain model's).
  tfmemopt              tfmemopt.enable() with its defaults (the auto joint planner, a
                        budget of 0.9 x the device memory, here the cap).

Usage: python benchmarks/peers.py [--models NAME ...] [--peers NAME ...] [--cap-mb N]
           [--lo N] [--hi N] [--batch-step N] [--steps N] [--rounds N] [--json]
           [--quick] [--save]
Per-model caps and search ranges are in MODEL_SETTINGS (--cap-mb, --lo, --hi,
--batch-step override them for every model run). The search runs on multiples of
batch_step: max_batch is the largest multiple of batch_step that trains.
--json prints a table and, as the last line of stdout, one JSON object:
{"models": {model: {configuration: {"peer", "status" ("ok", "error",
   "not_applicable", "same_graph_as"), "max_batch", "min_failing_batch", "step_s",
   "step_ratio", "loss_equal", "losses", "note", "error" or "reason", "trials", ...}}},
 "runs": {model: {"cap_mb", "lo", "hi", "batch_step", "timed_batch", "loss_batch",
   "reference_losses", "loss_inter_op", "grappler_graphs", "notes"}},
 "configs": {configuration: description}, "settings": {...}}.
A row that is not measured has None for what it lacks: an error row (a peer that raises)
has no max_batch; a same_graph_as row has the figures of the configuration whose graph
it shares.
--save writes that object to docs/results/peers.json (benchmarks/results.py).
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tfmemopt import maxbatch  # noqa: E402  (imports no TensorFlow)

LEVELS = ("NO_MEM_OPT", "SWAPPING_HEURISTICS", "RECOMPUTATION_HEURISTICS",
          "SCHEDULING_HEURISTICS", "HEURISTICS")
REMAT_MODES = ("full", "larger_than", "activations", "list_of_layers")
BASELINE = "plain_tf"


def _describe():
    out = {BASELINE: "plain TF (Grappler memory_optimization at its default, DEFAULT_MEM_OPT)"}
    out.update({f"grappler_{level}": f"TF's Grappler memory_optimization={level}"
                for level in LEVELS})
    out.update({f"keras_remat_{mode}": f"keras.RematScope(mode={mode!r})" for mode in REMAT_MODES})
    out["recompute_grad"] = "tf.recompute_grad around each block"
    out["tfmemopt"] = "tfmemopt.enable() (defaults: auto joint planner)"
    return out


CONFIGS = _describe()
SHORT = {BASELINE: "plain TF", "recompute_grad": "tf.recompute_grad", "tfmemopt": "tfmemopt",
         **{f"grappler_{level}": level for level in LEVELS},
         **{f"keras_remat_{mode}": f"RematScope {mode}" for mode in REMAT_MODES}}

# Per model: the cap (MiB), the batch range searched and its step, chosen so that plain
# TF's largest batch sits well inside the range and tfmemopt's (up to ~3x) too, with
# trials of a few seconds each on a loaded 2-core machine.
MODEL_SETTINGS = {
    "mlp": dict(cap_mb=96, lo=1024, hi=4096, batch_step=512),
    "lstm": dict(cap_mb=128, lo=256, hi=2048, batch_step=256),
    "seed_cnn": dict(cap_mb=256, lo=64, hi=1024, batch_step=64),
    "cifar_resnet10": dict(cap_mb=256, lo=32, hi=256, batch_step=32),
    "resnet50_64px": dict(cap_mb=1024, lo=8, hi=256, batch_step=4),
}
DEFAULT_MODELS = ("mlp", "lstm", "seed_cnn", "cifar_resnet10")
DEFAULTS = dict(models=list(DEFAULT_MODELS), peers=list(CONFIGS), steps=2, rounds=6)
# --quick: the MLP under 96 MiB, four configurations (plain TF, one Grappler level,
# one RematScope mode that raises, tfmemopt), two or three trials each on multiples of
# 512, for tests. (Its limit, near 2304..2560, moves from run to run for both plain TF
# and tfmemopt: the quick run checks the shape and the losses, not who wins.)
QUICK = dict(models=["mlp"], peers=[BASELINE, "grappler_SWAPPING_HEURISTICS",
                                     "keras_remat_full", "tfmemopt"],
             steps=2, rounds=2, cap_mb=96, lo=1536, hi=2560, batch_step=512)
LOSS_STEPS = 3


# ---------------------------------------------------------------------------
# In the trial interpreter: the model, with its peer applied


@contextlib.contextmanager
def _transform_models(transform):
    """Every Keras model that benchmarks/models.py hands to its train step goes through
    `transform(model) -> model` first (models.py builds each model, then calls
    tfmemopt.demo.keras_train_step(model, loss) or its alias models._train_step)."""
    import models
    from tfmemopt import demo

    original = demo.keras_train_step

    def train_step(model, loss_fn):
        return original(transform(model), loss_fn)

    saved = models._train_step
    models._train_step = demo.keras_train_step = train_step
    try:
        yield
    finally:
        models._train_step, demo.keras_train_step = saved, original


def _build(model, batch):
    """models.MODELS[model] at `batch`, from seed 0: (step, args, the Keras model)."""
    import models
    import tensorflow as tf

    seen = []
    tf.keras.utils.set_random_seed(0)
    with _transform_models(lambda m: seen.append(m) or m):
        step, args = models.MODELS[model](batch=batch)
    return step, args, seen[-1]


_KERNELS = ("kernel", "depthwise_kernel", "pointwise_kernel")


def _computes(layer):
    """A layer with a weight matrix that does the work (Conv, Dense, LSTM...)."""
    import keras

    return (any(getattr(layer, k, None) is not None for k in _KERNELS)
            or isinstance(layer, keras.layers.RNN))


def compute_layer_names(model):
    """Names of the model's Conv/Dense/LSTM layers (RematScope's list_of_layers)."""
    return [layer.name for layer in model.layers if _computes(layer)]


def blocks(model):
    """The model's layers cut into blocks: [(layers, output KerasTensor)], in order, and
    the layers after the last cut (the head).

    A cut is a layer output that is the only tensor any later layer reads (nothing skips
    over it): every layer of a chain, the end of each residual block. Pieces without a
    Conv/Dense/LSTM layer are joined to the piece before them (leading ones to the one
    after)."""
    import keras

    graph = getattr(model, "_functional", None) or model  # a Sequential's own Functional
    ops = [op for op in graph.operations if not isinstance(op, keras.layers.InputLayer)]
    last_use = {}
    for i, op in enumerate(ops):
        for node in op._inbound_nodes:
            for tensor in node.input_tensors:
                last_use[id(tensor)] = i
    pieces, current, live = [], [], {}
    for i, op in enumerate(ops):
        current.append(op)
        out = op.output
        live[id(out)] = out
        live = {k: t for k, t in live.items() if last_use.get(k, -1) > i}
        if list(live) == [id(out)]:
            pieces.append((current, out))
            current = []
    merged = []
    for layers, out in pieces:
        if merged and (not any(map(_computes, layers))
                       or not any(map(_computes, merged[-1][0]))):
            merged[-1] = (merged[-1][0] + layers, out)
        else:
            merged.append((layers, out))
    return graph, merged, current


def recompute_blocks(model):
    """The same model (the same layer objects) with each block run as
    tf.recompute_grad of a sub-model: returns (model, [[layer names] per block])."""
    import keras
    import tensorflow as tf

    class Recomputed(keras.layers.Layer):
        def __init__(self, block, **kwargs):
            super().__init__(**kwargs)
            self.block = block

        def call(self, x, training=None):
            # Positional only: under graph mode, tf.custom_gradient takes no keywords.
            return tf.recompute_grad(lambda t: self.block(t, training=training))(x)

    graph, pieces, _ = blocks(model)
    if not pieces:
        raise NotApplicable("no layer output that later layers read alone before the "
                            "output layer: no block to wrap")
    inputs = keras.Input(graph.inputs[0].shape[1:])
    h, previous = inputs, graph.inputs[0]
    for _, out in pieces:
        h = Recomputed(keras.Model(previous, out))(h)
        previous = out
    if previous is not graph.outputs[0]:
        h = keras.Model(previous, graph.outputs[0])(h)
    return keras.Model(inputs, h), [[layer.name for layer in layers] for layers, _ in pieces]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _keras_error(err):
    """The core of an error Keras raised while tracing: its message without the
    traceback of user code and the argument listing, and the layer it names."""
    text = _ANSI.sub("", str(err))
    where = re.search(r"Exception encountered when calling (\S+)\.", text)
    body = text.split("Exception encountered when calling", 1)[-1]
    body = body.split("Arguments received by", 1)[0]
    lines = [line.strip() for line in body.splitlines()[1:] if line.strip()]
    message = " ".join(lines) or text.strip().splitlines()[-1]
    return f"{message} (in {where.group(1)})" if where else message


class PeerError(Exception):
    """A peer that cannot train the model; the message is what it raised."""


class NotApplicable(Exception):
    """A peer that cannot be applied to the model at all; the message says why."""


def make_step(size, model, peer, batch_step=1, inter_op=0):
    """One configuration's train step in a trial interpreter, for tfmemopt.maxbatch:
    `model` (a name in models.MODELS) at batch size*batch_step, with `peer` applied.
    plain_tf, grappler_* and tfmemopt build the plain model (their difference is the
    Grappler config, which maxbatch sets); keras_remat_* and recompute_grad build it under
    their mechanism. The step is traced here, so that an error a peer raises in graph
    mode is reported as it is (a PeerError with Keras' message)."""
    import keras
    import tensorflow as tf

    if inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    batch = size * batch_step
    if peer.startswith("keras_remat_"):
        mode = peer[len("keras_remat_"):]
        names = None
        if mode == "list_of_layers":
            names = compute_layer_names(_build(model, batch)[2])
            keras.backend.clear_session()  # the same layer names again
        with keras.RematScope(mode=mode, layer_names=names):
            step, args, _ = _build(model, batch)
    elif peer == "recompute_grad":
        import models

        tf.keras.utils.set_random_seed(0)
        with _transform_models(lambda m: recompute_blocks(m)[0]):
            step, args = models.MODELS[model](batch=batch)
    else:
        step, args, _ = _build(model, batch)
    try:
        step.get_concrete_function(*args)
    except (tf.errors.ResourceExhaustedError, MemoryError):
        raise
    except Exception as err:
        raise PeerError(f"{type(err).__name__}: {_keras_error(err)}") from None
    return step, args


# ---------------------------------------------------------------------------
# Which Grappler levels give plain TF's graph (a helper interpreter per model)


_GRAPH_GROUPS = r"""
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.grappler import cluster as gcluster, tf_optimizer
import peers
spec = json.loads(sys.argv[2])
# The local cluster, as TF's function runtime describes it to Grappler: its CPU has
# TF's nominal 256 MiB (which SchedulingPass compares the graph's peak with).
cluster = gcluster.Cluster()
device = cluster.ListDevices()[0].name
def digest(g):
    return hashlib.sha256(g.SerializeToString(deterministic=True)).hexdigest()
out = {"device_memory_size": cluster.ListDevices()[0].properties.memory_size,
       "batches": {}, "levels": {level: {} for level in spec["levels"]}}
for batch in spec["batches"]:
    step, args, _ = peers._build(spec["model"], batch)
    function = step.get_concrete_function(*args)
    graph = function.graph
    graph_def = graph.as_graph_def(add_shapes=True)
    for node in graph_def.node:  # placed, as the runtime's graph is when Grappler sees it
        node.device = node.device or device
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph_def, graph=graph)
    fetch = meta.collection_def["train_op"].node_list.value
    fetch.extend([t.op.name for t in function.outputs]
                 + [op.name for op in graph.control_outputs])
    def optimize(level):
        config = config_pb2.ConfigProto()
        rewrite = config.graph_options.rewrite_options
        rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.MemOptType.Value(level)
        rewrite.min_graph_nodes = -1
        return tf_optimizer.OptimizeGraph(config, meta, cluster=cluster)
    plain = optimize("DEFAULT_MEM_OPT")
    base = {n.name: n for n in plain.node}
    out["batches"][str(batch)] = {"nodes_in": len(graph_def.node), "nodes_out": len(plain.node),
                                  "digest": digest(plain)[:16],
                                  "repeatable": digest(plain) == digest(optimize("DEFAULT_MEM_OPT"))}
    for level in spec["levels"]:
        g = optimize(level)
        nodes = {n.name: n for n in g.node}
        changed = sorted(k for k in nodes.keys() & base.keys()
                         if nodes[k].SerializeToString(deterministic=True)
                         != base[k].SerializeToString(deterministic=True))
        attrs = sorted({a for k in changed for a in set(nodes[k].attr) ^ set(base[k].attr)})
        out["levels"][level][str(batch)] = {
            "digest": digest(g)[:16], "added": len(nodes.keys() - base.keys()),
            "removed": len(base.keys() - nodes.keys()), "changed": len(changed),
            "attrs_differing": attrs}
    tf.keras.backend.clear_session()
out["repeatable"] = all(b["repeatable"] for b in out["batches"].values())
print("GROUPS " + json.dumps(out), flush=True)
"""


def graph_groups(model, batches, levels, timeout=1800):
    """Grappler's output for the model's train step at each of `batches`, for plain TF
    (DEFAULT_MEM_OPT) and each level: a digest of the GraphDef, and how the level's
    differs from plain TF's (nodes added, removed, changed; attributes differing)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    spec = {"model": model, "batches": list(batches), "levels": list(levels)}
    proc = subprocess.run([sys.executable, "-c", _GRAPH_GROUPS, HERE, json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("GROUPS "):
            return json.loads(line[len("GROUPS "):])
    raise RuntimeError(f"graph comparison for {model} failed (exit {proc.returncode}): "
                       f"{proc.stderr[-1500:]}")


# ---------------------------------------------------------------------------
# The parent: searches, timing, losses


def trial_config(name):
    """maxbatch's {"fields", "memory_optimization"} of a configuration."""
    if name == "tfmemopt":
        return {"fields": {}, "memory_optimization": None}
    if name.startswith("grappler_"):
        return {"fields": None, "memory_optimization": name[len("grappler_"):]}
    return {"fields": None, "memory_optimization": None}


def _check_option(name):
    """seed000.grappler_check's option for a configuration."""
    if name == "tfmemopt":
        return "TFMEMOPT"
    if name.startswith("grappler_"):
        return name[len("grappler_"):]
    return "DEFAULT_MEM_OPT"


def _grappler_verdict(name, trials):
    import seed000

    verdicts = [seed000.grappler_check(_check_option(name), t) for t in trials if t.ok]
    if not verdicts:
        return None
    return {"passed": all(ok for ok, _ in verdicts), "seen": verdicts[0][1],
            "trials_checked": len(verdicts)}


def _kwargs(model, name, batch_step, inter_op=0):
    return {"model": model, "peer": name, "batch_step": batch_step, "inter_op": inter_op}


def _trial_error(trial):
    text = trial.error or ""
    found = re.search(r"(?:PeerError|NotApplicable): (.*)", text)
    if found:
        return found.group(1).strip()
    return text.strip().splitlines()[0] if text.strip() else trial.status


def search(model, name, s, steps, log):
    """find_max_batch for one configuration; a trial that fails other than by running out
    of memory makes the configuration an error row (with that error)."""
    config = trial_config(name)
    row = {"peer": CONFIGS[name], "status": "ok"}
    grappler_log = name == BASELINE or name == "tfmemopt" or name.startswith("grappler_")
    try:
        result = maxbatch.find_max_batch(
            make_step, s["lo"] // s["batch_step"], s["hi"] // s["batch_step"],
            cap_mb=s["cap_mb"], steps=steps, use_tfmemopt=config["fields"] is not None,
            memory_optimization=config["memory_optimization"],
            step_kwargs=_kwargs(model, name, s["batch_step"]), grappler_log=grappler_log,
            **(config["fields"] or {}))
    except maxbatch.TrialError as err:
        result = err.result
        if (err.trial.error or "").startswith("NotApplicable:"):
            row.update(status="not_applicable", reason=_trial_error(err.trial))
        else:
            row.update(status="error", error=_trial_error(err.trial),
                       error_at_batch=err.trial.size * s["batch_step"])
    trials = result.trials if result else []
    step = s["batch_step"]
    row["max_batch"] = (result.max_batch * step if result and result.max_batch
                        and row["status"] == "ok" else None)
    row["min_failing_batch"] = (result.min_failing_batch * step
                                if result and result.min_failing_batch else None)
    row["trials"] = [{"batch": t.size * step, "status": t.status, "peak_mib":
                      round(t.peak_bytes / 2**20, 1) if t.peak_bytes else None}
                     for t in trials]
    if grappler_log:
        row["grappler_check"] = _grappler_verdict(name, trials)
    if row["status"] == "ok" and result.max_batch is None:
        row["notes"] = [f"not even batch {s['lo']} trains under {s['cap_mb']} MiB"]
    elif row["status"] == "ok" and result.min_failing_batch is None:
        row["notes"] = [f"batch {s['hi']} trains: the limit is above --hi"]
    log(f"  {name}: max_batch {row['max_batch']}"
        + (f" ERROR {row['error'][:200]}" if row["status"] == "error" else ""))
    return row


def check_same_graph(model, name, same_as, s, rows, log):
    """The row of a level whose graph is `same_as`'s: that row's figures, and one trial
    at lo (with TF's meta-optimizer log) which checks that the level reaches the graph."""
    config = trial_config(name)
    trial = maxbatch.run_trial(make_step, s["lo"] // s["batch_step"], cap_mb=s["cap_mb"],
                               steps=2, use_tfmemopt=False,
                               memory_optimization=config["memory_optimization"],
                               step_kwargs=_kwargs(model, name, s["batch_step"]),
                               grappler_log=True)
    row = {"peer": CONFIGS[name], "status": "same_graph_as", "same_graph_as": same_as,
           **{k: rows[same_as].get(k) for k in ("max_batch", "min_failing_batch")},
           "check_trial": {"batch": s["lo"], "status": trial.status},
           "grappler_check": _grappler_verdict(name, [trial])}
    if not trial.ok:
        row["error"] = _trial_error(trial)
    log(f"  {name}: same graph as {same_as}; trial at {s['lo']}: {trial.status}")
    return row


def level_groups(groups, levels):
    """{level config: the configuration with the same Grappler output at every batch
    compared} for the levels that need no search of their own: plain TF's group, then
    the first level of each other group."""
    batches = list(groups["batches"])
    key_of = {BASELINE: tuple(groups["batches"][b]["digest"] for b in batches)}
    same = {}
    for level in levels:
        key = tuple(groups["levels"][level][b]["digest"] for b in batches)
        name = f"grappler_{level}"
        match = next((n for n, k in key_of.items() if k == key), None)
        if match:
            same[name] = match
        else:
            key_of[name] = key
    return same


def time_peers(model, names, batch, s, rounds, log):
    """Step times at `batch` of each configuration, interleaved, and the losses of the
    first LOSS_STEPS steps (the warm-up). As tfmemopt.maxbatch.time_interleaved, with
    each configuration's own step_kwargs (time_interleaved takes one for all)."""
    ref = maxbatch.step_reference(make_step)
    step = s["batch_step"]
    workers = []
    try:
        for name in names:
            config = maxbatch._check_config(trial_config(name)["fields"] is not None,
                                            trial_config(name)["fields"] or {},
                                            trial_config(name)["memory_optimization"])
            worker = maxbatch._Worker(name, ref, batch // step, s["cap_mb"], LOSS_STEPS,
                                      config, _kwargs(model, name, step))
            workers.append(worker)
            worker.ready()
        live = [w for w in workers if w.first["status"] == "ok"]
        for _ in range(rounds):
            for worker in list(live):
                if not worker.run(1):
                    live.remove(worker)
        out = {}
        for worker in workers:
            timing = worker.timing()
            report = timing.report or {}
            out[worker.name] = {"status": timing.status, "step_s": timing.median_seconds,
                                "step_times": timing.step_times, "error": timing.error,
                                "losses": [v[0] for v in worker.first.get("outputs", [])],
                                "peak_mib": round(timing.peak_bytes / 2**20, 1)
                                if timing.peak_bytes else None,
                                "graph_changed": report.get("graph_changed")}
        log("  timing at batch %d: %s" % (batch, ", ".join(
            f"{n} {t['step_s']:.3f} s" if t["step_s"] else f"{n} {t['status']}"
            for n, t in out.items())))
        return out
    finally:
        for worker in workers:
            worker.close()


# Losses of a split step against plain TF's: relative tolerance (tests/test_split.py).
SPLIT_RTOL = 1e-5


def loss_trials(model, names, batch, s, inter_op, log, capped=True):
    """The first LOSS_STEPS losses of each configuration in its own interpreter, with
    `inter_op` inter-op threads, under the cap (or none: capped=False); {name: (losses,
    status, whether tfmemopt changed the graph, whether it split work along the
    batch)}."""
    out = {}
    for name in names:
        config = trial_config(name)
        trial = maxbatch.run_trial(make_step, batch // s["batch_step"],
                                   cap_mb=s["cap_mb"] if capped else None,
                                   steps=LOSS_STEPS, use_tfmemopt=config["fields"] is not None,
                                   memory_optimization=config["memory_optimization"],
                                   step_kwargs=_kwargs(model, name, s["batch_step"], inter_op),
                                   **(config["fields"] or {}))
        report = trial.report or {}
        out[name] = ([v[0] for v in trial.outputs], trial.status, report.get("graph_changed"),
                     bool((report.get("split") or {}).get("applied")))
    threads = f"{inter_op} inter-op thread(s)" if inter_op else "TF's default inter-op threads"
    log(f"  losses with {threads} at batch {batch}{'' if capped else ' without a cap'}: "
        + ", ".join(f"{n} {st}" for n, (_, st, _, _) in out.items()))
    return out


def _timing_batches(largest, step):
    """The batch to time at, and smaller ones in turn (90 %, 75 %, 50 %) if a timing
    worker runs out of memory: near the limit the peak moves with the executor's order
    (measured on the MLP under 96 MiB: a trial trained 2560, a timing worker then ran
    out of memory at 2048)."""
    sizes = [largest] + [int(largest * f) // step * step for f in (0.9, 0.75, 0.5)]
    return [b for i, b in enumerate(sizes) if b >= step and b not in sizes[:i]]


def _compared_batches(s, count=3):
    """Batches at which the Grappler levels' graphs are compared: lo, hi and geometric
    steps between (multiples of batch_step)."""
    lo, hi, step = s["lo"], s["hi"], s["batch_step"]
    points = {lo, hi}
    for k in range(1, count - 1):
        points.add(max(lo, round(lo * (hi / lo) ** (k / (count - 1)) / step) * step))
    return sorted(points)


def compare_losses(model, timed, timing, out, s, log):
    """The first LOSS_STEPS losses of each timed configuration and of a separate plain-TF
    run (the reference), at one batch: {name: (losses, status, graph_changed)}; sets
    out's loss_batch,
    reference_losses and loss_inter_op.

    The timed batch first, where the timing workers' warm-up steps gave each
    configuration's losses. Near the limit a fresh plain-TF process may run out of
    memory where the timing worker did not (the peak moves with the executor's order),
    so the batch steps down (_loss_batches) until the reference trains; below the timed
    batch every configuration's losses come from a trial of its own. If plain TF's
    losses differ from the reference's (TF not repeatable across processes with its
    default inter-op threads), all are taken again with one inter-op thread."""
    batch = out["timed_batch"]
    for loss_batch in _loss_batches(batch, s):
        reference, status, _, _ = loss_trials(model, [BASELINE], loss_batch, s, 0,
                                              log)[BASELINE]
        if status == "ok":
            break
        out["notes"].append(f"reference loss trial at batch {loss_batch}: {status}")
    else:
        out.update(loss_batch=None, reference_losses=[], loss_inter_op=None)
        out["notes"].append("plain TF's reference run did not train: losses not compared")
        return {name: ([], "not run", None, False) for name in timed}
    if loss_batch == batch:
        losses = {n: (timing[n]["losses"], "ok", timing[n]["graph_changed"], None)
                  for n in timed}
    else:
        losses = loss_trials(model, timed, loss_batch, s, 0, log)
    out.update(loss_batch=loss_batch, reference_losses=reference, loss_inter_op=None)
    if losses[BASELINE][0] != reference:
        out["notes"].append("plain TF's losses differ between two processes with TF's "
                            "default inter-op threads: losses compared with one inter-op "
                            "thread, in a process per configuration")
        out["losses_default_inter_op"] = {"reference": reference,
                                          **{n: v[0] for n, v in losses.items()}}
        out["loss_inter_op"] = 1
        out["reference_losses"] = loss_trials(model, [BASELINE], loss_batch, s, 1,
                                              log)[BASELINE][0]
        losses = loss_trials(model, timed, loss_batch, s, 1, log)
    return losses


def _loss_batches(batch, s, attempts=4):
    """The batch at which losses are compared: the timed batch, then 90 %, 75 %, 50 % of
    it (multiples of batch_step, at least lo)."""
    sizes = [batch] + [max(s["lo"], int(batch * f) // s["batch_step"] * s["batch_step"])
                       for f in (0.9, 0.75, 0.5)][:attempts - 1]
    return [b for i, b in enumerate(sizes) if b not in sizes[:i]]


def run_model(model, s, names, steps, rounds, log):
    """Everything for one model: (the run's settings and notes, {configuration: row})."""
    out = {**s, "notes": []}
    rows = {}
    levels = [n[len("grappler_"):] for n in names if n.startswith("grappler_")]
    same = {}
    if levels:
        try:
            groups = graph_groups(model, _compared_batches(s), levels)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            groups = {"repeatable": False, "error": str(err)[-1500:]}
            out["notes"].append(f"Grappler's graphs not compared ({str(err)[:200]}): "
                                f"every level searched")
        out["grappler_graphs"] = groups
        if "error" in groups:
            pass
        elif groups["repeatable"]:
            same = level_groups(groups, levels)
        else:
            out["notes"].append("Grappler's output for plain TF differed between two runs: "
                                "no level merged")
        log(f"  Grappler levels with the graph of another configuration: {same or 'none'}")
    order = [BASELINE] + [n for n in names if n != BASELINE]
    for name in order:
        if name not in same:
            rows[name] = search(model, name, s, steps, log)
    for name in order:
        if name in same:
            rows[name] = check_same_graph(model, name, same[name], s, rows, log)
    rows_in_order = {name: rows[name] for name in order}
    rows.clear()
    rows.update(rows_in_order)
    timed = [n for n in order if n not in same and rows[n]["status"] == "ok"
             and rows[n]["max_batch"]]
    if BASELINE not in timed:
        out["notes"].append("plain TF did not train: nothing timed")
        return out, _with_notes(rows)
    common = min(rows[n]["max_batch"] for n in timed)
    timing = None
    for batch in _timing_batches(common, s["batch_step"]):
        timing = time_peers(model, timed, batch, s, rounds, log)
        failed = [n for n, t in timing.items() if t["status"] != "ok"]
        if not failed:
            out["timed_batch"] = batch
            break
        out["notes"].append(f"timing at batch {batch}: {', '.join(failed)} failed "
                            f"({'; '.join(timing[n]['status'] for n in failed)})")
        timing = None
    if timing is None:
        out["timed_batch"] = None
        return out, _with_notes(rows)
    losses = compare_losses(model, timed, timing, out, s, log)
    base = timing[BASELINE]["step_s"]
    for name in timed:
        t = timing[name]
        got, status, changed, _ = losses[name]
        equal = None  # not compared: the configuration's loss trial failed
        if status == "ok" and out["reference_losses"]:
            equal = got == out["reference_losses"]
        elif status != "ok":
            rows[name].setdefault("notes", []).append(
                f"losses not compared: its loss trial at batch {out['loss_batch']}: {status}")
        rows[name].update(step_s=t["step_s"], step_ratio=t["step_s"] / base,
                          loss_equal=equal, losses=got, timed_peak_mib=t["peak_mib"],
                          step_times=t["step_times"])
        if name == "tfmemopt":
            rows[name]["graph_changed_at_timed_batch"] = t["graph_changed"]
            rows[name]["graph_changed_at_loss_batch"] = changed
    losses_beyond_plain(model, timed, rows, out, s, log)
    for name, same_as in same.items():
        rows[name].update({k: rows[same_as].get(k) for k in ("step_s", "step_ratio",
                                                              "loss_equal")})
    return out, _with_notes(rows)


def losses_beyond_plain(model, timed, rows, out, s, log):
    """loss_equal_at_max_batch: at the timed batch every configuration fits, so tfmemopt
    may leave the graph alone there (graph_changed_at_loss_batch). At a configuration's
    own max_batch, where plain TF runs out of memory under the cap, its first LOSS_STEPS
    losses under the cap are compared with plain TF's at that batch without a cap (the
    cap changes where memory comes from, not what is computed)."""
    plain_max = rows[BASELINE]["max_batch"]
    for name in timed:
        batch = rows[name]["max_batch"]
        if name == BASELINE or not batch or batch <= plain_max:
            continue
        inter_op = out.get("loss_inter_op") or 0
        got, status, changed, split = loss_trials(model, [name], batch, s, inter_op,
                                                  log)[name]
        ref, ref_status, _, _ = loss_trials(model, [BASELINE], batch, s, inter_op, log,
                                            capped=False)[BASELINE]
        ok = status == "ok" and ref_status == "ok"
        # Splitting (tfmemopt's last resort) sums weight gradients over micro-batches in
        # another order: its losses are compared within SPLIT_RTOL, not bit for bit.
        close = (ok and len(got) == len(ref) and
                 all(abs(a - b) <= SPLIT_RTOL * abs(b) for a, b in zip(got, ref)))
        rows[name].update(loss_equal_at_max_batch=(got == ref) if ok else None,
                          loss_close_at_max_batch=close if ok else None,
                          split_at_max_batch=split,
                          losses_at_max_batch=got, plain_uncapped_losses_at_max_batch=ref,
                          graph_changed_at_max_batch=changed)
        if not ok:
            rows[name].setdefault("notes", []).append(
                f"losses at max_batch {batch} not compared: {name} {status}, "
                f"plain TF without a cap {ref_status}")


def _with_notes(rows):
    """Each row's "note": one line saying what the row is when it is not a plain
    measurement (an error, a copied row, a search that did not bracket the limit)."""
    for row in rows.values():
        for key in ("max_batch", "step_s", "step_ratio", "loss_equal"):
            row.setdefault(key, None)  # not measured
        if row["status"] == "error":
            note = f"raises: {row.get('error', '')}"
        elif row["status"] == "same_graph_as":
            note = (f"same Grappler output as {SHORT[row['same_graph_as']]}: its figures "
                    f"(one trial checks that the level reaches the graph)")
        elif row["status"] == "not_applicable":
            note = f"not applicable: {row.get('reason', '')}"
        else:
            note = "; ".join(row.get("notes", []))
        row["note"] = note
    return rows


# ---------------------------------------------------------------------------
# Output


def _cell(row, key):
    value = row.get(key)
    if value is None:
        return "-"
    if key == "step_s":
        return f"{value:.3f}"
    if key == "step_ratio":
        return f"{value:.2f}x"
    if key == "loss_equal":
        return "yes" if value else "NO"
    return str(value)


def table(results):
    lines = []
    for model, rows in results["models"].items():
        run = results["runs"][model]
        lines.append(f"\n{model}: cap {run['cap_mb']} MiB, batches {run['lo']}..{run['hi']} "
                     f"step {run['batch_step']}, timed at batch {run.get('timed_batch')}, losses "
                     f"compared at batch {run.get('loss_batch')}"
                     + (" with 1 inter-op thread" if run.get("loss_inter_op") else ""))
        lines.append(f"  {'configuration':<28} {'max_batch':>9} {'step_s':>8} {'ratio':>7} "
                     f"{'loss_equal':>10}  note")
        for name, row in rows.items():
            lines.append(f"  {SHORT.get(name, name):<28} {_cell(row, 'max_batch'):>9} "
                         f"{_cell(row, 'step_s'):>8} {_cell(row, 'step_ratio'):>7} "
                         f"{_cell(row, 'loss_equal'):>10}  {row.get('note', '')[:150]}")
        for note in run["notes"]:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def _run_in_processes(args, settings, log):
    """--jobs: each model in a peers.py process of its own, args.jobs at a time; their
    lines are logged prefixed with the model. {model: (run, rows)} in settings' order."""
    import concurrent.futures

    def child(model):
        argv = [sys.executable, os.path.abspath(__file__), "--models", model, "--json",
                "--peers", *settings["peers"], "--steps", str(settings["steps"]),
                "--rounds", str(settings["rounds"])]
        argv += [a for key in ("cap_mb", "lo", "hi", "batch_step")
                 if getattr(args, key) is not None
                 for a in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
        if args.quick:
            argv.append("--quick")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        last = None
        for line in proc.stdout:
            if line.startswith("{"):
                last = line
            elif not line.startswith("partial "):
                log(f"[{model}] {line.rstrip()}")
        proc.wait()
        try:
            data = json.loads(last)
            return data["runs"][model], data["models"][model]
        except (TypeError, ValueError, KeyError) as err:
            return ({**MODEL_SETTINGS[model], "notes": [
                f"the run failed: its process exited {proc.returncode} without its JSON "
                f"({type(err).__name__})"]}, {})

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        done = dict(zip(settings["models"], pool.map(child, settings["models"])))
    return done


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODEL_SETTINGS),
                        help=f"models (default {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--peers", nargs="+", choices=list(CONFIGS),
                        help=f"configurations (default all; {BASELINE} is always included)")
    parser.add_argument("--cap-mb", type=int, help="CPU allocator cap in MiB (all models)")
    parser.add_argument("--lo", type=int, help="smallest batch searched (all models)")
    parser.add_argument("--hi", type=int, help="largest batch searched (all models)")
    parser.add_argument("--batch-step", type=int, help="batches searched are its multiples")
    parser.add_argument("--steps", type=int, help="training steps per search trial")
    parser.add_argument("--rounds", type=int, help="timed steps per configuration")
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON line, last")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small configuration for tests: {QUICK}")
    parser.add_argument("--jobs", type=int, default=1,
                        help="models run at the same time, each in a peers.py process of "
                             "its own (timing stays interleaved within a model)")
    parser.add_argument("--save", action="store_true",
                        help="write docs/results/peers.json (benchmarks/results.py)")
    args = parser.parse_args()
    settings = dict(DEFAULTS)
    overrides = {}
    if args.quick:
        settings.update({k: QUICK[k] for k in ("models", "peers", "steps", "rounds")})
        overrides = {k: QUICK[k] for k in ("cap_mb", "lo", "hi", "batch_step")}
    for key in ("models", "peers", "steps", "rounds"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    overrides.update({k: getattr(args, k) for k in ("cap_mb", "lo", "hi", "batch_step")
                      if getattr(args, k) is not None})
    names = [n for n in CONFIGS if n in settings["peers"] or n == BASELINE]

    def log(text):
        print(text, flush=True)

    results = {"models": {}, "runs": {}, "configs": {n: CONFIGS[n] for n in names},
               "settings": {**settings, "peers": names, "overrides": overrides,
                            "loss_steps": LOSS_STEPS}}
    for model in settings["models"]:
        s = {**MODEL_SETTINGS[model], **overrides}
        if s["lo"] % s["batch_step"] or s["hi"] % s["batch_step"] or s["lo"] > s["hi"]:
            parser.error(f"{model}: lo={s['lo']} and hi={s['hi']} must be multiples of "
                         f"batch_step={s['batch_step']} with lo <= hi")
    if args.jobs > 1 and len(settings["models"]) > 1:
        for model, (run, rows) in _run_in_processes(args, settings, log).items():
            results["runs"][model], results["models"][model] = run, rows
        settings["models"] = []
    for model in settings["models"]:
        s = {**MODEL_SETTINGS[model], **overrides}
        log(f"{model}: cap {s['cap_mb']} MiB, batches {s['lo']}..{s['hi']} "
            f"(multiples of {s['batch_step']}), {settings['steps']} steps per trial")
        try:
            run, rows = run_model(model, s, names, settings["steps"], settings["rounds"], log)
        except Exception as err:  # one model's failure does not lose the others'
            log(f"  {model}: the run failed: {type(err).__name__}: {err}")
            run = {**s, "notes": [f"the run failed: {type(err).__name__}: {str(err)[:500]}"]}
            rows = {}
        results["runs"][model], results["models"][model] = run, rows
        if args.json:
            # What is measured so far, should a long run be stopped: a line that is not
            # the final JSON object (it starts with "partial ").
            print("partial " + json.dumps(results), flush=True)
    print(table(results), flush=True)
    if args.save:
        import results as result_files

        path = result_files.save("peers", results)
        print(f"saved {path}", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
