"""The one place that touches TensorFlow's private eager-context API.

tf.function takes its Grappler config from the eager context's
`function_call_options`: a FunctionCallOptions per thread, built from `context.config`
when the thread first needs it and rebuilt whenever it is reset (e.g. by
tf.config.optimizer.set_experimental_options). No public TF2 API puts a custom
optimizer there, so the `function_call_options` getter is wrapped: every time a
thread's options are built, tfmemopt's config edits (the custom optimizer entry, and
the memory_optimization level the benchmarks set) are applied to them.

Nothing here initializes TensorFlow's runtime. TF lets thread pools, virtual devices,
GPU memory growth and visibility, and collective ops be configured only before its
context is initialized, and `import tfmemopt; tfmemopt.enable()` comes first in a
script, before those calls. The edits live in this module until a thread builds its
options (at its first graph-function call, when TF initializes anyway), and the
context's own base config (`Context._config`, which TF reads once at initialization
and gives to what it creates, tf.data's functions among them) is never touched.
tests/test_enable.py and tests/test_setup_calls.py pin this behaviour down.
"""

import threading

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context as _context

# name -> edit(ConfigProto), applied in insertion order to every thread's call config.
_edits = {}
_edits_lock = threading.Lock()
# Each change bumps the generation. Every thread remembers the generation its cached
# function_call_options were built under; a thread whose cache is older rebuilds it
# on its next graph-function call. Without this, a thread that already ran a
# tf.function before enable() would keep the old config.
_generation = 0
_thread_generation = threading.local()
# One more edit for the calling thread only, after the others (thread_config_edit).
_thread_override = threading.local()
_original_options_property = _context.Context.function_call_options


# One last edit for the calling thread's current graph-function call (call_config_edit),
# after the override: what only the call's inputs tell (call_batch.py).
_thread_call_edit = threading.local()


def _apply_edits(options, override=None, call_edit=None):
    with _edits_lock:
        edits = list(_edits.values())
    if not edits and override is None:
        return  # no tfmemopt entry for a call edit to complete
    if override is not None:
        edits.append(override)
    if call_edit is not None:
        edits.append(call_edit)
    config = config_pb2.ConfigProto.FromString(options.config_proto_serialized)
    for edit in edits:
        edit(config)
    options.config_proto_serialized = config


# The eager context's handle last handed to the pass (see hand_over_function_bodies).
_handed_handle = None


def hand_over_function_bodies(ctx=None):
    """Tells the pass which eager context holds the bodies of functions that Grappler
    gives it as signatures only (calls XLA compiles; grappler/analyze/function_bodies.h).
    Does nothing before TF's runtime is initialized (no handle yet), so it never
    initializes it; called again on every graph-function call, it follows a context
    that was reset."""
    global _handed_handle
    ctx = ctx if ctx is not None else _context.context()
    # The raw attribute: the `_handle` property raises until the runtime starts.
    handle = getattr(ctx, "_context_handle", None)
    if handle is None or handle is _handed_handle:
        return
    from tfmemopt._loader import load_extension

    load_extension().set_eager_context(handle)
    _handed_handle = handle


def _function_call_options(self):
    if self is _context.context():
        hand_over_function_bodies(self)
        data = self._thread_local_data
        override = getattr(_thread_override, "edit", None)
        call_key, call_edit = getattr(_thread_call_edit, "value", (None, None))
        state = (_generation, getattr(_thread_override, "serial", 0), call_key)
        if getattr(_thread_generation, "value", None) != state:
            data.function_call_options = None
            _thread_generation.value = state
        if data.function_call_options is None:
            options = _original_options_property.fget(self)
            _apply_edits(options, override, call_edit)
            return options
    return _original_options_property.fget(self)


_context.Context.function_call_options = property(
    _function_call_options, _original_options_property.fset,
    doc=_original_options_property.__doc__)


