"""Why tfmemopt did or did not act: `tfmemopt.explain()`.

The pass runs inside Grappler, so it is silent wherever Grappler does not run. Those
places are found here and told to the user once, as they happen:

* a tf.function compiled with XLA (`jit_compile=True`): XLA takes the function before
  Grappler does (a WARNING, once per function), whether it is called directly or from
  a graph function the pass does see (Keras `compile(jit_compile=True)` calls its
  XLA train step from a plain tf.function); explain() then does not say that graph
  "fits": its work is in the function the pass never saw;
* a graph function below Grappler's `min_graph_nodes` (4 by default): the
  meta-optimizer skips it (an INFO line, once per process: such graphs are too small
  to need the pass), unless min_graph_nodes was raised and the graph looks like a
  training step, i.e. updates variables or computes gradients (a WARNING, once per
  function);
* Grappler switched off (`disable_meta_optimizer`, e.g. through
  tf.config.optimizer.set_experimental_options): a WARNING, once;
* a Session whose config sets `graph_options.place_pruned_graph` (which
  tf.compat.v1.InteractiveSession forces): TF skips Grappler for it ("Can't optimize a
  pruned graph"); a WARNING when such a Session is created with the pass in its config;
* a Session created while enable() is in force, whose config does not list the pass:
  enable() reaches tf.function's config only, never a Session's (a WARNING, once,
  with the call that does);
* a tf.function that runs eagerly (`tf.config.run_functions_eagerly(True)`, often left
  on after debugging): no graph is built, so there is nothing to optimize (a WARNING,
  once);
* a Keras model compiled with `run_eagerly=True`: Keras runs its steps as Python and
  builds no tf.function (a WARNING, once per model; observed in tfmemopt._keras_hook).

And where the pass did act but its plan ran out of memory in a call nothing retried (a
plain tf.function past its guarded calls, one reading an iterator, Keras `fit` with
enable(fit_retries=0), or function_retries=0; function_guard.py): a WARNING, once per graph,
saying what was planned, that the device had less free than the step needed, and what
re-plans and retries it (tfmemopt.function, tfmemopt.keras.MemoryOptimizer) or which
lower budget to enable.

`tfmemopt.explain()` sums it up for the calling thread: whether the pass is on and
with which config, what Grappler is set to do, the graphs the pass optimized and the
graph functions it never saw, with the reason.
"""

import dataclasses
import threading

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmemopt import _eager_context, _keras_hook
from tfmemopt.config import PASS_NAME

DEFAULT_MIN_GRAPH_NODES = 4  # Grappler's kDefaultMinGraphNodes (meta_optimizer.cc)
XLA_ATTR = "_XlaMustCompile"

_lock = threading.Lock()
_skipped = {}   # function name -> why Grappler did not run the pass on it
_checked = set()  # function names looked at while the pass was enabled
_told = set()   # one-time messages already logged


def _tell_once(key, level, message, *args):
    with _lock:
        if key in _told:
            return
        _told.add(key)
    getattr(tf.get_logger(), level)(message, *args)


def _pass_in(rewrite_options):
    return any(c.name == PASS_NAME for c in rewrite_options.custom_optimizers)


def _min_graph_nodes(rewrite_options):
    nodes = rewrite_options.min_graph_nodes
    return DEFAULT_MIN_GRAPH_NODES if nodes == 0 else nodes


def why_grappler_skips(definition, rewrite_options):
    """Why Grappler will not run the pass on a graph function, or None."""
    if _compiled_with_xla(definition):
        return "compiled with XLA (jit_compile=True), which bypasses Grappler"
    if rewrite_options.disable_meta_optimizer:
        return "Grappler is disabled (disable_meta_optimizer)"
    # Grappler's item holds the function's nodes plus one _Arg per input and one
    # _Retval per output.
    nodes = (len(definition.node_def) + len(definition.signature.input_arg)
             + len(definition.signature.output_arg))
    limit = _min_graph_nodes(rewrite_options)
    if limit > 0 and nodes < limit:
        return f"{nodes} nodes, below Grappler's min_graph_nodes ({limit})"
    return None


_XLA_OFF = ("tf.function(..., jit_compile=False), or model.compile(..., "
            "jit_compile=False) for a Keras model (whose default jit_compile='auto' "
            "turns XLA on on GPUs)")


