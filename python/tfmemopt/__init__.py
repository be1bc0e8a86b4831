"""tfmemopt: a memory optimizer for TensorFlow training (a Grappler pass).

One line enables it for everything traced afterwards:

    import tfmemopt
    tfmemopt.enable(budget="6GiB")      # or a fraction of device memory, e.g. 0.8

For v1 Sessions: tf.compat.v1.Session(config=tfmemopt.config_proto(budget="6GiB")).
Under enable(), a Keras `fit` retries a batch that runs out of memory (fit_retries), and
so does a plain tf.function in its first calls (function_retries); for a fit of its own
budget: model.fit(..., callbacks=[tfmemopt.keras.MemoryOptimizer(budget="6GiB")]).
"""

import json as _json
import threading as _threading

from tensorflow.core.protobuf import rewriter_config_pb2 as _rewriter_config_pb2

from tfmemopt._loader import load_extension as _load_extension

_ext = _load_extension()

from tfmemopt import _eager_context, _keras_hook, build_fallback, call_batch  # noqa: E402
from tfmemopt import function_guard, memory_pool  # noqa: E402
from tfmemopt.config import (  # noqa: E402
    MEMORY_OPTIMIZATION_LEVELS,
    PASS_NAME,
    MemoryOptimizerConfig,
    config_proto,
    custom_optimizer_entry,
    make_config,
    parse_size,
    rewriter_config,
    with_entry,
)
from tfmemopt.report import Report  # noqa: E402
from tfmemopt.analysis import analyze, analyze_metagraph  # noqa: E402
from tfmemopt.hints import recompute_scope  # noqa: E402
from tfmemopt.maxbatch import MaxBatchResult, TrialError, find_max_batch  # noqa: E402
from tfmemopt.explanation import Explanation, explain, install as _install_observers  # noqa: E402
from tfmemopt.retry import Function, function  # noqa: E402

_install_observers()
build_fallback.install()

__version__ = "0.1.0"

_lock = _threading.Lock()
_enabled = None  # the MemoryOptimizerConfig in force, or None
_fit_retries = 0  # enable()'s fit_retries
_function_retries = 0  # enable()'s function_retries


def enable(budget=None, *, fit_retries=3, function_retries=3, reserve_memory=False, **fields):
    """Runs TfMemOpt on every tf.function, Keras fit and distribute graph traced
    afterwards, in any thread.

    budget: bytes (int), a size string ('6GiB', '512MB') or a fraction of the device
    memory in (0, 1]; default: budget_fraction=0.9. Other keywords are fields of
    tfmemopt.MemoryOptimizerConfig (see README). Invalid arguments raise
    ValueError/TypeError before anything changes. Returns the config in force.

    fit_retries: every Keras `fit` called while enabled gets a
    tfmemopt.keras.MemoryOptimizer with this config and this many retries: a batch
    that runs out of memory is re-planned under a lower budget and retried, and the
    first steps of each plan are measured (docs/usage.md#keras). 0 leaves `fit`
    as Keras runs it (the pass still plans its step). A fit that has its own
    MemoryOptimizer keeps it.

    function_retries: a plain tf.function called while enabled whose planned graph
    runs out of memory in one of its first calls is re-planned under a lower budget
    and retried with the same inputs this many times, its variables put back first
    (tfmemopt.function_guard; docs/usage.md#when-a-plan-runs-out-of-memory). 0 leaves its calls
    as TF makes them.

    reserve_memory: on the CPU test bed (TF_CPU_ALLOCATOR_USE_BFC=true), whose BFC
    allocator grows in regions of 2 MiB, 4 MiB, ... that a tensor cannot straddle,
    True reserves its pool now: the small regions growth starts with, then the rest
    of its limit as one region, as a GPU without memory growth has it, and plans for
    that layout (allocator_region_bytes; docs/allocator.md#reserving-the-pool): a
    tensor may then be as large as the large region's free bytes. Touches no page
    and does not initialize TF. Off by default: the memory model is calibrated on
    growing pools. Without a capped BFC allocator it does nothing.
    """
    global _enabled, _fit_retries, _function_retries
    for name, value in (("fit_retries", fit_retries), ("function_retries", function_retries)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"tfmemopt.enable: {name}={value!r}; allowed: an int >= 0")
    if not isinstance(reserve_memory, bool):
        raise ValueError(f"tfmemopt.enable: reserve_memory={reserve_memory!r}; allowed: "
                         f"True or False")
    make_config(budget, **fields)  # raises on a bad argument before anything changes
    if reserve_memory and "allocator_region_bytes" not in fields:
        memory_pool.reserve_cpu_pool()
    config = make_config(budget, **fields)
    entry = custom_optimizer_entry(config)
    with _lock:
        _eager_context.set_config_edit(
            PASS_NAME, lambda proto: with_entry(proto.graph_options.rewrite_options, entry))
        _enabled = config
        _fit_retries, _function_retries = fit_retries, function_retries
        function_guard.install_for(config, function_retries)
    _keras_hook.watch_fit(_fit_callbacks)
    return config


