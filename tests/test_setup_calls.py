"""`import tfmemopt; tfmemopt.enable()` at the top of a script leaves TensorFlow's runtime
uninitialized, so every setup call that TF allows only before initialization still works
after it, and the pass still reaches the graph functions traced afterwards.

Each case runs in a fresh interpreter: TF's runtime is initialized once per process.
"""

import pytest

from conftest import run_python

SCRIPT = r'''
import os
import tensorflow as tf
import tfmemopt
from tensorflow.python.eager import context
tfmemopt.enable(budget="1GiB", log_level=0)
assert context.context()._context_handle is None, "enable() initialized TF's runtime"
{setup}

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, x)))
    return tape.gradient(loss, x)

step(tf.ones([64, 64]))
{check}
seen = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")]
print("REPORTS", len(seen), seen[0].status if seen else "-")
'''

# (setup after enable(), a check after the first step). On a GPU machine the same
# condition guards set_memory_growth and set_visible_devices of GPUs (TF raises
# "... cannot be modified after being initialized" once the context has a handle);
# the first assertion of SCRIPT is that condition.
SETUP_CALLS = {
    "logical_devices": (
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(\n"
        "    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)",
        "assert len(tf.config.list_logical_devices('CPU')) == 2"),
    "inter_op_threads": (
        "tf.config.threading.set_inter_op_parallelism_threads(1)",
        "assert tf.config.threading.get_inter_op_parallelism_threads() == 1"),
    "intra_op_threads": (
        "tf.config.threading.set_intra_op_parallelism_threads(1)",
        "assert tf.config.threading.get_intra_op_parallelism_threads() == 1"),
    "visible_devices": (
        # The CPU equivalent of hiding GPUs: a visible-device list that differs from
        # the default, which TF refuses once initialized.
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(\n"
        "    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "tf.config.set_visible_devices([cpu], 'CPU')",
        "assert tf.config.get_visible_devices('CPU') == [cpu]"),
    "multi_worker_strategy": (
        "os.environ.pop('TF_CONFIG', None)\n"
        "strategy = tf.distribute.MultiWorkerMirroredStrategy()",
        "assert strategy.num_replicas_in_sync == 1"),
    "set_experimental_options_first": (
        "tf.config.optimizer.set_experimental_options({'constant_folding': True})\n"
        "tf.config.threading.set_inter_op_parallelism_threads(2)",
        ""),
}


@pytest.mark.parametrize("name", sorted(SETUP_CALLS))
def test_setup_call_after_enable_works_and_the_pass_still_runs(name):
    setup, check = SETUP_CALLS[name]
    proc = run_python(SCRIPT.format(setup=setup, check=check),
                      env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REPORTS 1 ok" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_disable_before_initialization_leaves_no_trace():
    proc = run_python(SCRIPT.format(
        setup="tfmemopt.disable()\ntf.config.threading.set_inter_op_parallelism_threads(1)",
        check=""), env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REPORTS 0 -" in proc.stdout, proc.stdout


def test_the_context_base_config_is_never_touched():
    # What TF hands to tf.data and to the runtime it creates stays the user's own.
    proc = run_python(
        "import tensorflow as tf, tfmemopt\n"
        "from tensorflow.python.eager import context\n"
        "tfmemopt.enable(budget='1GiB', log_level=0)\n"
        "tf.constant(1.0) + 1\n"
        "ctx = context.context()\n"
        "assert ctx._config is None or not ctx._config.graph_options.rewrite_options"
        ".custom_optimizers, ctx._config\n"
        "assert not ctx.config.graph_options.rewrite_options.custom_optimizers\n"
        "from tfmemopt import _eager_context\n"
        "print('CALL', [c.name for c in _eager_context.current_rewrite_options()"
        ".custom_optimizers])\n",
        env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CALL ['TfMemOpt']" in proc.stdout, proc.stdout
