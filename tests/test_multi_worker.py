"""Multi-worker training: each worker process calls tfmemopt.enable() first, as the
first lines of a script do, then builds TF's multi-worker strategy; each worker plans
its own replica graph, and the losses equal those of the same run without tfmemopt,
bit for bit.

MultiWorkerMirroredStrategy runs as two worker processes on localhost (TF_CONFIG, free
ports), with the custom training loop of TF's multi-worker tutorial (strategy.run in a
tf.function). ParameterServerStrategy runs in one process: TF's in-process cluster
(two workers and a parameter server as tf.distribute.Server objects) and a
ClusterCoordinator.
"""

import inspect
import json
import os
import socket
import subprocess
import sys

from conftest import subprocess_result

# The MLP is wide enough that its activations (2048 x 256 floats, 2 MiB, per replica)
# are over the 5 MiB budget together, so the pass really rewrites the replica graph.
MODEL = r'''
import json, os, socket, sys
import numpy as np
import tensorflow as tf
USE = sys.argv[1] == "1"
if USE:
    import tfmemopt
    tfmemopt.enable(budget="5MiB", log_level=0, min_tensor_bytes=0)

def build_model():
    tf.keras.utils.set_random_seed(0)
    layers = [tf.keras.Input((32,))]
    layers += [tf.keras.layers.Dense(256, activation="relu") for _ in range(3)]
    layers += [tf.keras.layers.Dense(10)]
    return tf.keras.Sequential(layers), tf.keras.optimizers.SGD(0.1)

def replica_step(model, opt, global_batch):
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step

def finish(losses):
    out = {"losses": [float(l).hex() for l in losses]}
    if USE:
        out["reports"] = [{"graph_id": r.graph_id, "status": r.status,
                           "changed": r.graph_changed, "nodes": r.num_nodes}
                          for r in tfmemopt.reports()
                          if r.graph_id.startswith("__inference_train_step")]
    print("RESULT " + json.dumps(out), flush=True)
'''

MULTI_WORKER = MODEL + r'''
strategy = tf.distribute.MultiWorkerMirroredStrategy()
GLOBAL_BATCH = 4096
with strategy.scope():
    model, opt = build_model()
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
rng = np.random.default_rng(index)
x = tf.constant(rng.standard_normal((GLOBAL_BATCH // 2, 32), dtype=np.float32))
y = tf.constant(rng.integers(0, 10, GLOBAL_BATCH // 2, dtype=np.int32))
step = replica_step(model, opt, GLOBAL_BATCH)

@tf.function
def train_step(x, y):
    per_replica = strategy.run(step, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

finish([train_step(x, y) for _ in range(3)])
'''


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# The in-process cluster picks its ports the way the test picks the workers'.
PARAMETER_SERVER = MODEL + inspect.getsource(_free_ports) + r'''
p = _free_ports(3)
spec = tf.train.ClusterSpec({"worker": [f"localhost:{p[0]}", f"localhost:{p[1]}"],
                             "ps": [f"localhost:{p[2]}"]})
servers = [tf.distribute.Server(spec, job_name="worker", task_index=i, start=True)
           for i in range(2)]
servers.append(tf.distribute.Server(spec, job_name="ps", task_index=0, start=True))
strategy = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc"))
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    model, opt = build_model()
rng = np.random.default_rng(0)
xs = rng.standard_normal((2048, 32), dtype=np.float32)
ys = rng.integers(0, 10, 2048, dtype=np.int32)
step = replica_step(model, opt, 2048)

@tf.function
def train_step():
    return strategy.run(step, args=(tf.constant(xs), tf.constant(ys)))

losses = []
for _ in range(3):
    result = coordinator.schedule(train_step)
    coordinator.join()
    losses.append(result.fetch())
finish(losses)
os._exit(0)  # the in-process servers have no clean shutdown
'''


def _run_two_workers(use_tfmemopt):
    cluster = {"worker": [f"localhost:{port}" for port in _free_ports(2)]}
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", MULTI_WORKER, "1" if use_tfmemopt else "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:  # a worker that waits for a dead peer would wait forever
            if proc.poll() is None:
                proc.kill()
    results = []
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
        results.append(subprocess_result(
            subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)))
    return results


def test_multi_worker_mirrored_each_worker_plans_its_replica_graph_losses_bitwise_equal():
    without = _run_two_workers(use_tfmemopt=False)
    with_pass = _run_two_workers(use_tfmemopt=True)
    for worker, (plain, planned) in enumerate(zip(without, with_pass)):
        assert planned["losses"] == plain["losses"], f"worker {worker}"
        # One report per worker, for the replica graph it built, and the plan changed it.
        (report,) = planned["reports"]
        assert report["status"] == "ok" and report["changed"], report
    # The two reports come from two processes: each worker planned its own graph.
    assert with_pass[0]["losses"] == with_pass[1]["losses"]  # all-reduced loss


def test_parameter_server_strategy_in_process_losses_bitwise_equal():
    runs = []
    for use in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", PARAMETER_SERVER, use],
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(subprocess_result(proc))
    plain, planned = runs
    assert planned["losses"] == plain["losses"]
    # The coordinator's function is instantiated on each worker that runs it; every
    # instance was planned and rewritten.
    assert planned["reports"], planned
    assert all(r["status"] == "ok" and r["changed"] for r in planned["reports"])
