"""The one place that touches TensorFlow's private eager-context API.

tf.function takes its Grappler config from the eager context's
`function_call_options`, which is thread-local and is rebuilt from `context.config`
whenever it is reset (e.g. by tf.config.optimizer.set_experimental_options). No
public TF2 API sets custom optimizers there, so the custom optimizer entry is put
into the context's base ConfigProto (`Context._config`), which every thread's
options are built from, and the `function_call_options` getter is wrapped so that
threads with options cached before the change rebuild them.
tests/test_enable.py pins this behaviour down.
"""

import threading

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context as _context

# Each update bumps the generation. Every thread remembers the generation its cached
# function_call_options were built under; a thread whose cache is older rebuilds it
# (from the updated base config) on its next graph-function call. Without this, a
# thread that already ran a tf.function before enable() would keep the old config.
_generation = 0
_thread_generation = threading.local()
_original_options_property = _context.Context.function_call_options


def _function_call_options(self):
    if getattr(_thread_generation, "value", 0) != _generation and self is _context.context():
        self._thread_local_data.function_call_options = None
        _thread_generation.value = _generation
    return _original_options_property.fget(self)


_context.Context.function_call_options = property(
    _function_call_options, _original_options_property.fset,
    doc=_original_options_property.__doc__)


def update_base_config(update):
    """Applies `update(config_proto)` to a copy of the context's base config and
    installs it, so every later graph function in every thread is built with it.

    Every thread picks it up on its next graph-function call, including threads
    that ran tf.functions before.
    """
    global _generation
    ctx = _context.context()
    # Physical devices are discovered once, and that is when TF imports _config
    # (device counts, GPU visibility). Doing it first means our copy of the config
    # is never imported as device settings.
    ctx._initialize_physical_devices()
    # The context reads its config once, when it is initialized, and gives it to
    # what it creates (tf.data's functions among them). Initializing it first keeps
    # our entry out of that: it lives only in the base config that graph functions'
    # call options are built from, which disable() can take back.
    ctx.ensure_initialized()
    config = config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    update(config)
    ctx._config = config
    _generation += 1  # every thread rebuilds its options from ctx.config on next use


def current_rewrite_options():
    """The RewriterConfig that graph functions of the calling thread are built with."""
    options = _context.context().function_call_options
    return config_pb2.ConfigProto.FromString(
        options.config_proto_serialized).graph_options.rewrite_options
