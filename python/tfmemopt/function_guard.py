"""The feedback loop for a plain tf.function under tfmemopt.enable().

    tfmemopt.enable(budget="6GiB")      # function_retries=3 by default

    @tf.function
    def train_step(x, y):
        ...

A graph function the pass planned can still run out of memory where the memory model
was wrong near the budget (docs/accuracy.md). tfmemopt.function and the Keras callback
re-plan and retry such a step; this module gives the same to every graph function
called eagerly while enable() is in force, so that the one line is enough:

* the first `guard_steps` calls of a function, and of each re-plan of it, are guarded
  by a host snapshot of the variables the function captures (the first call too, as
  the pass plans during it);
* when a guarded call of a function the pass planned (feedback.planned_report: a graph
  left as it was, because the pass predicted that it fits, counts too) runs out of
  memory, the
  variables are put back, the budget is lowered by the allocation that failed
  (feedback.replan), the function is re-instantiated (and so re-planned) under it, and
  the call is retried with the same inputs, up to `function_retries` times. Each retry
  is logged. The lower budget is this function's (this trace's) for its later calls,
  until enable() is called with another config;
* when the re-plans are used up, or no lower budget can change the plan, a graph the
  pass changed is run once more as TF built it (feedback.after_failed_attempt), and
  keeps running so where that trains: a step that trains without tfmemopt trains with
  it;
* each enable() starts the guarded calls of every function again, as TF re-plans a
  function on its next call under a new config (a function the pass had left alone
  may be planned then).

A call is left as TF makes it, with the existing hint on an out-of-memory error, when
it reads a resource that is not one of its variables (an iterator, as in Keras' fit,
evaluate and predict, or a lookup table): a retry would read the next batch, or a
changed table, and its results would not be those of a run that never ran out of
memory. Calls inside tfmemopt.function or the Keras callback are theirs
(_eager_context.retrying_calls). Past the guarded calls an error is raised as TF
raises it: a step may have updated some variables already.

Unlike tfmemopt.function, the guard does not reset or read the allocator's peak
statistics: a user's script that reads `get_memory_info(...)["peak"]` over its run
sees what it would see without tfmemopt.
"""

import threading

import tensorflow as tf

from tfmemopt import _eager_context, feedback

_lock = threading.Lock()
_state = {}  # function name -> _FunctionState
# config_key: the serialized config of the last install (see install()).
_settings = {"retries": 0, "guard_steps": feedback.DEFAULT_GUARD_STEPS, "config_key": None}


class _FunctionState:
    def __init__(self):
        self.calls_since_plan = 0
        self.planned = None  # unknown until its first call
        self.budget_bytes = None  # its own budget after a retry
        # Runs as TF built it (the pass in ANALYZE_ONLY) after its plans ran out of memory.
        self.original = False
        self.retries_done = []  # under the config in force: counted against retries
        self.earlier_retries = []  # under earlier configs


def install(retries, guard_steps=feedback.DEFAULT_GUARD_STEPS, config_key=None):
    """Guards eager graph-function calls with `retries` retries (0: TF makes every
    call, and out-of-memory errors only get the hint).

    Each install starts every known function's guarded calls again: TF re-plans a
    function on its next call under a new config, and a function the pass had left
    alone so far may be planned now. `config_key` names the config; under another one
    the budgets lowered by earlier retries are dropped (they were lowered from the old
    budget), and each function has its `retries` again."""
    with _lock:
        new_config = config_key != _settings["config_key"]
        _settings.update(retries=retries, guard_steps=guard_steps, config_key=config_key)
        for state in _state.values():
            state.planned, state.calls_since_plan = None, 0
            if new_config:
                state.budget_bytes, state.original = None, False
                state.earlier_retries += state.retries_done
                state.retries_done = []
    _eager_context.set_call_handler(_handle_call if retries > 0 else None)


def install_for(config, retries):
    """install(), unless `config` (a MemoryOptimizerConfig) leaves graphs as they are
    (ANALYZE_ONLY): then there is no plan to correct."""
    analyze_only = config.mode == type(config).ANALYZE_ONLY
    install(0 if analyze_only else retries,
            config_key=config.SerializeToString(deterministic=True))


def uninstall():
    _eager_context.set_call_handler(None)


def retries_done(function_name=None):
    """Every retry the guard made, as feedback.replan records them (one function's,
    by its graph name, or all)."""
    with _lock:
        states = ([_state[function_name]] if function_name in _state else []
                  if function_name is not None else list(_state.values()))
    return [record for state in states
            for record in state.earlier_retries + state.retries_done]


def _handle_call(function, args):
    import tfmemopt

    config = tfmemopt.enabled_config()
    if config is None:
        return _eager_context.call_unhandled(function, args)
    name = function.name.decode()
    with _lock:
        state = _state.setdefault(name, _FunctionState())
    while True:
        snapshot = None
        if state.planned is not False and state.calls_since_plan < _settings["guard_steps"]:
            snapshot = _snapshot(function, args)
        try:
            with _own_config(config, state), _eager_context.retrying_calls():
                result = _eager_context.call_unhandled(function, args)
        except tf.errors.ResourceExhaustedError as error:
            report = feedback.planned_report(name) if snapshot is not None else None
            if snapshot is None or report is None:
                _eager_context.tell_out_of_memory(function, error)
                raise
            snapshot.restore()  # the failed attempt's updates never survive
            if state.original:
                feedback.log_original_failed("the call", report, error)
                raise
            action, budget = feedback.after_failed_attempt(
                "the call", report, error, {}, state.retries_done, _settings["retries"])
            if action == "original":
                state.original = True
            else:
                state.budget_bytes = budget
            state.calls_since_plan = 0
            continue
        if state.planned is None:
            try:
                state.planned = feedback.planned_report(name) is not None
            except Exception:  # noqa: BLE001 - no report to read: not guarded again
                state.planned = False
        state.calls_since_plan += 1
        return result


def _snapshot(function, args):
    """A host copy of the function's variables, or None when the call reads a
    resource that is not one of them (then a retry would not repeat the call)."""
    # The graph the function was traced from. A function without one (loaded from a
    # SavedModel) would have its graph rebuilt from its definition, without variables:
    # not guarded.
    graph = getattr(function, "_cached_graph", None)
    if graph is None:
        return None
    try:
        variables = list(graph.variables)
        # A distributed variable (tf.distribute) is read through each replica's
        # component: their handles are the variable's too, and they are put back with it.
        handles = set()
        for var in variables:
            handles.add(id(getattr(var, "handle", None)))
            for component in getattr(var, "values", None) or ():
                handles.add(id(getattr(component, "handle", None)))
        inputs = list(graph.inputs)
        for i, arg in enumerate(args):
            if getattr(arg, "dtype", None) != tf.resource or id(arg) in handles:
                continue
            # The ordering tokens of a replicated step's collectives (MirroredStrategy's
            # all-reduce) only order them: a retry repeats nothing through them.
            if i < len(inputs) and "ordering_token" in inputs[i].name:
                continue
            return None
        return feedback.VariableSnapshot(variables)
    except Exception:  # noqa: BLE001 - a variable gone or unreadable: TF makes the call
        return None


def _own_config(config, state):
    from tfmemopt.retry import _NullContext, budget_edit

    if state.original:
        return budget_edit(config, state.budget_bytes, original=True)
    return _NullContext() if state.budget_bytes is None else budget_edit(config, state.budget_bytes)
