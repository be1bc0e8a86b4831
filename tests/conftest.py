"""Shared builders for the tfmemopt specification tests."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
# TF 2.21 turns its oneDNN kernels on by default only on CPUs with AVX-512 VNNI, BF16
# or AMX; elsewhere its own kernels run, with other scratch memory (docs/allocator.md
# #kernels-that-start-together), and the memory figures the tests assert were taken
# with oneDNN. The suite pins it on, for itself and the processes it starts, so that
# the same kernels run on every x86 CPU; a test about the other kernels sets it off.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmemopt  # noqa: E402

BATCH = 64
FEATURES = 784
HIDDEN = 512
CLASSES = 10


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts with the pass disabled and no reports."""
    tfmemopt.disable()
    tfmemopt.clear_reports()
    yield
    tfmemopt.disable()
    tfmemopt.clear_reports()


def mlp_variables(seed=0):
    rng = np.random.default_rng(seed)
    w1 = tf.Variable(rng.standard_normal((FEATURES, HIDDEN), dtype=np.float32) * 0.05)
    w2 = tf.Variable(rng.standard_normal((HIDDEN, CLASSES), dtype=np.float32) * 0.05)
    return [w1, w2]


def mlp_batch(seed=1, batch=BATCH):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal((batch, FEATURES), dtype=np.float32))
    y = tf.constant(rng.integers(0, CLASSES, size=(batch,), dtype=np.int32))
    return x, y


def make_mlp_train_step(variables, input_signature=None):
    """A fresh tf.function (so it is traced, and optimized, on first call)."""
    w1, w2 = variables

    @tf.function(input_signature=input_signature)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            hidden = tf.nn.relu(tf.matmul(x, w1))
            logits = tf.matmul(hidden, w2)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )
        grads = tape.gradient(loss, [w1, w2])
        for var, grad in zip([w1, w2], grads):
            var.assign_sub(0.1 * grad)
        return loss, grads

    return train_step


def build_v1_mlp_train_op():
    """In the current (v1) graph: placeholders x, y and an SGD train op."""
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [BATCH], name="y")
    w1, w2 = mlp_variables()
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return x, y, tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def run_mlp_steps(steps=3, **step_kwargs):
    """Losses and final weights of a few SGD steps from a fixed start."""
    variables = mlp_variables()
    step = make_mlp_train_step(variables, **step_kwargs)
    x, y = mlp_batch()
    losses = [step(x, y)[0].numpy() for _ in range(steps)]
    return np.array(losses), [v.numpy() for v in variables]


def reports_for(prefix):
    """Reports whose graph id starts with `prefix` (e.g. '__inference_train_step')."""
    return [r for r in tfmemopt.reports() if r.graph_id.startswith(prefix)]


def _run(argv, env=None, timeout=600):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout)


def run_python(code, *args, env=None, timeout=600):
    """Runs `code` with `args` in a fresh interpreter (for settings that must precede
    TF start)."""
    return _run([sys.executable, "-c", code, *map(str, args)], env, timeout)