def _compiled_with_xla(definition):
    xla = definition.attr.get(XLA_ATTR)
    return xla is not None and xla.b


def xla_functions_called(function):
    """Names of the XLA-compiled functions (jit_compile=True) that the graph function
    `function` (an AtomicFunction) calls, directly or through functions it calls.

    Grappler gives the pass the caller's graph with each such call as one op, and
    XLA compiles the callee's body: the pass plans the graph around the call only.
    An AtomicFunction's children are the functions of its graph's library, so
    every function it can call is among them (and their children)."""
    found, seen = [], set()
    pending = list(getattr(function, "children", ()))
    while pending:
        child = pending.pop()
        name = child.name.decode() if isinstance(child.name, bytes) else child.name
        if name in seen:
            continue
        seen.add(name)
        if _compiled_with_xla(child.cached_definition):
            found.append(name)
            continue  # what an XLA function calls is compiled with it
        pending.extend(getattr(child, "children", ()))
    return sorted(found)


# Graph function -> the XLA functions it calls (the pass saw it, not them).
_xla_callers = {}

# Ops that write to a variable: a graph with one updates weights, as a training step
# does. A graph skipped for its size is told as a WARNING only when it looks like a
# training step (see _tell_small).
_UPDATE_OP_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "Apply",
                       "SparseApply", "ResourceScatter", "ScatterUpdate", "ScatterAdd",
                       "ScatterSub")
# Where TF puts a backward pass: tf.GradientTape's ops and tf.gradients'.
_GRADIENT_SCOPES = ("gradient_tape/", "gradients/")


def _looks_like_training_step(definition):
    """It updates variables or computes gradients (a step that returns them)."""
    return any(node.op.startswith(_UPDATE_OP_PREFIXES)
               or node.name.startswith(_GRADIENT_SCOPES)
               for node in definition.node_def)


def _tell_small(name, definition, reason, rewrite):
    # Graphs below Grappler's default min_graph_nodes (4) are a constant or one op:
    # nothing for the pass to plan, and Keras and tf.data make many, so one INFO
    # line for all of them. A user who raised min_graph_nodes can skip real steps
    # with it; a graph that updates variables or computes gradients (a training
    # step) is then worth a WARNING of its own, and helper graphs (reads, metrics,
    # shapes) stay quiet.
    if (_min_graph_nodes(rewrite) > DEFAULT_MIN_GRAPH_NODES
            and _looks_like_training_step(definition)):
        _tell_once(("small-step", name), "warning",
                   "tfmemopt: graph function %s looks like a training step (it updates "
                   "variables or computes gradients) but has %s, so Grappler skips it and tfmemopt does not plan its memory. "
                   "Lower min_graph_nodes (tf.config.optimizer.set_experimental_options("
                   "{'min_graph_nodes': %d}) is Grappler's default) to let tfmemopt plan "
                   "it.", name, reason, DEFAULT_MIN_GRAPH_NODES)
        return
    _tell_once("small", "info",
               "tfmemopt: graph function %s has %s; Grappler skips such graphs, and "
               "tfmemopt with them (they are too small to need it). "
               "tfmemopt.explain() lists them.", name, reason)


def _on_function_call(function):
    name, definition = _eager_context.function_definition(function)
    with _lock:
        if name in _checked:
            return
    rewrite = _eager_context.current_rewrite_options()
    if not _pass_in(rewrite):
        return  # not enabled in this thread: nothing to explain about this call
    reason = why_grappler_skips(definition, rewrite)
    xla_callees = [] if reason else xla_functions_called(function)
    with _lock:
        _checked.add(name)
        if reason:
            _skipped[name] = reason
        if xla_callees:
            _xla_callers[name] = xla_callees
        for callee in xla_callees:
            _skipped.setdefault(callee, f"compiled with XLA (jit_compile=True), which "
                                        f"bypasses Grappler; called from {name}")
    for callee in xla_callees:
        _tell_once(("xla", callee), "warning",
                   "tfmemopt: tf.function %s, called from graph function %s, is compiled "
                   "with XLA (jit_compile=True); XLA bypasses Grappler, so tfmemopt plans "
                   "only the graph around the call, not the memory of %s itself. Turn XLA "
                   "off to let tfmemopt plan it: %s.", callee, name, callee, _XLA_OFF)
    if reason is None:
        return
    if reason.startswith("compiled with XLA"):
        _tell_once(("xla", name), "warning",
                   "tfmemopt: tf.function %s is compiled with XLA (jit_compile=True); XLA "
                   "bypasses Grappler, so tfmemopt does not act on it. Turn XLA off to "
                   "let tfmemopt plan its memory: %s.", name, _XLA_OFF)
    elif reason.startswith("Grappler is disabled"):
        _tell_once("meta", "warning",
                   "tfmemopt: Grappler is disabled (disable_meta_optimizer is set), so "
                   "tfmemopt does not act on any graph function (first: %s).", name)
    else:
        _tell_small(name, definition, reason, rewrite)