def set_config_edit(name, edit):
    """Installs `edit(config_proto)` under `name` (replacing an earlier edit of that
    name; None removes it). Every thread applies the edits to the config its graph
    functions are built with, on its next graph-function call, including threads
    that ran tf.functions before. TensorFlow's runtime is not initialized by this.
    """
    global _generation
    with _edits_lock:
        if edit is None:
            _edits.pop(name, None)
        else:
            _edits[name] = edit
        _generation += 1


class thread_config_edit:
    """Within this context, the calling thread's graph functions are built with
    `edit(config_proto)` applied after the process-wide edits (tfmemopt.function's
    own budget after a retry). Nests; TF's runtime is not initialized by it."""

    _serials = iter(range(1, 1 << 62))

    def __init__(self, edit):
        self._edit = edit
        self._serial = next(thread_config_edit._serials)
        self._saved = (None, 0)

    def __enter__(self):
        self._saved = (getattr(_thread_override, "edit", None),
                       getattr(_thread_override, "serial", 0))
        _thread_override.edit, _thread_override.serial = self._edit, self._serial
        return self

    def __exit__(self, *exc):
        _thread_override.edit, _thread_override.serial = self._saved
        return False


class call_config_edit:
    """Within this context, the calling thread's graph functions are built with
    `edit(config_proto)` applied after every other edit; `key` (hashable) names the
    edit, so that calls under equal keys share their built config (and TF its
    instantiation of a function). Restores the previous call edit on exit."""

    def __init__(self, key, edit):
        self._value = (key, edit)
        self._saved = (None, None)

    def __enter__(self):
        self._saved = getattr(_thread_call_edit, "value", (None, None))
        _thread_call_edit.value = self._value
        return self

    def __exit__(self, *exc):
        _thread_call_edit.value = self._saved
        return False


def current_rewrite_options():
    """The RewriterConfig that graph functions of the calling thread are built with."""
    options = _context.context().function_call_options
    return config_pb2.ConfigProto.FromString(
        options.config_proto_serialized).graph_options.rewrite_options


# --- Where tfmemopt cannot act: observers of graph-function calls and Sessions ---
#
# Grappler (and so the pass) never sees a graph that XLA compiles (jit_compile=True),
# a graph below the meta-optimizer's min_graph_nodes, any graph when the
# meta-optimizer is disabled, or a Session's graph under place_pruned_graph=True
# (tf.compat.v1.InteractiveSession sets it); and no graph is built at all for a
# tf.function that runs eagerly (tf.config.run_functions_eagerly(True)).
# tfmemopt.explain (explanation.py) tells the user; these hooks are how it finds out.

from tensorflow.python.client import session as _session  # noqa: E402
from tensorflow.python.framework import errors as _errors  # noqa: E402
from tensorflow.python.eager.polymorphic_function import atomic_function as _atomic  # noqa: E402
from tensorflow.python.eager.polymorphic_function import polymorphic_function as _polymorphic  # noqa: E402

_call_observer = None     # observer(atomic_function), on eager calls of graph functions
_session_observer = None  # observer(config_proto or None), when a Session is created
_eager_run_observer = None  # observer(tf.function), when a tf.function runs eagerly
_oom_observer = None  # observer(atomic_function, error), when a call runs out of memory
_build_handler = None  # build_fallback.py: graphs TF could not build as the pass rewrote them
# handler(atomic_function, args) -> outputs: makes the eager calls of graph functions
# outside retrying_calls (function_guard.py, under tfmemopt.enable()); None: TF's call.
_call_handler = None
_retrying = threading.local()  # depth of retrying_calls in this thread
_original_call_flat = _atomic.AtomicFunction.call_flat
_original_run_eagerly = _polymorphic.Function._run_functions_eagerly  # a property
_original_session_init = _session.BaseSession.__init__


# resolver(atomic_function, args) -> (key, edit) or None: a config edit that only the
# call's inputs tell (call_batch.py: the batch of inputs whose batch dimension the
# graph leaves unknown).
_call_edit_resolver = None


