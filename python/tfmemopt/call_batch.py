"""A graph function whose inputs have an unknown batch dimension is planned for the
batch it is called with.

A tf.function traced with `input_signature=[tf.TensorSpec([None, ...])]`, with
`reduce_retracing=True` after calls of several batch sizes, or a distribute step fed
per-replica batches of unknown size, gives Grappler a graph whose tensors have an
unknown batch dimension. The pass counts such a dimension as 1 unless
`assume_batch_size` says otherwise: its predicted peak is then a small fraction of
the real one, the report says the step fits, and nothing is planned. The pass does
not see the call's inputs (Grappler plans a function once per config, before it
runs), but the eager call does: this module reads the batch from the call's inputs
and builds the function with `assume_batch_size` set to it.

* The batch is the leading dimension of the call's inputs whose graph input has an
  unknown leading dimension (rank >= 1, not a resource or variant). When those
  inputs disagree (a ragged tensor's values beside its row splits, a sequence beside
  its lengths) nothing is assumed: the batch is not known.
* Each function is planned for the largest batch it was called with so far: a call
  of a smaller batch (an epoch's last, partial batch) runs the plan of the larger
  one, which holds for it (the plan recomputes, swaps and orders; a split, which
  needs a static batch size, is never planned on an unknown one), and does not
  re-plan. A call of a larger batch re-plans: TF builds the function again under the
  new config. One INFO line per function and batch.
* A config that sets `assume_batch_size` (the user's, or the Keras callback's for a
  fit) keeps it, 0 included (`enable(assume_batch_size=0)`: unknown dimensions stay
  unknown, as without this module); a config without the pass is left alone.

Installed on import for every eager graph-function call
(_eager_context.set_call_edit_resolver); calls inside a graph (a function that
calls another) are built with their caller's config.
"""

import threading

import tensorflow as tf

from tfmemopt import _eager_context
from tfmemopt.config import PASS_NAME

_FIELD = "assume_batch_size"

_lock = threading.Lock()
# function name -> indices of its inputs whose leading dimension is unknown
# (an empty tuple: none, the common case; the call is left alone at once).
_unknown_inputs = {}
_largest = {}  # function name -> largest batch it was called with


def _inputs_of_unknown_batch(function):
    """Indices of `function`'s graph inputs of unknown leading dimension."""
    graph = getattr(function, "graph", None)
    if graph is None:
        return ()
    found = []
    for index, tensor in enumerate(graph.inputs):
        if tensor.dtype in (tf.resource, tf.variant):
            continue
        shape = tensor.shape
        if shape.rank is not None and shape.rank >= 1 and shape[0] is None:
            found.append(index)
    return tuple(found)


def batch_of_call(function, args):
    """The batch of this call of `function` (an AtomicFunction) if its graph leaves
    the batch dimension unknown and the call's inputs agree on one, else None."""
    name = function.name
    indices = _unknown_inputs.get(name)
    if indices is None:
        try:
            indices = _inputs_of_unknown_batch(function)
        except Exception:  # noqa: BLE001 - a function TF gives no graph for: leave it
            indices = ()
        with _lock:
            _unknown_inputs[name] = indices
    if not indices or indices[-1] >= len(args):
        return None
    sizes = set()
    for index in indices:
        shape = getattr(args[index], "shape", None)
        if shape is None or shape.rank is None or shape.rank < 1 or shape[0] is None:
            return None
        sizes.add(int(shape[0]))
    return sizes.pop() if len(sizes) == 1 else None


def _assume_batch(batch):
    """The edit that gives the pass's entry assume_batch_size=batch, unless the config
    sets the field (to 0 too: the user asked for unknown dimensions to stay unknown)."""
    def edit(config):
        for entry in config.graph_options.rewrite_options.custom_optimizers:
            if entry.name == PASS_NAME and _FIELD not in entry.parameter_map:
                entry.parameter_map[_FIELD].i = batch
    return edit


def resolve(function, args):
    """_eager_context's call-edit resolver: (key, edit) for a call whose batch the
    graph leaves unknown, else None."""
    batch = batch_of_call(function, args)
    if batch is None or batch < 1:
        return None
    name = function.name
    with _lock:
        largest = _largest.get(name, 0)
        grew = batch > largest
        if grew:
            _largest[name] = largest = batch
    if grew:
        tf.get_logger().info(
            "tfmemopt: %s is called with inputs of unknown batch size; it is planned for "
            "batch %d, the largest it was called with (assume_batch_size)",
            name.decode() if isinstance(name, bytes) else name, largest)
    return (_FIELD, largest), _assume_batch(largest)


def planned_batches():
    """{function name: the batch its unknown batch dimension is planned for}."""
    with _lock:
        return {(n.decode() if isinstance(n, bytes) else n): b for n, b in _largest.items()}


_eager_context.set_call_edit_resolver(resolve)