EAGER_REASON = ("runs eagerly (tf.config.run_functions_eagerly(True)), so no graph is "
                "built")


def _first_skip(name, reason):
    """Records that `name` ran without a graph for `reason`; True the first time, and
    only while the pass is enabled in this thread (else there is nothing to tell)."""
    with _lock:
        if name in _skipped:
            return False
    if not _pass_in(_eager_context.current_rewrite_options()):
        return False
    with _lock:
        _skipped[name] = reason
    return True


def _on_eager_run(function):
    name = getattr(function, "_name", None) or repr(function)
    if _first_skip(name, EAGER_REASON):
        _tell_once("eager", "warning",
                   "tfmemopt: tf.function %s runs eagerly because "
                   "tf.config.run_functions_eagerly(True) is set; no graph is built, so "
                   "tfmemopt does not act on it (nor on any tf.function while it is set). "
                   "Call tf.config.run_functions_eagerly(False) to let tfmemopt plan its "
                   "memory.", name)


KERAS_EAGER_REASON = ("compiled with run_eagerly=True: Keras runs its steps as Python, "
                      "so no graph is built")


def _on_keras_eager(model):
    name = f"Keras model {getattr(model, 'name', type(model).__name__)}"
    if _first_skip(name, KERAS_EAGER_REASON):
        _tell_once(("keras-eager", name), "warning",
                   "tfmemopt: %s is compiled with run_eagerly=True; Keras then runs its "
                   "steps as Python and builds no graph, so tfmemopt does not act on it. "
                   "Compile with run_eagerly=False (the default) to let tfmemopt plan its "
                   "memory.", name)


def _on_out_of_memory(function, error):
    from tfmemopt import feedback

    name, _ = _eager_context.function_definition(function)
    if not _pass_in(_eager_context.current_rewrite_options()):
        return
    report = feedback.planned_report(name)
    if report is None:
        return  # not planned by the pass (or it fell back): nothing to say about a plan
    record = feedback.next_budget(report, error, {})
    mib = feedback.mib
    planned = (f"its plan fits the budget (predicted peak {mib(record['predicted_peak_bytes'])}, "
               f"budget {mib(record['budget_bytes'])}), but the device had less free than the "
               f"step needed (the memory model under-predicted it, or memory held outside "
               f"the step left less than the budget)"
               if report.fits else
               f"its plan could not meet the budget (smallest peak reachable "
               f"{mib(record['predicted_peak_bytes'])}, budget {mib(record['budget_bytes'])})")
    if report.unresolved_tensors:
        # Sizes counted as 1 make any budget figure meaningless: say what resolves them.
        planned += (f"; {report.unresolved_tensors} of its tensors had unknown dimensions, "
                    f"counted as 1, so the plan under-counts the step")
        lower = ("; or enable(assume_batch_size=<the batch size>), which resolves the "
                 "batch dimension (the Keras callback sets it from fit's batch size)"
                 if not report.to_dict().get("assume_batch_size") else "")
    elif report.fits and record["new_budget_bytes"]:
        lower = f"; or enable a lower budget, e.g. budget={record['new_budget_bytes']}"
    else:
        lower = "; or lower the batch size"
    _tell_once(("oom", name), "warning",
               "tfmemopt: %s although tfmemopt planned it: %s. "
               "tfmemopt.keras.MemoryOptimizer (for fit) and tfmemopt.function (for a "
               "custom step) re-plan and retry such a step by themselves%s.",
               feedback.ran_out_of_memory(record), planned, lower)