def subprocess_result(proc, only=False):
    """The JSON after "RESULT " on the last line of `proc`'s stdout that starts so (a
    script run by run_python prints its result that way, among whatever else it logs);
    with `only`, that line must be the only one. Fails with the exit code and the tails
    of stderr and stdout when there is none (or, with `only`, more than one)."""
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines and not (only and len(lines) > 1), (
        f"{len(lines)} RESULT lines, exit code {proc.returncode}\n"
        f"stderr: {proc.stderr[-3000:]}\nstdout: {proc.stdout[-1000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def capped_allocator_env(mb, **extra):
    """Env vars for a subprocess on TF's BFC CPU allocator capped at `mb` MiB, plus
    `extra` (strings, e.g. TF_CPP_MIN_LOG_LEVEL="2")."""
    return {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(mb), **extra}


def tfmemopt_cli(*args, env=None, timeout=600):
    """Runs `python -m tfmemopt ARGS...` in a fresh interpreter."""
    return _run([sys.executable, "-m", "tfmemopt", *map(str, args)], env, timeout)


BATCH_MLP, WIDTH_MLP = 1024, 256  # one activation of chain_mlp: 1 MiB, the default min_tensor_bytes


def chain_mlp(depth=12, seed=0, hinted=(), dropout=None):
    """A `depth`-layer ReLU MLP trained with SGD, layer i under name scope layer_i;
    layers in `hinted` are built in tfmemopt.recompute_scope(). Returns (step, x,
    variables)."""
    rng = np.random.default_rng(seed)
    ws = [tf.Variable(rng.standard_normal((WIDTH_MLP, WIDTH_MLP), dtype=np.float32) * 0.08)
          for _ in range(depth)]
    x = tf.constant(rng.standard_normal((BATCH_MLP, WIDTH_MLP), dtype=np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for i, w in enumerate(ws):
                with tf.name_scope(f"layer_{i}"):
                    if i in hinted:
                        with tfmemopt.recompute_scope():
                            h = tf.nn.relu(tf.matmul(h, w))
                    else:
                        h = tf.nn.relu(tf.matmul(h, w))
                    if dropout is not None:
                        h = tf.nn.dropout(h, rate=dropout, seed=i)
            loss = tf.reduce_mean(tf.square(h))
        grads = tape.gradient(loss, ws)
        for w, g in zip(ws, grads):
            w.assign_sub(0.1 * g)
        return loss

    return step, x, ws


def optimize(step, *args, cluster=None, placement=None, memory_optimization=None, **fields):
    """The step's graph after TF's meta-optimizer with TfMemOpt (two iterations, as
    when TF builds the function), and the pass's report. `placement` (a device name)
    places every node there first; `memory_optimization` sets TF's own option."""
    from tensorflow.python.grappler import cluster as grappler_cluster
    from tensorflow.python.grappler import tf_optimizer
    from tfmemopt.analysis import metagraph_of

    metagraph = metagraph_of(step.get_concrete_function(*args))
    if placement:
        for node in metagraph.graph_def.node:
            node.device = placement
    config = tfmemopt.config_proto(log_level=0, **fields)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    if memory_optimization:
        config.graph_options.rewrite_options.memory_optimization = getattr(
            config.graph_options.rewrite_options, memory_optimization)
    before = len(tfmemopt.reports())
    graph = tf_optimizer.OptimizeGraph(
        config, metagraph,
        cluster=cluster or grappler_cluster.Cluster(disable_detailed_stats=True))
    report = [r for r in tfmemopt.reports()[before:] if r.graph_id == "graph_to_optimize"][-1]
    return graph, report


def peak_before(step, *args):
    """The pass's predicted peak of the step's graph as it is (CPU:0)."""
    report = tfmemopt.analyze(step, *args, mode="ANALYZE_ONLY")
    return report.predicted_peak_bytes["before"]["CPU:0"]


def train(step, x, ws, steps=3):
    """Losses of `steps` steps and the final weights."""
    losses = [step(x).numpy() for _ in range(steps)]
    return losses, [w.numpy() for w in ws]


def readers_of(graph, data_only=False):
    """{node name: names of the nodes that read it (data or control; data only with
    data_only)}."""
    readers = {}
    for node in graph.node:
        for i in node.input:
            if data_only and i.startswith("^"):
                continue
            readers.setdefault(i.lstrip("^").split(":")[0], []).append(node.name)
    return readers


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

SUBPROCESS_TRAIN = r'''
import json, sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)  # TF itself races otherwise
sys.path.insert(0, sys.argv[1])
import tfmemopt
from models import MODELS
name, fields = sys.argv[2], json.loads(sys.argv[3])
if fields:
    tfmemopt.enable(log_level=0, **fields)
tf.keras.utils.set_random_seed(0)
step, (x, y) = MODELS[name](**json.loads(sys.argv[4]))
losses = [float(step(x, y)) for _ in range(3)]
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")]
last = reports[-1] if reports else None
print("RESULT " + json.dumps({"losses": losses, "peak": peak,
      "recomputed": last.recomputed_ops if last else [],
      "swapped": last.swap.get("tensors", []) if last else [],
      "before": last.predicted_peak_bytes["before"]["CPU:0"] if last else 0,
      "after": last.predicted_peak_bytes["after"]["CPU:0"] if last else 0,
      "host": tfmemopt.host_memory_stats()}))
'''


def train_in_subprocess(name, fields, model_kwargs, cap_mb=2048):
    """Trains a benchmark model for 3 steps on the capped BFC allocator in a fresh
    interpreter (one inter-op thread: TF's own results vary run to run otherwise)."""
    proc = run_python(
        SUBPROCESS_TRAIN, BENCHMARKS, name, json.dumps(fields), json.dumps(model_kwargs),
        env=capped_allocator_env(cap_mb, TF_CPP_MIN_LOG_LEVEL="2"))
    return subprocess_result(proc)
