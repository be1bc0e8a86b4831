"""A graph function whose rewritten graph TF cannot build runs as TF built it.

The pass checks its output (grappler/verify: names, inputs, no cycle) and gives back
the original graph on any error it finds. What it cannot check is what TF does with
the graph after Grappler: partitioning it by device, and oneDNN's layout pass merging
node pairs into one kernel (rewrite/onednn_merge_guard.h). Should TF then reject the
rewritten graph when it builds the function (an InvalidArgumentError such as "61 nodes
in a cycle", raised before any of its ops ran), the call would fail although the
graph as TF built it runs.

So when a call of a graph function fails that way, and the pass changed that
function's graph (its report says so), the function is built again with the pass in
ANALYZE_ONLY (the graph as TF built it; still reported) and the call is made again, with
the same inputs: nothing ran, so nothing is repeated. One warning names the graph and
TF's message. The function's later calls are built the same way, in every thread,
for the rest of the process. A call whose graph the pass did not change, or that
fails with any other error, raises TF's error as it is.

Installed with tfmemopt (the `_eager_context` hook of every eager graph-function call);
it acts only while tfmemopt.enable() is in force, as the config it rebuilds the
function under is enable()'s.
"""

import threading

import tensorflow as tf

from tfmemopt import _eager_context, feedback

# What TF says when it cannot build a graph (graph_constructor.cc, executor.cc).
BUILD_ERRORS = ("nodes in a cycle",)

_lock = threading.Lock()
_as_built = set()  # names of the graph functions that run as TF built them


def runs_as_built():
    """Names of the graph functions this process runs as TF built them."""
    with _lock:
        return sorted(_as_built)


def _handle(function, error):
    """The context to make `function`'s call in (None: TF's own config): before a
    call (`error` None), for a function that runs as TF built it; after a call that
    failed with `error`, when the pass's rewrite is what TF could not build."""
    if error is None and not _as_built:
        return None  # every call asks: the common answer costs no lock or import
    import tfmemopt
    from tfmemopt.retry import budget_edit

    config = tfmemopt.enabled_config()
    if config is None:
        return None
    name = function.name.decode()
    if error is None:
        with _lock:
            if name not in _as_built:
                return None
    else:
        message = str(getattr(error, "message", error))
        if not any(words in message for words in BUILD_ERRORS):
            return None
        report = feedback.planned_report(name)
        if report is None or not report.graph_changed:
            return None
        with _lock:
            _as_built.add(name)
        first = next((line.strip() for line in message.splitlines()
                      if any(words in line for words in BUILD_ERRORS)), message)
        tf.get_logger().warning(
            "tfmemopt: TF could not build graph %s as tfmemopt rewrote it (%s); it runs "
            "as TF built it, without tfmemopt's changes, for the rest of this process "
            "(docs/troubleshooting.md#tf-could-not-build-a-rewritten-graph)", name, first)
    return budget_edit(config, None, original=True)


def install():
    _eager_context.set_build_handler(_handle)