def set_tf_memory_optimization(level):
    """Sets TF's built-in Grappler memory optimizer level (RewriterConfig's
    memory_optimization, which TF2 offers no public API for) for every tf.function,
    Keras fit and distribute graph traced afterwards, with or without enable().

    level: one of tfmemopt.MEMORY_OPTIMIZATION_LEVELS ("NO_MEM_OPT", ...), or None for
    TF's default. At its default level TF turns a large sum of three or more gradients
    into AssignAdds that add each term as it finishes (Report.arrival_order_sums): its
    last bits then follow the execution order, which differs from run to run with
    several inter-op threads and which any memory rewrite changes. "NO_MEM_OPT" keeps
    such sums AddNs, added in a fixed order (docs/design.md#arrival-order-sums). A v1
    Session takes the level from its own ConfigProto
    (graph_options.rewrite_options.memory_optimization).
    """
    if level is not None and level not in MEMORY_OPTIMIZATION_LEVELS:
        raise ValueError(f"tfmemopt.set_tf_memory_optimization: level={level!r}; allowed: "
                         f"None or one of {', '.join(MEMORY_OPTIMIZATION_LEVELS)}")
    edit = None
    if level is not None:
        value = _rewriter_config_pb2.RewriterConfig.MemOptType.Value(level)

        def edit(proto):
            proto.graph_options.rewrite_options.memory_optimization = value

    with _lock:
        _eager_context.set_config_edit("memory_optimization", edit)


def _retry_keywords():
    """enable()'s own keywords as they are in force, for code that calls enable() again
    with other fields (the Keras callback) and must leave them as the user set them."""
    return {"fit_retries": _fit_retries, "function_retries": _function_retries}


def _fit_callbacks(model, callbacks):
    """_keras_hook's provider: what a Keras fit gets under enable()."""
    if _enabled is None or _fit_retries <= 0:
        return None
    from tfmemopt import keras as tfmemopt_keras

    return tfmemopt_keras.enabled_fit_callbacks(model, callbacks, _fit_retries)


def disable():
    """Undoes enable(): graphs traced afterwards no longer run TfMemOpt."""
    global _enabled
    with _lock:
        _eager_context.set_config_edit(PASS_NAME, None)
        _enabled = None
        function_guard.uninstall()


def enabled_config():
    """The MemoryOptimizerConfig set by enable(), or None."""
    return _enabled


def reports():
    """One Report per graph the pass optimized in this process, newest last."""
    return [Report(_json.loads(text)) for text in _ext.reports()]


def clear_reports():
    _ext.clear_reports()


def host_memory_stats(reset_peak=False):
    """The host memory pool that swapped-out tensors live in (outside TensorFlow's
    allocators), as a dict: bytes_in_use, peak_bytes, swap_outs, swap_ins, and
    cached_bytes (freed blocks the pool keeps for the next swap-outs of their size).

    reset_peak=True restarts peak_bytes from bytes_in_use after reading.
    """
    stats = _ext.host_pool_stats()
    if reset_peak:
        _ext.reset_host_pool_peak()
    return stats


def __getattr__(name):
    # tfmemopt.keras imports Keras, so it loads on first use, not with tfmemopt.
    if name == "keras":
        import importlib

        return importlib.import_module("tfmemopt.keras")
    raise AttributeError(f"module 'tfmemopt' has no attribute {name!r}")


__all__ = [
    "analyze",
    "analyze_metagraph",
    "MaxBatchResult",
    "MemoryOptimizerConfig",
    "PASS_NAME",
    "Report",
    "clear_reports",
    "config_proto",
    "disable",
    "enable",
    "enabled_config",
    "Explanation",
    "explain",
    "find_max_batch",
    "Function",
    "function",
    "host_memory_stats",
    "keras",
    "make_config",
    "MEMORY_OPTIMIZATION_LEVELS",
    "parse_size",
    "reports",
    "recompute_scope",
    "rewriter_config",
    "set_tf_memory_optimization",
    "TrialError",
]
