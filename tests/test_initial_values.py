"""A TF1 Session keeps a variable's Const initial value after the variable's first
update (grappler/analyze/initial_values.h): the model counts it as persistent memory,
and the count matches what TF's allocator holds between steps."""

import functools
import json

from conftest import capped_allocator_env, run_python

_SESSION = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tfmemopt
from tfmemopt import _eager_context

v1 = tf.compat.v1
tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
graph = tf.Graph()
with graph.as_default():
    x = v1.placeholder(tf.float32, [64, 1024], name="x")
    w = v1.get_variable("w", [1024, 1024], initializer=v1.glorot_uniform_initializer(seed=0))
    b = v1.get_variable("b", [1024], initializer=v1.zeros_initializer())
    loss = tf.reduce_sum(tf.square(tf.matmul(x, w) + b))
    optimizer = (v1.train.AdamOptimizer(1e-3) if sys.argv[1] == "adam"
                 else v1.train.MomentumOptimizer(0.01, 0.9))
    train = optimizer.minimize(loss)
    init = v1.global_variables_initializer()
config = v1.ConfigProto()
config.graph_options.rewrite_options.CopyFrom(_eager_context.current_rewrite_options())
session = v1.Session(graph=graph, config=config)
in_use = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]
session.run(init)
after_init = in_use()
feed = {x: np.ones((64, 1024), np.float32)}
steps = []
for _ in range(3):
    session.run([loss, train], feed)
    steps.append(in_use())
report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)
device = report.to_dict()["devices"][0]
print(json.dumps({"after_init": after_init, "after_steps": steps,
                  "persistent": report.persistent_bytes["CPU:0"],
                  "histories": device["allocator_history_peaks"],
                  "observed_pool_bytes": device["observed_pool_bytes"],
                  "worst": device["allocator_history"], "text": report.to_text()}))
"""

KIB, MIB = 1 << 10, 1 << 20
VARIABLES = 4 * MIB + 4 * KIB  # w [1024, 1024] and b [1024], float32
SLOTS = 4 * MIB + 4 * KIB      # Momentum's accumulators, zeros-initialized
ZERO_INITIALIZED = 4 * KIB + SLOTS  # b and the accumulators: a Const each


ENV = capped_allocator_env(1024, TF_CPP_MIN_LOG_LEVEL="2")


@functools.lru_cache(maxsize=None)
def _run(optimizer):
    proc = run_python(_SESSION, optimizer, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_session_holds_const_initial_values_after_the_first_update_and_the_model_counts_them():
    r = _run("momentum")
    # TF: the initializer leaves the variables; every step after the first update
    # leaves, besides, the Consts that the zero-initialized ones shared a buffer
    # with (and the step's own Consts, such as the folded gradient of the sum).
    assert abs(r["after_init"] - (VARIABLES + SLOTS)) < 64 * KIB, r
    assert min(r["after_steps"]) == max(r["after_steps"]), r
    assert r["after_steps"][0] - r["after_init"] >= ZERO_INITIALIZED, r
    # The model: the same bytes, as persistent memory of the training step.
    assert abs(r["persistent"] - r["after_steps"][0]) < 64 * KIB, r


def test_variables_initialized_from_one_const_hold_it_once():
    """Adam's two slots of a weight start from identical zeros, which Grappler merges
    into one Const: after the first step TF holds that Const once, and so does the
    model (counting it per variable would add another 4 MiB)."""
    r = _run("adam")
    # w, b, and Adam's m and v of each (4 MiB + 4 KiB apiece), two step counters
    # (beta1_power, beta2_power) and the step's own Consts.
    assert abs(r["persistent"] - r["after_steps"][-1]) < 64 * KIB, r


def test_a_session_whose_initializer_the_pass_saw_starts_from_the_pool_as_it_is():
    """The variables of a tf.function reach its graph as arguments, made eagerly in an
    order the graph does not tell, so the allocator model replays four histories and
    keeps the worst (tests/test_memory_model.py). A Session's variables are made by
    its initializer graph, which ran in this process before the step: the pass reads
    the CPU test bed's pool as that left it (the regions its initial values grew
    included) and starts the model from it, the one history there is
    (docs/allocator.md)."""
    r = _run("momentum")
    assert list(r["histories"]) == ["observed"], r["histories"]
    assert r["worst"] == "observed"
    assert r["observed_pool_bytes"] >= r["after_init"] > 0
    assert r["histories"]["observed"] >= r["persistent"] > 0
    assert "(BFC allocator model, allocator history: observed)" in r["text"], r["text"]
