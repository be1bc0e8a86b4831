"""The one place that touches TensorFlow's private eager-context API.

tf.function takes its Grappler config from the eager context's
`function_call_options`, which is thread-local and is rebuilt from `context.config`
whenever it is reset (e.g. by tf.config.optimizer.set_experimental_options). No
public TF2 API sets custom optimizers there, so the custom optimizer entry is put
into the context's base ConfigProto (`Context._config`), which every thread's
options are built from. tests/test_enable.py pins this behaviour down.
"""

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context as _context


def update_base_config(update):
    """Applies `update(config_proto)` to a copy of the context's base config and
    installs it, so every later graph function in every thread is built with it.

    The calling thread picks it up at once; other threads when their options are
    next rebuilt (new threads: on their first tf.function call).
    """
    ctx = _context.context()
    # Physical devices are discovered once, and that is when TF imports _config
    # (device counts, GPU visibility). Doing it first means our copy of the config
    # is never imported as device settings.
    ctx._initialize_physical_devices()
    config = config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    update(config)
    ctx._config = config
    ctx.function_call_options = None  # rebuilt from ctx.config on next use


def current_rewrite_options():
    """The RewriterConfig that graph functions of the calling thread are built with."""
    options = _context.context().function_call_options
    return config_pb2.ConfigProto.FromString(
        options.config_proto_serialized).graph_options.rewrite_options