# Sessions created while enable() was in force whose config lacks the pass.
_sessions_without_pass = [0]

SESSION_CALL = "tf.compat.v1.Session(config=tfmemopt.config_proto(budget, base=your_config))"


def _on_session(config):
    import tfmemopt

    if config is not None and not isinstance(config, config_pb2.ConfigProto):
        return
    rewrite = config.graph_options.rewrite_options if config is not None else None
    if rewrite is None or not _pass_in(rewrite):
        if tfmemopt.enabled_config() is None:
            return  # tfmemopt is not in use: nothing to say about this Session
        # enable() edits the config tf.function builds its graphs with; a Session
        # builds its graph with the ConfigProto it is given, so the pass never runs
        # on it, and the user who enabled tfmemopt would otherwise see nothing at all.
        with _lock:
            _sessions_without_pass[0] += 1
        _tell_once("session-without-pass", "warning",
                   "tfmemopt: tfmemopt.enable() is in force, but this Session's config %s, "
                   "so tfmemopt will not optimize this Session's graph (nor the "
                   "tf.functions it runs): enable() reaches tf.function and Keras only. "
                   "Create the Session with %s (base=None if you have no config of your "
                   "own).",
                   "is None" if config is None else "does not list the pass",
                   SESSION_CALL)
        return
    if config.graph_options.place_pruned_graph:
        _tell_once("pruned", "warning",
                   "tfmemopt: this Session's config sets place_pruned_graph=True "
                   "(tf.compat.v1.InteractiveSession always does), and TensorFlow skips "
                   "Grappler for such sessions, so tfmemopt does not act on them. Use "
                   "tf.compat.v1.Session(config=tfmemopt.config_proto(...)) instead.")
    if rewrite.disable_meta_optimizer:
        _tell_once("session-meta", "warning",
                   "tfmemopt: this Session's config sets "
                   "graph_options.rewrite_options.disable_meta_optimizer=True, which "
                   "switches Grappler off, so tfmemopt does not act on it. Set it to False "
                   "to let tfmemopt plan the Session's graph.")


def install():
    _eager_context.set_observers(_on_function_call, _on_session, _on_eager_run,
                                 _on_out_of_memory)
    _keras_hook.watch(_on_keras_eager)


def warn_if_pruned(config):
    """config_proto(base=...) calls this: a base that prunes the graph switches Grappler off."""
    if config.graph_options.place_pruned_graph:
        _tell_once("pruned-base", "warning",
                   "tfmemopt: base sets graph_options.place_pruned_graph=True; TensorFlow "
                   "skips Grappler for Sessions with it, so tfmemopt will not act on them.")
    warn_if_meta_optimizer_off(config.graph_options.rewrite_options,
                               "graph_options.rewrite_options.disable_meta_optimizer")


def warn_if_meta_optimizer_off(rewrite_options, field="disable_meta_optimizer"):
    """config_proto(base=...) and rewriter_config(base=...) keep what their base sets,
    disable_meta_optimizer too; with it Grappler, and so the pass, never runs. A
    WARNING, like place_pruned_graph's: the config is valid, only useless to tfmemopt."""
    if rewrite_options.disable_meta_optimizer:
        _tell_once("meta-base", "warning",
                   "tfmemopt: base sets %s=True, which switches Grappler off, and tfmemopt "
                   "with it: graphs built with this config will not be optimized. Set it to "
                   "False (or leave it unset) to let tfmemopt act.", field)


