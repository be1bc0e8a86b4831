"""Sums TF adds in the order their terms finish are named in the report
(grappler/analyze/arrival_order_sums.h).

At its default memory_optimization level, TF's built-in Grappler memory optimizer
turns an AddN of three or more terms live at its estimated peak into AssignAdds to a
TemporaryVariable, when that peak is above 80 % of the device's memory (256 MiB for a
CPU device). Each term is added as it finishes, so the sum's last bits follow the
execution order: with or without tfmemopt, they are not a function of the graph
alone. The report names these sums; tfmemopt.set_tf_memory_optimization("NO_MEM_OPT")
keeps them AddNs.
"""

import os

import pytest
import tensorflow as tf
from tensorflow.core.protobuf.rewriter_config_pb2 import RewriterConfig

import tfmemopt
from conftest import run_python, subprocess_result
from tfmemopt import _eager_context

# Four terms of 48 MB: TF estimates a peak above 205 MiB (0.8 x 256 MiB), with all four
# live at it.
LARGE = 12_000_000


@pytest.fixture(autouse=True)
def tf_default_memory_optimization():
    tfmemopt.set_tf_memory_optimization(None)
    yield
    tfmemopt.set_tf_memory_optimization(None)


def sum_of_four(n):
    @tf.function
    def step(x):
        return tf.add_n([tf.sin(x), tf.cos(x), tf.exp(x), tf.tanh(x)])

    return step, tf.random.uniform([n], seed=1)


def traced_report(step, x):
    tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
    step(x)
    return max(tfmemopt.reports(), key=lambda r: r.num_nodes)


def test_a_sum_tf_accumulates_in_arrival_order_is_named_in_the_report():
    report = traced_report(*sum_of_four(LARGE))
    assert report.arrival_order_sums == [{"name": "AddN", "terms": 4}]
    text = report.to_text()
    assert "arrival-order sums: 1 (AddN (4 terms))" in text
    assert "set_tf_memory_optimization('NO_MEM_OPT')" in text


def test_a_sum_tf_keeps_whole_is_not_named():
    # Far below TF's threshold: the AddN stays one op, added in input order.
    report = traced_report(*sum_of_four(1000))
    assert report.arrival_order_sums == []
    assert "arrival-order" not in report.to_text()


def test_no_mem_opt_keeps_the_sum_an_addn_and_gives_the_same_value():
    step, x = sum_of_four(LARGE)
    accumulated = traced_report(step, x)
    assert accumulated.arrival_order_sums
    tfmemopt.set_tf_memory_optimization("NO_MEM_OPT")
    assert (_eager_context.current_rewrite_options().memory_optimization
            == RewriterConfig.NO_MEM_OPT)
    tfmemopt.clear_reports()
    step_again, _ = sum_of_four(LARGE)  # a new function: traced under the new level
    whole = traced_report(step_again, x)
    assert whole.arrival_order_sums == []
    # Four terms in another order round differently at most in the last bits.
    tf.debugging.assert_near(step(x), step_again(x), rtol=1e-6, atol=1e-6)


def test_set_tf_memory_optimization_none_restores_tf_default():
    tfmemopt.set_tf_memory_optimization("NO_MEM_OPT")
    tfmemopt.set_tf_memory_optimization(None)
    assert (_eager_context.current_rewrite_options().memory_optimization
            == RewriterConfig.DEFAULT_MEM_OPT)


def test_an_unknown_level_is_rejected_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"level='FAST'; allowed: None or one of "
                                         r"DEFAULT_MEM_OPT, NO_MEM_OPT"):
        tfmemopt.set_tf_memory_optimization("FAST")