def _call_flat(self, *args):
    eager = self._bound_context.executing_eagerly()
    resolver = _call_edit_resolver
    call_edit = None
    if resolver is not None and eager:
        try:
            call_edit = resolver(self, args)
        except Exception:  # noqa: BLE001 - the call goes on as configured
            call_edit = None
    if call_edit is None:
        return _call_flat_observed(self, eager, args)
    with call_config_edit(*call_edit):
        return _call_flat_observed(self, eager, args)


def _call_flat_observed(self, eager, args):
    observer = _call_observer
    if observer is not None and eager:
        observer(self)
    handler = _call_handler
    if handler is not None and eager and not getattr(_retrying, "depth", 0):
        # The handler makes the call (call_unhandled), maybe again after re-planning.
        return handler(self, args)
    return call_unhandled(self, args)


def call_unhandled(function, args):
    """Calls the graph function as TF does; an out-of-memory error is told to the
    observer (unless a wrapper handles it: retrying_calls) and raised. A function
    whose rewritten graph TF could not build is called as TF built it
    (build_fallback.py)."""
    handler = _build_handler
    context = handler(function, None) if handler is not None else None
    while True:
        try:
            if context is None:
                return _original_call_flat(function, *args)
            with context:
                return _original_call_flat(function, *args)
        except _errors.ResourceExhaustedError as error:
            if not getattr(_retrying, "depth", 0):
                tell_out_of_memory(function, error)
            raise
        except _errors.InvalidArgumentError as error:
            if handler is None or context is not None:
                raise
            context = handler(function, error)
            if context is None:
                raise


def tell_out_of_memory(function, error):
    """Tells the observer of a call that ran out of memory (explanation.py's hint)."""
    oom_observer = _oom_observer
    if oom_observer is not None:
        try:
            oom_observer(function, error)
        except Exception:  # noqa: BLE001 - telling the user must not hide TF's error
            pass


class retrying_calls:
    """Inside: calls of graph functions whose out-of-memory errors a wrapper handles
    itself (tfmemopt.function, the Keras callback), so the observer is not told."""

    def __enter__(self):
        _retrying.depth = getattr(_retrying, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _retrying.depth -= 1
        return False


def _functions_run_eagerly(self):
    # Function.__call__ reads this property first and, when it is True, runs the Python
    # function itself: no graph function is called, so call_flat's observer never hears
    # of it. Observing the read (not wrapping __call__) adds no frame to tracebacks.
    run_eagerly = _original_run_eagerly.fget(self)
    observer = _eager_run_observer
    if run_eagerly and observer is not None:
        observer(self)
    return run_eagerly


def _session_init(self, target="", graph=None, config=None):
    observer = _session_observer
    if observer is not None:
        observer(config)
    _original_session_init(self, target, graph, config)


_atomic.AtomicFunction.call_flat = _call_flat
_polymorphic.Function._run_functions_eagerly = property(_functions_run_eagerly)
_session.BaseSession.__init__ = _session_init


def set_build_handler(handler):
    """Installs handler(atomic_function, error or None) -> a context to make the call
    in, or None (build_fallback.py): asked before each call, and after a call that
    failed with an InvalidArgumentError."""
    global _build_handler
    _build_handler = handler


def set_call_edit_resolver(resolver):
    """Installs resolver(atomic_function, args) -> (key, edit) or None, asked before
    each eager graph-function call (call_batch.py); None removes it."""
    global _call_edit_resolver
    _call_edit_resolver = resolver


def set_call_handler(handler):
    """Installs the handler of eager graph-function calls (None: TF calls them)."""
    global _call_handler
    _call_handler = handler


def set_observers(call_observer, session_observer, eager_run_observer=None,
                  oom_observer=None):
    """Installs the observers (None removes one)."""
    global _call_observer, _session_observer, _eager_run_observer, _oom_observer
    _call_observer, _session_observer = call_observer, session_observer
    _eager_run_observer, _oom_observer = eager_run_observer, oom_observer


def function_definition(function):
    """(name, FunctionDef) of an AtomicFunction."""
    return function.name.decode(), function.cached_definition
