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


def _rewrite_options_with(entry, pass_name):
    ctx = _context.context()
    # Physical devices are discovered once, and that is when TF imports _config
    # (device counts, GPU visibility). Doing it first means our copy of the config
    # is never imported as device settings.
    ctx._initialize_physical_devices()
    config = config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    rewrite = config.graph_options.rewrite_options
    kept = [c for c in rewrite.custom_optimizers if c.name != pass_name]
    del rewrite.custom_optimizers[:]
    rewrite.custom_optimizers.extend(kept)
    if entry is not None:
        rewrite.custom_optimizers.add().CopyFrom(entry)
    return ctx, config


def set_custom_optimizer(entry, pass_name):
    """Makes every later graph function in every thread run `entry`.

    `entry=None` removes the pass again. Threads that already ran a tf.function keep
    their cached options until they are reset; new threads and the calling thread
    pick up the change at once.
    """
    ctx, config = _rewrite_options_with(entry, pass_name)
    ctx._config = config
    ctx.function_call_options = None  # rebuilt from ctx.config on next use


def current_custom_optimizer(pass_name):
    """The entry that graph functions of the calling thread would run, or None."""
    options = _context.context().function_call_options
    config = config_pb2.ConfigProto.FromString(options.config_proto_serialized)
    for entry in config.graph_options.rewrite_options.custom_optimizers:
        if entry.name == pass_name:
            return entry
    return None
