"""tfmemopt.analyze(): plan a training step without running it.

The step's graph goes through Grappler's own entry point (tf_optimizer.OptimizeGraph,
the meta-optimizer with TF's built-in passes first and TfMemOpt last), so the report
describes the graph that training would optimize. The function's captured variables
become VarHandleOps with their real dtype and shape (a captured resource is a bare
placeholder otherwise, and its size would be unknown), its inputs take the shapes of
the example arguments, and its outputs and control outputs (the optimizer's updates)
are fetched so that nothing is pruned.
"""

import json

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer

from tfmemopt import config as _config
from tfmemopt.report import Report

# The graph id Grappler gives an item built by OptimizeGraph.
_ITEM_ID = "graph_to_optimize"


def analyze_metagraph(metagraph, budget=None, **fields):
    """Runs the meta-optimizer with TfMemOpt on `metagraph` and returns its Report.

    The metagraph's `train_op` collection names what must be kept (fetched).
    Raises ValueError if there is nothing to fetch.
    """
    fetch = metagraph.collection_def.get("train_op")
    if fetch is None or not fetch.node_list.value:
        raise ValueError(
            "tfmemopt: the graph has no train op or fetch (a 'train_op' collection); "
            "expected a training graph with its train op or outputs named")
    config = _config.config_proto(budget, **fields)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    config.graph_options.rewrite_options.fail_on_optimizer_errors = False
    cluster = grappler_cluster.Cluster(disable_detailed_stats=True)
    # Bodies of functions Grappler hands the pass as stubs (XLA-compiled calls).
    from tfmemopt._eager_context import hand_over_function_bodies
    hand_over_function_bodies()
    before = _config._ext.num_reports()
    tf_optimizer.OptimizeGraph(config, metagraph, cluster=cluster)
    new = [json.loads(text) for text in _config._ext.reports(before)]
    mine = [data for data in new if data["graph_id"] == _ITEM_ID]
    if not mine:
        raise RuntimeError("tfmemopt: the pass did not run on the graph (no report)")
    return Report(mine[-1])


def _concrete_function(fn, args, kwargs):
    if isinstance(fn, tf.types.experimental.ConcreteFunction):
        return fn
    if hasattr(fn, "get_concrete_function"):
        return fn.get_concrete_function(*args, **kwargs)
    raise TypeError(
        f"tfmemopt.analyze: fn={fn!r} is a {type(fn).__name__}; allowed: a tf.function "
        f"(with example args), a concrete function, or a Keras model (with x= and y=)")


def _shape_attr(shape):
    proto = tensor_shape_pb2.TensorShapeProto()
    for dim in shape:
        proto.dim.add(size=-1 if dim is None else dim)
    return attr_value_pb2.AttrValue(shape=proto)


def metagraph_of(concrete):
    """A MetaGraphDef of a concrete function, ready for analyze_metagraph()."""
    graph = concrete.graph
    graph_def = graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    variables = {id(v.handle): v for v in concrete.variables}
    for external, internal in graph.captures:
        variable = variables.get(id(external))
        if internal.dtype != tf.resource or variable is None:
            continue
        node = nodes[internal.op.name]
        node.op = "VarHandleOp"
        node.ClearField("attr")
        node.attr["dtype"].type = variable.dtype.as_datatype_enum
        node.attr["shape"].CopyFrom(_shape_attr(variable.shape.as_list()))
        node.attr["shared_name"].s = internal.op.name.encode()
        node.attr["container"].s = b""
    # Training places an unpinned step on the first accelerator, else the CPU; the
    # report names devices, so the analyzed graph is placed the same way.
    default_device = _default_device()
    for node in graph_def.node:
        if not node.device:
            node.device = default_device
    for placeholder in graph.inputs:
        if placeholder.dtype == tf.resource:
            continue
        node = nodes[placeholder.op.name]
        if node.op == "Placeholder" and placeholder.shape.rank is not None:
            node.attr["shape"].CopyFrom(_shape_attr(placeholder.shape.as_list()))
    # At run time the function's inputs are _Arg nodes, which the executor creates
    # first, in argument order (captured variables after the arguments); the pass's
    # executor order reads that position from this attribute on their stand-ins
    # here, so analyze() orders the step as training does.
    for index, placeholder in enumerate(graph.inputs):
        nodes[placeholder.op.name].attr["_tfmemopt_arg_index"].i = index
    metagraph = meta_graph_pb2.MetaGraphDef()
    metagraph.graph_def.CopyFrom(graph_def)
    fetch = metagraph.collection_def["train_op"].node_list.value
    for output in concrete.outputs:
        fetch.append(output.name)
    for op in graph.control_outputs:
        fetch.append(op.name)
    return metagraph


def _default_device():
    logical = tf.config.list_logical_devices()
    for kind in ("GPU", "TPU", "CPU"):
        for device in logical:
            if device.device_type == kind:
                return device.name
    return "/job:localhost/replica:0/task:0/device:CPU:0"


def analyze(fn, *args, budget=None, x=None, y=None, **fields):
    """Plans a training step without running it; returns the pass's Report.

    fn: a tf.function (called with `*args` as example inputs), a concrete function,
    or a Keras model, whose train step is analyzed on the batch `x`, `y`. `budget`
    and `fields` are as for tfmemopt.enable().
    """
    _config.make_config(budget, **fields)  # reject bad config before any tracing
    if isinstance(fn, tf.keras.Model):
        if x is None or args:
            raise ValueError(
                "tfmemopt.analyze: a Keras model is analyzed on a batch given as x= "
                "(and y=), not as positional args")
        concrete = _keras_train_step(fn, x, y)
    else:
        if x is not None or y is not None:
            raise ValueError(
                "tfmemopt.analyze: x= and y= are for Keras models; pass a function's "
                "example inputs as positional args")
        concrete = _concrete_function(fn, args, {})
    return analyze_metagraph(metagraph_of(concrete), budget, **fields)


def _keras_train_step(model, x, y):
    """The concrete train step that Model.fit runs for one batch (x, y). x and y may be
    arrays or, for models with several inputs or outputs, lists or dicts of them, as
    fit takes them; y None for a model whose losses are its own (add_loss)."""
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError("tfmemopt.analyze: compile() the Keras model first (its "
                         "optimizer and loss define the train step)")
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = None if y is None else tf.nest.map_structure(tf.convert_to_tensor, y)
    if not model.built:
        model(tf.nest.map_structure(lambda t: t[:1], x))
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)

    data = (x,) if y is None else (x, y)

    @tf.function
    def train_step(data):
        return model.train_step(data)

    return train_step.get_concrete_function(data)
