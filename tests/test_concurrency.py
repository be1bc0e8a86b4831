"""Concurrency: four threads trace and run four different tf.functions at once with
tfmemopt enabled (each under a budget that makes the pass recompute). No crash; each
graph gets its own report (by graph id), the same one as when the functions run one
after another; and the results are bitwise equal to the sequential runs.

In a subprocess with one inter-op thread, so that TF itself is deterministic; the
threaded part runs three rounds of fresh functions.
"""

import pytest

from conftest import run_python, subprocess_result

SCRIPT = r'''
import hashlib, json, sys, threading
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
import tfmemopt

BATCH = 512


def make(kind, seed):
    """A fresh train step of one of four models, with fresh variables."""
    rng = np.random.default_rng(seed)
    # Activations, not the weight gradients that the chained updates hold together,
    # make each MLP's peak, so recomputation lowers it.
    width, depth = {"mlp_narrow": (256, 10), "mlp_wide": (384, 8), "mlp_deep": (256, 16),
                    "cnn": (0, 0)}[kind]
    x_rng = np.random.default_rng(100 + seed)
    if kind == "cnn":
        ws = [tf.Variable(rng.standard_normal(s, dtype=np.float32) * 0.1)
              for s in [(3, 3, 3, 16), (3, 3, 16, 16), (3, 3, 16, 16), (16, 10)]]
        x = tf.constant(x_rng.random((64, 32, 32, 3), dtype=np.float32))

        def forward(x):
            h = x
            for w in ws[:3]:
                h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
            return tf.matmul(tf.reduce_mean(h, axis=[1, 2]), ws[3])
    else:
        ws = [tf.Variable((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
              for _ in range(depth)]
        x = tf.constant(x_rng.standard_normal((BATCH, width), dtype=np.float32))

        def forward(x):
            h = x
            for w in ws:
                h = tf.nn.relu(tf.matmul(h, w))
            return h

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(x)))
        grads = tape.gradient(loss, ws)
        for w, g in zip(ws, grads):
            w.assign_sub(0.05 * g)
        return loss
    step.__name__ = f"step_{kind}"
    return tf.function(step), x, ws


KINDS = ["mlp_narrow", "mlp_wide", "mlp_deep", "cnn"]


def run(kind, seed):
    step, x, ws = make(kind, seed)
    losses = [float(step(x)) for _ in range(3)]
    name = step.get_concrete_function(x).name
    return {"losses": losses,
            "weights": [hashlib.sha256(w.numpy().tobytes()).hexdigest() for w in ws],
            "graph_id": name.decode() if isinstance(name, bytes) else name}


def report_of(graph_id):
    found = [r for r in tfmemopt.reports() if r.graph_id == graph_id]
    if len(found) != 1:
        return {"count": len(found)}
    r = found[0]
    return {"count": 1, "status": r.status, "num_nodes": r.num_nodes,
            "recomputed": sorted(r.recomputed_ops), "peaks": r.predicted_peak_bytes,
            "budget": r.budget_bytes}


tfmemopt.enable(budget=int(sys.argv[1]), min_tensor_bytes=65536, enable_swap=False,
                enable_split=False, log_level=0)
sequential = {}
for kind in KINDS:
    result = run(kind, 0)
    result["report"] = report_of(result["graph_id"])
    sequential[kind] = result

rounds = []
for round_ in range(3):
    barrier = threading.Barrier(len(KINDS))
    results, errors = {}, []

    def worker(kind):
        try:
            barrier.wait()
            results[kind] = run(kind, 0)
        except Exception as err:  # reported, not swallowed
            errors.append(f"{kind}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in KINDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for kind, result in results.items():
        result["report"] = report_of(result["graph_id"])
    rounds.append({"results": results, "errors": errors})
print("RESULT " + json.dumps({"sequential": sequential, "rounds": rounds}))
'''

# 6 MiB: below every model's predicted peak, so the pass recomputes in each.
BUDGET = 6 * 2**20


@pytest.fixture(scope="module")
def runs():
    proc = run_python(SCRIPT, BUDGET, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=900)
    return subprocess_result(proc)


KINDS = ["mlp_narrow", "mlp_wide", "mlp_deep", "cnn"]


def test_sequential_runs_recompute_in_every_graph(runs):
    for kind in KINDS:
        report = runs["sequential"][kind]["report"]
        assert report["count"] == 1 and report["status"] == "ok", (kind, report)
        assert report["recomputed"], kind


@pytest.mark.parametrize("round_", range(3))
def test_four_threads_at_once_get_their_own_reports_and_equal_results(runs, round_):
    threaded = runs["rounds"][round_]
    assert threaded["errors"] == []
    assert sorted(threaded["results"]) == sorted(KINDS)
    graph_ids = {r["graph_id"] for r in threaded["results"].values()}
    assert len(graph_ids) == 4
    for kind in KINDS:
        alone, mine = runs["sequential"][kind], threaded["results"][kind]
        assert mine["graph_id"] != alone["graph_id"]  # a fresh trace, its own graph
        assert mine["losses"] == alone["losses"], kind
        assert mine["weights"] == alone["weights"], kind
        # Exactly one report for the graph, the same as the sequential run's.
        assert mine["report"] == alone["report"], kind