@dataclasses.dataclass
class Explanation:
    """What `tfmemopt.explain()` found. `str()` gives it as a few lines of text.

    enabled: tfmemopt.enable() is in force. in_this_thread: the calling thread's graph
    functions are built with the pass in their config. config: the fields set (name ->
    value). grappler: what the thread's config asks of Grappler (meta_optimizer on or
    off, min_graph_nodes, memory_optimization, TF's global XLA JIT, and
    functions_run_eagerly: tf.config.run_functions_eagerly). graphs: one dict per
    graph the pass optimized in this process (graph_id, status, num_nodes, fits,
    graph_changed, xla_calls: the XLA-compiled functions it calls, whose memory it did
    not plan). not_seen: graph function name (a tf.function's Python name when it ran
    eagerly) -> why Grappler never ran the pass on it. sessions_without_pass: Sessions
    created while enable() was in force whose config does not list the pass (enable()
    does not reach Sessions; tfmemopt.config_proto() does).
    """

    enabled: bool
    in_this_thread: bool
    config: dict
    grappler: dict
    graphs: list
    not_seen: dict
    sessions_without_pass: int = 0

    def __str__(self):
        state = "on" if self.in_this_thread else "off"
        lines = [f"tfmemopt in this thread: {state}"
                 + ("" if self.enabled == self.in_this_thread else
                    f" (enable() is {'in force' if self.enabled else 'not in force'})")]
        if self.config:
            lines.append("  config: " + ", ".join(f"{k}={v!r}" for k, v in self.config.items()))
        g = self.grappler
        lines.append(f"  Grappler: {'off (disable_meta_optimizer)' if not g['meta_optimizer'] else 'on'}"
                     f", min_graph_nodes {g['min_graph_nodes']}, memory_optimization "
                     f"{g['memory_optimization']}, XLA auto-jit {'on' if g['xla_jit'] else 'off'}"
                     + (", tf.functions run eagerly (no graphs)"
                        if g.get("functions_run_eagerly") else ""))
        lines.append(f"  graphs optimized: {len(self.graphs)}")
        for r in self.graphs[-10:]:
            fits = {True: "fits", False: "over budget", None: "no budget"}[r["fits"]]
            if r.get("xla_calls"):
                # Its work is in functions XLA compiles: "fits" would speak for
                # memory the pass never counted.
                fits = ("its XLA-compiled call(s) " + ", ".join(r["xla_calls"])
                        + " not planned (unknown whether it fits)")
            lines.append(f"    {r['graph_id']}: {r['status']}, {r['num_nodes']} nodes, {fits}"
                         + (", rewritten" if r["graph_changed"] else "")
                         + (", batch split: weight-gradient sums in another order "
                            "(docs/split.md)" if r.get("split") else ""))
        if self.not_seen:
            lines.append(f"  graph functions the pass never saw: {len(self.not_seen)}")
            for name, reason in list(self.not_seen.items())[-10:]:
                lines.append(f"    {name}: {reason}")
        if self.sessions_without_pass:
            lines.append(f"  Sessions not optimized (their config lacks the pass): "
                         f"{self.sessions_without_pass}; use {SESSION_CALL}")
        return "\n".join(lines)


def explain():
    """Whether tfmemopt acts in the calling thread, with which config, on which graphs.

    Returns an Explanation; print it for a summary.
    """
    import tfmemopt

    rewrite = _eager_context.current_rewrite_options()
    entry = [c for c in rewrite.custom_optimizers if c.name == PASS_NAME]
    config = {}
    if entry:
        for key, value in sorted(entry[0].parameter_map.items()):
            kind = value.WhichOneof("value")
            config[key] = (list(value.list.s) if kind == "list"
                           else value.s.decode() if kind == "s"
                           # AttrValue holds a float32: 0.6 reads back 0.6000000238...
                           else float(f"{value.f:.7g}") if kind == "f"
                           else getattr(value, kind))
    memory = rewrite.MemOptType.Name(rewrite.memory_optimization)
    grappler = {"meta_optimizer": not rewrite.disable_meta_optimizer,
                "min_graph_nodes": _min_graph_nodes(rewrite),
                "memory_optimization": memory,
                "xla_jit": bool(tf.config.optimizer.get_jit()),
                "functions_run_eagerly": bool(tf.config.functions_run_eagerly())}
    with _lock:
        not_seen = dict(_skipped)
        xla_callers = dict(_xla_callers)
        sessions = _sessions_without_pass[0]
    graphs = [{"graph_id": r.graph_id, "status": r.status, "num_nodes": r.num_nodes,
               "fits": r.fits, "graph_changed": r.graph_changed,
               "split": bool(r.split_ops),
               "xla_calls": xla_callers.get(r.graph_id, [])} for r in tfmemopt.reports()]
    return Explanation(enabled=tfmemopt.enabled_config() is not None,
                       in_this_thread=bool(entry), config=config, grappler=grappler,
                       graphs=graphs, not_seen=not_seen, sessions_without_pass=sessions)
