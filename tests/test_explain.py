"""No silent no-ops: where Grappler never runs the pass, the user is told once, and
tfmemopt.explain() says for the calling thread whether the pass is on, with which
config, which graphs it optimized and which graph functions it never saw, and why."""

import threading

import pytest

import tensorflow as tf

import tfmemopt
from conftest import reports_for, run_mlp_steps, run_python


def test_explain_follows_enable_and_disable_in_the_calling_thread():
    assert not tfmemopt.explain().in_this_thread
    tfmemopt.enable("1GiB", log_level=0)
    run_mlp_steps(steps=1)
    explanation = tfmemopt.explain()
    assert explanation.enabled and explanation.in_this_thread
    assert explanation.config == {"budget_bytes": 2**30, "log_level": 0}
    tfmemopt.enable(0.6, log_level=0)  # a float32 in the config, shown as given
    assert tfmemopt.explain().config["budget_fraction"] == 0.6
    assert "budget_fraction=0.6," in str(tfmemopt.explain())
    tfmemopt.enable("1GiB", log_level=0)
    assert explanation.grappler["meta_optimizer"] is True
    assert explanation.grappler["min_graph_nodes"] == 4
    (graph,) = [g for g in explanation.graphs if g["graph_id"].startswith("__inference_train_step")]
    assert graph["status"] == "ok" and graph["fits"] is True
    text = str(explanation)
    assert "tfmemopt in this thread: on" in text and graph["graph_id"] in text
    seen = []
    thread = threading.Thread(target=lambda: seen.append(tfmemopt.explain()))
    thread.start()
    thread.join()
    assert seen[0].in_this_thread  # every thread's graph functions get the pass
    tfmemopt.disable()
    assert "tfmemopt in this thread: off" in str(tfmemopt.explain())


def test_a_tiny_graph_function_is_listed_with_grapplers_reason():
    tfmemopt.enable("1GiB", log_level=0)
    tiny = tf.function(lambda: tf.constant(1.0))
    tiny()
    name = tiny.get_concrete_function().function_def.signature.name
    assert tfmemopt.explain().not_seen[name] == (
        "3 nodes, below Grappler's min_graph_nodes (4)")
    # Grappler agrees: the pass never ran on it (Const, Identity and the _Retval).
    assert not [r for r in tfmemopt.reports() if r.graph_id == name]


