"""The pass inside Grappler's own entry point (tf_optimizer.OptimizeGraph)."""

import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer

import tfmemopt
from conftest import build_v1_mlp_train_op


def train_metagraph():
    with tf.Graph().as_default() as graph:
        _, _, train_op = build_v1_mlp_train_op()
        graph.add_to_collection("train_op", train_op)
        return tf.compat.v1.train.export_meta_graph(graph=graph)


def optimize(config, metagraph):
    config.graph_options.rewrite_options.min_graph_nodes = -1
    cluster = grappler_cluster.Cluster(disable_detailed_stats=True)
    return tf_optimizer.OptimizeGraph(config, metagraph, cluster=cluster)


def test_two_meta_optimizer_iterations_give_one_report_and_the_same_graph():
    metagraph = train_metagraph()
    config = tfmemopt.config_proto("1GiB")
    config.graph_options.rewrite_options.meta_optimizer_iterations = (
        rewriter_config_pb2.RewriterConfig.TWO)
    once = optimize(config, metagraph)
    (report,) = tfmemopt.reports()
    assert report.status == "ok" and report.num_nodes > 0
    # Running the meta-optimizer again over its own output changes nothing more.
    metagraph.graph_def.CopyFrom(once)
    twice = optimize(config, metagraph)
    assert sorted(n.name for n in twice.node) == sorted(n.name for n in once.node)
    assert len(tfmemopt.reports()) == 2


def test_unknown_parameter_map_key_is_rejected_by_grappler():
    config = tfmemopt.config_proto("1GiB")
    entry = config.graph_options.rewrite_options.custom_optimizers[0]
    entry.parameter_map["bogus_key"].CopyFrom(attr_value_pb2.AttrValue(i=1))
    with pytest.raises(Exception, match="unknown parameter_map key 'bogus_key'"):
        optimize(config, train_metagraph())
    assert tfmemopt.reports() == []


def test_fail_on_infeasible_makes_grappler_report_the_minimum():
    config = tfmemopt.config_proto(1024, fail_on_infeasible=True)
    config.graph_options.rewrite_options.fail_on_optimizer_errors = True
    with pytest.raises(Exception, match=r"budget 1\.0 KiB cannot be met .* smallest peak reachable is"):
        optimize(config, train_metagraph())


def test_analyze_only_never_changes_the_graph():
    metagraph = train_metagraph()
    plain = optimize(tfmemopt.config_proto("1GiB", mode="ANALYZE_ONLY"), metagraph)
    (report,) = tfmemopt.reports()
    assert report.mode == "ANALYZE_ONLY" and not report.graph_changed
    assert report.num_nodes == len(plain.node)