def hand_built_sum(terms, var_name=""):
    """A v1 graph holding the pattern TF's memory optimizer writes: a TemporaryVariable
    zeroed by an Assign, one AssignAdd per term, a DestroyTemporaryVariable."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64], name="x")
        var = tf.raw_ops.TemporaryVariable(shape=[64], dtype=tf.float32, var_name=var_name,
                                           name="total/tmp_var")
        zeroed = tf.raw_ops.Assign(ref=var, value=tf.zeros_like(x), name="total/init")
        adds = [tf.raw_ops.AssignAdd(ref=zeroed, value=x * float(i + 1),
                                     name=f"total/accum_{i}") for i in range(terms)]
        with tf.control_dependencies(adds):
            total = tf.raw_ops.DestroyTemporaryVariable(
                ref=zeroed, var_name=var_name or "total/tmp_var", name="total")
        out = tf.identity(total, name="out")
        graph.add_to_collection("train_op", out)
    return tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)


@pytest.mark.parametrize("var_name", ["", "named_accumulator"])
def test_the_accumulation_pattern_is_found_by_structure(var_name):
    report = tfmemopt.analyze_metagraph(hand_built_sum(3, var_name), mode="ANALYZE_ONLY")
    assert report.arrival_order_sums == [{"name": "total", "terms": 3}]


def test_two_terms_add_up_the_same_in_either_order_and_are_not_named():
    report = tfmemopt.analyze_metagraph(hand_built_sum(2), mode="ANALYZE_ONLY")
    assert report.arrival_order_sums == []


def test_an_accumulate_n_of_three_terms_is_named():
    @tf.function
    def step(x):
        return tf.raw_ops.AccumulateNV2(inputs=[tf.sin(x), tf.cos(x), tf.exp(x)], shape=[100])

    report = traced_report(step, tf.ones([100]))
    assert report.arrival_order_sums == [{"name": "AccumulateNV2", "terms": 3}]


TOTAL_ELEMENTS = 1_000_000  # 4 MB per tensor


def running_total_graph():
    """Three terms added one after another into a TemporaryVariable, then the sum and a
    tensor made after the last term meet in a dot product. When the sum is handed out,
    the running total, that tensor and the sum are alive: 2 tensors if the sum is the
    running total's own buffer (it is: DestroyTemporaryVariable hands out the
    variable's tensor), 3 if it were a new one."""
    n = TOTAL_ELEMENTS
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [], name="x")
        var = tf.raw_ops.TemporaryVariable(shape=[n], dtype=tf.float32, var_name="",
                                           name="total/tmp_var")
        zeroed = tf.raw_ops.Assign(ref=var, value=tf.fill([n], 0.0), name="total/init")
        adds = []
        for i in range(3):
            with tf.control_dependencies(adds[-1:]):
                term = tf.fill([n], x * float(i + 1))
            adds.append(tf.raw_ops.AssignAdd(ref=zeroed, value=term, name=f"total/accum_{i}"))
        with tf.control_dependencies(adds):
            total = tf.raw_ops.DestroyTemporaryVariable(ref=zeroed, var_name="total/tmp_var",
                                                        name="total")
        with tf.control_dependencies(adds[-1:]):
            other = tf.fill([n], x * 7.0)
        out = tf.tensordot(total, other, 1, name="out")
        graph.add_to_collection("train_op", out)
    return tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)


MEASURE_RUNNING_TOTAL = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import tfmemopt
from test_arrival_order_sums import running_total_graph

metagraph = running_total_graph()
report = tfmemopt.analyze_metagraph(metagraph, mode="ANALYZE_ONLY")
graph = tf.Graph()
with graph.as_default():
    tf.compat.v1.train.import_meta_graph(metagraph)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run("out:0", {"x:0": 1.0})  # the constants are made
        tf.config.experimental.reset_memory_stats("CPU:0")
        value = session.run("out:0", {"x:0": 1.0})
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
print("RESULT " + json.dumps({"predicted": report.predicted_peak_bytes["before"][""],
                              "measured": peak, "value": float(value)}))
'''


def test_the_sum_a_running_total_hands_out_is_its_own_buffer():
    done = run_python(MEASURE_RUNNING_TOTAL, os.path.dirname(os.path.abspath(__file__)),
                      env={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"})
    result = subprocess_result(done)
    tensor = 4 * TOTAL_ELEMENTS
    assert result["value"] == 6.0 * 7.0 * TOTAL_ELEMENTS
    # The zeros the total starts from are a constant (held all step), then two tensors.
    assert result["predicted"] < 3.5 * tensor, result
    assert abs(result["predicted"] / result["measured"] - 1) < 0.1, result