_NO_OP = r'''
import tensorflow as tf, tfmemopt
tfmemopt.enable("1GiB", log_level=0)
CASE = "{case}"
if CASE == "xla":
    @tf.function(jit_compile=True)
    def step(x):
        return tf.reduce_sum(tf.tanh(x) * 2.0 + 1.0)
    for _ in range(3):
        step(tf.ones([8, 8]))
    name = step.get_concrete_function(tf.ones([8, 8])).function_def.signature.name
    print("REASON", tfmemopt.explain().not_seen.get(name))
    print("REPORTS", len([r for r in tfmemopt.reports() if r.graph_id == name]))
elif CASE == "meta_optimizer_off":
    tf.config.optimizer.set_experimental_options({{"disable_meta_optimizer": True}})
    @tf.function
    def step(x):
        return tf.reduce_sum(tf.tanh(x) * 2.0 + 1.0)
    step(tf.ones([8, 8]))
    print("REASON", list(tfmemopt.explain().not_seen.values()))
    print("REPORTS", len(tfmemopt.reports()))
elif CASE == "functions_run_eagerly":
    tf.config.run_functions_eagerly(True)
    @tf.function
    def step(x):
        return tf.reduce_sum(tf.tanh(x) * 2.0 + 1.0)
    @tf.function
    def other(x):
        return tf.reduce_sum(tf.tanh(x) * 3.0 + 1.0)
    for _ in range(3):
        step(tf.ones([8, 8])), other(tf.ones([8, 8]))
    print("REASON", tfmemopt.explain().not_seen.get("step"))
    print("EAGER", tfmemopt.explain().grappler["functions_run_eagerly"])
    print("REPORTS", len(tfmemopt.reports()))
    tf.config.run_functions_eagerly(False)
    step(tf.ones([8, 8]))
    print("AFTER", len([r for r in tfmemopt.reports()
                        if r.graph_id.startswith("__inference_step")]))
elif CASE == "interactive_session":
    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.InteractiveSession(config=tfmemopt.config_proto("1GiB")).close()
    tf.compat.v1.InteractiveSession(config=tfmemopt.config_proto("1GiB")).close()
elif CASE == "nested_xla":
    # What Keras fit does with compile(jit_compile=True): a plain tf.function calls
    # the XLA-compiled step.
    w = tf.Variable(tf.ones([64, 64]) * 0.01)
    @tf.function(jit_compile=True)
    def xla_step(x):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.tanh(x @ w))
        w.assign_sub(0.01 * t.gradient(loss, w))
        return loss
    @tf.function
    def outer(x):
        return xla_step(x) + 1.0
    for _ in range(3):
        outer(tf.ones([32, 64]))
    callee = xla_step.get_concrete_function(tf.ones([32, 64])).function_def.signature.name
    caller = outer.get_concrete_function(tf.ones([32, 64])).function_def.signature.name
    explanation = tfmemopt.explain()
    (graph,) = [g for g in explanation.graphs if g["graph_id"] == caller]
    print("CALLEE", callee)
    print("XLA_CALLS", graph["xla_calls"] == [callee])
    print("REASON", explanation.not_seen.get(callee))
    print("TEXT", [line for line in str(explanation).splitlines() if caller + ":" in line])
elif CASE == "session_without_pass":
    tf.compat.v1.disable_eager_execution()
    user = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    tf.compat.v1.Session(config=user).close()
    tf.compat.v1.Session().close()
    print("WITHOUT", tfmemopt.explain().sessions_without_pass)
    tf.compat.v1.Session(config=tfmemopt.config_proto("1GiB", base=user)).close()
    print("WITH", tfmemopt.explain().sessions_without_pass)
    print("TEXT", str(tfmemopt.explain()).splitlines()[-1])
elif CASE == "session_not_enabled":
    tfmemopt.disable()
    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.Session().close()
elif CASE == "meta_optimizer_off_base":
    base = tf.compat.v1.ConfigProto()
    base.graph_options.rewrite_options.disable_meta_optimizer = True
    config = tfmemopt.config_proto("1GiB", base=base)
    print("KEPT", config.graph_options.rewrite_options.disable_meta_optimizer)
elif CASE == "min_graph_nodes_raised":
    tf.config.optimizer.set_experimental_options({{"min_graph_nodes": 1000}})
    w = tf.Variable(tf.ones([8, 8]))
    @tf.function
    def step(x):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.tanh(x @ w))
        return t.gradient(loss, w)
    @tf.function
    def helper(x):
        return tf.reduce_sum(tf.tanh(x @ w)) * 2.0
    for _ in range(3):
        step(tf.ones([8, 8])), helper(tf.ones([8, 8]))
    print("REPORTS", len(tfmemopt.reports()))
elif CASE == "pruned_base":
    base = tf.compat.v1.ConfigProto()
    base.graph_options.place_pruned_graph = True
    tfmemopt.config_proto("1GiB", base=base)
'''


