"""Hints from the model code to the planner.

    with tfmemopt.recompute_scope():
        h = block(h)        # ops built here are recomputed in the backward pass

Ops built inside the scope carry the `_tfmemopt_recompute` attribute. Under
`recompute_policy="MANUAL"` (or `mode="MANUAL"`) the pass recomputes exactly the
hinted ops that can be recomputed safely (stateful ops, e.g. random ones, and ops
under control flow never are; the report lists hinted ops it left alone). TF's own
`_recompute_hint` attribute and the config's `recompute_scopes` hint the same way.
"""

import contextlib

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import ops

RECOMPUTE_ATTR = "_tfmemopt_recompute"


@contextlib.contextmanager
def recompute_scope():
    """Tags the ops built inside it (in a tf.function or v1 graph) for recomputation.

    In eager code outside any graph it has no effect: there is no graph to rewrite.
    """
    graph = ops.get_default_graph()
    with graph._attr_scope({RECOMPUTE_ATTR: attr_value_pb2.AttrValue(b=True)}):  # pylint: disable=protected-access
        yield