def _stderr_and_stdout(case):
    proc = run_python(_NO_OP.format(case=case), env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr, proc.stdout


def test_xla_function_is_told_once_and_listed():
    err, out = _stderr_and_stdout("xla")
    assert err.count("is compiled with XLA (jit_compile=True)") == 1, err[-2000:]
    assert "REASON compiled with XLA (jit_compile=True), which bypasses Grappler" in out
    assert "REPORTS 0" in out


def test_grappler_switched_off_is_told():
    err, out = _stderr_and_stdout("meta_optimizer_off")
    assert "Grappler is disabled (disable_meta_optimizer is set)" in err, err[-2000:]
    assert "REASON ['Grappler is disabled (disable_meta_optimizer)']" in out
    assert "REPORTS 0" in out


def test_functions_run_eagerly_is_told_once_and_the_pass_acts_once_it_is_off():
    err, out = _stderr_and_stdout("functions_run_eagerly")
    assert err.count("runs eagerly because tf.config.run_functions_eagerly(True)") == 1, \
        err[-2000:]
    assert ("REASON runs eagerly (tf.config.run_functions_eagerly(True)), so no graph "
            "is built") in out, out
    assert "EAGER True" in out and "REPORTS 0" in out, out
    assert "AFTER 1" in out, out


KERAS_RUN_EAGERLY = r"""
import sys
if sys.argv[1] == "keras_first":
    import keras
import tensorflow as tf, tfmemopt
import keras
import numpy as np
tfmemopt.enable("1GiB", log_level=0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(4)], name="tiny_mlp")
x, y = np.ones((64, 16), np.float32), np.zeros((64,), np.int32)
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              run_eagerly=True)
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
print("REASON", tfmemopt.explain().not_seen.get("Keras model tiny_mlp"))
print("REPORTS", len([r for r in tfmemopt.reports() if "step_on_" in r.graph_id]))
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
print("AFTER", len([r for r in tfmemopt.reports() if "step_on_" in r.graph_id]))
"""


@pytest.mark.parametrize("order", ["tfmemopt_first", "keras_first"])
def test_keras_run_eagerly_is_told_once_and_the_pass_acts_once_it_is_off(order):
    proc = run_python(KERAS_RUN_EAGERLY, order, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err, out = proc.stderr, proc.stdout
    assert err.count("Keras model tiny_mlp is compiled with run_eagerly=True") == 1, \
        err[-2000:]
    assert ("REASON compiled with run_eagerly=True: Keras runs its steps as Python, so no "
            "graph is built") in out, out
    assert "REPORTS 0" in out and "AFTER 1" in out, out


def test_interactive_session_is_told_once():
    err, _ = _stderr_and_stdout("interactive_session")
    assert err.count("InteractiveSession always does") == 1, err[-2000:]


def test_config_proto_warns_when_its_base_prunes_the_graph():
    err, _ = _stderr_and_stdout("pruned_base")
    assert "base sets graph_options.place_pruned_graph=True" in err, err[-2000:]


def test_an_xla_function_called_from_a_graph_function_is_told_once_and_not_called_fitting():
    err, out = _stderr_and_stdout("nested_xla")
    callee = out.split("CALLEE ")[1].split()[0]
    warnings = [line for line in err.splitlines() if "is compiled with XLA" in line]
    assert len(warnings) == 1, err[-2000:]
    # It names the function XLA compiles and how to turn XLA off, for tf.function
    # and for Keras.
    assert callee in warnings[0]
    assert "tf.function(..., jit_compile=False)" in warnings[0]
    assert "model.compile(..., jit_compile=False)" in warnings[0]
    assert "XLA_CALLS True" in out, out
    assert "REASON compiled with XLA (jit_compile=True), which bypasses Grappler; called from" \
        in out, out
    text = out.split("TEXT ")[1]
    assert "fits" not in text.replace("whether it fits", ""), text
    assert "not planned" in text, text


def test_a_session_whose_config_lacks_the_pass_is_told_once_under_enable():
    err, out = _stderr_and_stdout("session_without_pass")
    warnings = [line for line in err.splitlines() if "will not optimize this Session" in line]
    assert len(warnings) == 1, err[-2000:]
    assert "tf.compat.v1.Session(config=tfmemopt.config_proto(" in warnings[0]
    assert "WITHOUT 2" in out and "WITH 2" in out, out  # config_proto's Session is not counted
    assert "Sessions not optimized (their config lacks the pass): 2" in out, out


def test_a_session_without_enable_is_not_told():
    err, _ = _stderr_and_stdout("session_not_enabled")
    assert "tfmemopt:" not in err, err[-2000:]


def test_config_proto_warns_when_its_base_switches_grappler_off():
    err, out = _stderr_and_stdout("meta_optimizer_off_base")
    assert err.count("base sets graph_options.rewrite_options.disable_meta_optimizer=True") \
        == 1, err[-2000:]
    assert "KEPT True" in out  # the user's setting is kept, as documented, but told


def test_a_training_step_below_a_raised_min_graph_nodes_is_a_warning_helpers_are_not():
    err, out = _stderr_and_stdout("min_graph_nodes_raised")
    warnings = [line for line in err.splitlines() if "looks like a training step" in line]
    assert len(warnings) == 1 and "__inference_step_" in warnings[0], err[-2000:]
    assert "below Grappler's min_graph_nodes (1000)" in warnings[0]
    assert "__inference_helper_" not in err, err[-2000:]
    assert "REPORTS 0" in out
