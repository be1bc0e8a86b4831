"""The runtime feedback loop: a planned step that runs out of memory is re-planned under
a lower budget and retried with the same inputs, in tfmemopt.function and in the Keras
callback, and its results equal, bit for bit, those of a run that never ran out of
memory; the first steps' measured peak goes into the report.

The out-of-memory errors are real: the allocator is capped (TF's BFC CPU allocator, a
fresh interpreter per run), and the script holds HOG_MB of that memory in an eager
tensor before it trains, as a program holding another model or a prefetched batch
would. The budget is given in bytes, which is the step's own: the plan does not take
the hog from it, so the first plan, which fits its budget, does not fit what is left
(a budget given as a fraction of the device would: the last test). Every step of these short
runs is guarded (guard_steps=10), so that whichever step runs out of memory (TF's
order, and with it the peak, moves from step to step near the limit) is retried.

Splitting is kept out (enable_split=False): these tests are about the retry, and a
split changes the order of weight-gradient sums.
"""

import re

import pytest
import tensorflow as tf

import tfmemopt
from conftest import capped_allocator_env, run_python, subprocess_result
from tfmemopt import feedback

CAP_MB = 36
HOG_MB = 8  # held outside the step: 28 MiB are left for it
FIRST_BUDGET = 34_000_000  # fits the 36 MiB device, not the 28 MiB left: out of memory
RETRIES = 10  # each retry lowers the budget by at least 5 %: about 5 are needed here

_CUSTOM_LOOP = r'''
import json, os, sys
import tensorflow as tf
import tfmemopt
sys.path.insert(0, sys.argv[1])
from conftest import chain_mlp
mode = sys.argv[2]
step, x, ws = chain_mlp(depth=24)
if mode in ("plain_step", "plain_step_unknown_batch", "plain_step_untold_batch"):
    # enable(function_retries=0), a plain tf.function: nothing retries the step.
    hog = tf.fill([int(sys.argv[4]) << 18], 1.0)
    tfmemopt.enable(budget=int(sys.argv[3]), function_retries=0, enable_split=False,
                    log_level=0)
    args = (x,)
    if mode == "plain_step_unknown_batch":  # the call tells the batch (call_batch.py)
        step = tf.function(step.python_function, input_signature=[tf.TensorSpec([None, 256])])
    if mode == "plain_step_untold_batch":  # inputs that disagree on it tell none
        body = step.python_function
        step = tf.function(lambda x, other: body(x), input_signature=[
            tf.TensorSpec([None, 256]), tf.TensorSpec([None])])
        args = (x, tf.zeros([3]))
    try:
        for _ in range(2):
            step(*args)
        print("RESULT " + json.dumps({"out_of_memory": False}))
    except tf.errors.ResourceExhaustedError:
        print("RESULT " + json.dumps({"out_of_memory": True}))
    sys.exit(0)
if mode == "guarded":
    # enable() alone, a plain tf.function: the guard retries its first calls.
    hog = tf.fill([int(sys.argv[4]) << 18], 1.0)
    tfmemopt.enable(budget=int(sys.argv[3]), function_retries=int(sys.argv[5]),
                    enable_split=False, log_level=0)
if mode in ("retry", "counted"):
    hog = tf.fill([int(sys.argv[4]) << 18], 1.0)  # HOG_MB MiB held for the whole run
    # "counted": the same budget, as the fraction of the capped device it is, which
    # counts the memory held outside the step; "retry": in bytes, which does not.
    budget = int(sys.argv[3])
    if mode == "counted":
        budget = budget / (int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) << 20)
    tfmemopt.enable(budget=budget, enable_split=False, log_level=0)
    step = tfmemopt.function(step.python_function, retries=int(sys.argv[5]), guard_steps=10)
losses = [float(step(x)).hex() for _ in range(3)]
out = {"losses": losses, "weights": [w.numpy().tobytes().hex()[:4096] for w in ws]}
if mode in ("retry", "counted"):
    report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")][-1]
    out.update(retries=step.retries_done, measured=report.measured_peak_bytes,
               predicted=report.predicted_peak_bytes["after"], budget=report.budget_bytes,
               held=report.held_outside_bytes, text=report.to_text())
if mode == "guarded":
    from tfmemopt import function_guard
    report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")][-1]
    out.update(retries=function_guard.retries_done(), budget=report.budget_bytes)
print("RESULT " + json.dumps(out))
'''


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return subprocess_result(proc), proc.stderr


def _capped(mb):
    return capped_allocator_env(mb, TF_CPP_MIN_LOG_LEVEL="1")


TESTS = __import__("os").path.dirname(__file__)


@pytest.mark.parametrize("mode, logged", [
    ("retry", "retrying the step (retry"),   # tfmemopt.function
    ("guarded", "retrying the call (retry"),  # a plain tf.function under enable() alone
])
def test_custom_loop_retries_until_it_fits_and_equals_an_uncapped_run(mode, logged):
    plain, _ = _result(run_python(_CUSTOM_LOOP, TESTS, "plain", env=_capped(1024)))
    retried, log = _result(run_python(_CUSTOM_LOOP, TESTS, mode, FIRST_BUDGET, HOG_MB,
                                      RETRIES, env=_capped(CAP_MB)))
    assert retried["retries"], "the first plan did not run out of memory"
    assert log.count(logged) == len(retried["retries"])
    assert "although tfmemopt planned it" not in log  # the retry says what it does
    budgets = [r["new_budget_bytes"] for r in retried["retries"]]
    assert budgets == sorted(budgets, reverse=True)  # each retry plans lower
    assert retried["budget"]["CPU:0"] == budgets[-1]  # the plan that trained
    assert retried["losses"] == plain["losses"]
    assert retried["weights"] == plain["weights"]
    if mode == "retry":
        # Measured: the first steps of the plan that trained, under the cap.
        assert 0 < retried["measured"]["CPU:0"] <= CAP_MB * 2**20


# The last resort: a plan that is wrong about real memory where the graph as TF built
# it is right. test_only_hold_bytes makes every changed graph hold a buffer the
# prediction does not count (grappler/rewrite/test_only_hold.h), so that every plan
# runs out of memory under a cap the original step trains under.
AS_BUILT_CAP_MB = 40     # the 24-layer MLP's step peaks at about 36.3 MiB as TF built it
AS_BUILT_BUDGET = 25_000_000  # the pass plans it to about 23 MiB...
AS_BUILT_HOLD = 20_000_000    # ...and holds 19 MiB more: over 40 MiB with every plan

_AS_BUILT = r"""
import json, sys
import tensorflow as tf
import tfmemopt
sys.path.insert(0, sys.argv[1])
from conftest import chain_mlp
mode = sys.argv[2]
step, x, ws = chain_mlp(depth=24)
if mode != "plain":
    tfmemopt.enable(budget=int(sys.argv[3]), test_only_hold_bytes=int(sys.argv[4]),
                    function_retries=1, enable_split=False, log_level=0)
if mode == "function":
    step = tfmemopt.function(step.python_function, retries=1)
try:
    losses = [float(step(x)).hex() for _ in range(3)]
except tf.errors.ResourceExhaustedError:
    print("RESULT " + json.dumps({"out_of_memory": True}))
    sys.exit(0)
reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")]
print("RESULT " + json.dumps({
    "losses": losses, "weights": [w.numpy().tobytes().hex()[:4096] for w in ws],
    "modes": [r.mode for r in reports], "changed": [r.graph_changed for r in reports],
    "original": getattr(step, "original", None)}))
"""


@pytest.mark.parametrize("mode, what", [("guarded", "the call"), ("function", "the step")])
def test_a_step_that_trains_without_tfmemopt_trains_with_it_when_every_plan_runs_out(mode, what):
    """Every plan runs out of memory (one re-plan, then the original): the step runs
    as TF built it, trains, and its losses and weights are the plain run's."""
    plain, _ = _result(run_python(_AS_BUILT, TESTS, "plain", env=_capped(AS_BUILT_CAP_MB)))
    assert "losses" in plain, "the step as TF built it must train under the cap"
    mine, log = _result(run_python(_AS_BUILT, TESTS, mode, AS_BUILT_BUDGET, AS_BUILT_HOLD,
                                   env=_capped(AS_BUILT_CAP_MB)))
    assert "losses" in mine, log[-3000:]
    assert log.count(f"retrying {what} (retry") == 1
    assert log.count(f"after 1 re-plan(s); running {what} as TF built it") == 1
    # Two plans, both changed and out of memory, then the graph as it was built.
    assert mine["modes"] == ["AUTO", "AUTO", "ANALYZE_ONLY"]
    assert mine["changed"] == [True, True, False]
    assert mine["losses"] == plain["losses"]
    assert mine["weights"] == plain["weights"]
    if mode == "function":
        assert mine["original"] is True


@pytest.mark.parametrize("cap_mb, tried", [
    (32, True),   # the original's 35.3 MiB prediction is within 1.25x of 32 MiB: tried
    (24, False),  # and far over 24 MiB: not tried
])
def test_the_graph_as_tf_built_it_is_tried_only_where_it_may_fit(cap_mb, tried):
    result, log = _result(run_python(_AS_BUILT, TESTS, "guarded", AS_BUILT_BUDGET,
                                     AS_BUILT_HOLD, env=_capped(cap_mb)))
    assert result == {"out_of_memory": True}
    assert ("running the call as TF built it" in log) == tried, log[-3000:]
    assert ("as TF built it too, as it would without tfmemopt" in log) == tried


def _planned(before, after, budget=80 << 20, memory=100 << 20):
    """A report of a graph the pass changed: peaks `before` and `after` the plan."""
    return tfmemopt.Report({
        "graph_id": "g", "status": "ok", "failed_stage": "", "message": "", "mode": "AUTO",
        "num_nodes": 1, "num_tensors": 1, "unresolved_tensors": 0, "graph_changed": True,
        "stage_seconds": {}, "total_seconds": 0.0,
        "devices": [{"device": "CPU:0", "budget_bytes": budget, "persistent_bytes": 0,
                     "memory_bytes": memory, "peak_before_bytes": before,
                     "peak_after_bytes": after, "top_tensors_at_peak": []}]})


_OOM_1MIB = tf.errors.ResourceExhaustedError(
    None, None, "OOM when allocating tensor with shape[256,1024] and type float on "
    "/job:localhost/replica:0/task:0/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu")


@pytest.mark.parametrize("after, retries_done, retries, want", [
    (78 << 20, 0, 3, "replan"),     # the plan met its budget: re-planned lower first
    (78 << 20, 3, 3, "original"),   # re-plans used up: as TF built it
    (90 << 20, 0, 3, "original"),   # missed its budget: a lower one changes nothing
    (78 << 20, 0, 0, "raise"),      # retries=0: nothing is tried again
])
def test_after_a_failed_attempt_re_plans_then_runs_the_graph_as_tf_built_it(
        after, retries_done, retries, want):
    done = [{}] * retries_done
    try:
        action, budget = feedback.after_failed_attempt(
            "the call", _planned(110 << 20, after), _OOM_1MIB, {}, done, retries)
    except tf.errors.ResourceExhaustedError:
        action, budget = "raise", None
    assert action == want
    if want == "replan":
        assert budget < (78 << 20) * 0.951 and len(done) == 1  # 5 % under the prediction


def test_a_graph_far_over_the_device_is_not_run_as_tf_built_it():
    with pytest.raises(tf.errors.ResourceExhaustedError):
        feedback.after_failed_attempt("the call", _planned(200 << 20, 90 << 20), _OOM_1MIB,
                                      {}, [], 3)


def test_original_graph_may_train_only_for_a_changed_graph_within_reach_of_the_device():
    report = _planned(125, 80, budget=80, memory=100)
    assert feedback.original_graph_may_train(report, "CPU:0")  # 125 = 1.25 x 100
    report.predicted_peak_bytes["before"]["CPU:0"] = 126
    assert not feedback.original_graph_may_train(report, "CPU:0")
    report.memory_bytes["CPU:0"] = 0  # unknown device memory: tried
    assert feedback.original_graph_may_train(report, "CPU:0")
    report.graph_changed = False  # the same graph would run out of memory the same way
    assert not feedback.original_graph_may_train(report, "CPU:0")


# Both Keras scripts below train this model: 24 Dense layers of 256 units.
_KERAS_MODEL = r'''
import json, sys
import numpy as np
import keras, tensorflow as tf
import tfmemopt
from tfmemopt.keras import MemoryOptimizer
mode = sys.argv[1]
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,))] +
                         [keras.layers.Dense(256, activation="relu") for _ in range(24)] +
                         [keras.layers.Dense(1)])
'''

_KERAS_LOOP = _KERAS_MODEL + r'''
optimizer = keras.optimizers.Adam(1e-3)  # its moments and step count are made in the first call
rng = np.random.default_rng(0)
x = tf.constant(rng.standard_normal((1024, 256)).astype(np.float32))
y = tf.constant(rng.standard_normal((1024, 1)).astype(np.float32))
if mode == "guarded":
    hog = tf.fill([int(sys.argv[3]) << 18], 1.0)
    tfmemopt.enable(budget=int(sys.argv[2]), function_retries=int(sys.argv[4]),
                    enable_split=False, log_level=0)

@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

losses = [float(step(x, y)).hex() for _ in range(3)]
from tfmemopt import function_guard
print("RESULT " + json.dumps({
    "losses": losses, "retries": len(function_guard.retries_done()),
    "variables": [v.numpy().tobytes().hex()[:2048] for v in model.weights + optimizer.variables]}))
'''


def test_a_keras_custom_loop_under_enable_alone_retries_with_the_optimizers_state():
    """A Keras model and Adam in a plain tf.function, enable() only: the retried calls
    put back the weights and the optimizer's moments and step count, and every
    variable ends as in an uncapped run."""
    no_onednn = {"TF_ENABLE_ONEDNN_OPTS": "0"}  # see test_keras_fit_retries_the_batch...
    plain, _ = _result(run_python(_KERAS_LOOP, "plain", env={**_capped(1024), **no_onednn}))
    guarded, log = _result(run_python(_KERAS_LOOP, "guarded", FIRST_BUDGET, HOG_MB, RETRIES,
                                      env={**_capped(CAP_MB), **no_onednn}))
    assert guarded["retries"] >= 1, log[-3000:]
    assert guarded["losses"] == plain["losses"]
    assert guarded["variables"] == plain["variables"]


_PEAK_KEPT = r'''
import json, sys
import tensorflow as tf
import tfmemopt
sys.path.insert(0, sys.argv[1])
from conftest import chain_mlp
step, x, ws = chain_mlp(depth=24)
tfmemopt.enable(budget=int(sys.argv[2]), enable_split=False, log_level=0)
big = tf.fill([64 << 18], 1.0)  # 64 MiB, then freed: the peak the script reads later
del big
for _ in range(3):
    step(x)
report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")][-1]
print("RESULT " + json.dumps({"peak": tf.config.experimental.get_memory_info("CPU:0")["peak"],
                              "changed": report.graph_changed}))
'''


def test_the_guard_of_a_plain_tf_function_leaves_the_allocators_peak_to_the_user():
    """Guarded calls are not measured: the peak a script reads over its run is TF's."""
    result, _ = _result(run_python(_PEAK_KEPT, TESTS, FIRST_BUDGET, env=_capped(1024)))
    assert result["changed"]  # planned, so its first calls were guarded
    assert result["peak"] >= 64 * 2**20


def test_a_planned_step_that_runs_out_of_memory_without_a_wrapper_says_what_helps():
    result, log = _result(run_python(_CUSTOM_LOOP, TESTS, "plain_step", FIRST_BUDGET, HOG_MB,
                                     env=_capped(CAP_MB)))
    assert result["out_of_memory"]
    lines = [l for l in log.splitlines() if "although tfmemopt planned it" in l]
    assert len(lines) == 1, log[-3000:]  # once, though the error passes several frames
    line = lines[0]
    assert "ran out of memory on CPU:0 (could not allocate" in line
    assert "its plan fits the budget" in line and "budget 32.4 MiB" in line
    assert "tfmemopt.keras.MemoryOptimizer (for fit) and tfmemopt.function" in line
    suggested = int(re.search(r"budget=(\d+)", line).group(1))
    assert 0 < suggested < FIRST_BUDGET


def test_a_step_traced_on_an_unknown_batch_is_planned_for_the_batch_its_call_gives():
    # The call's input tells the batch: planned as the step of known batch is, its
    # out-of-memory hint names a lower budget, not the batch size.
    result, log = _result(run_python(_CUSTOM_LOOP, TESTS, "plain_step_unknown_batch",
                                     FIRST_BUDGET, HOG_MB, env=_capped(CAP_MB)))
    assert result["out_of_memory"]
    (line,) = [l for l in log.splitlines() if "although tfmemopt planned it" in l]
    assert "its plan fits the budget" in line and "budget 32.4 MiB" in line
    assert "unknown dimensions" not in line
    assert 0 < int(re.search(r"budget=(\d+)", line).group(1)) < FIRST_BUDGET


def test_a_step_planned_on_unknown_sizes_that_runs_out_of_memory_asks_for_the_batch_size():
    # Traced with an unknown batch that its inputs do not tell (they disagree on their
    # leading dimension), the plan counts each activation as one element: a lower
    # budget would mean nothing, the batch size does.
    result, log = _result(run_python(_CUSTOM_LOOP, TESTS, "plain_step_untold_batch",
                                     FIRST_BUDGET, HOG_MB, env=_capped(CAP_MB)))
    assert result["out_of_memory"]
    (line,) = [l for l in log.splitlines() if "although tfmemopt planned it" in l]
    assert "of its tensors had unknown dimensions, counted as 1" in line
    assert "enable(assume_batch_size=<the batch size>)" in line
    assert "budget=" not in line.split("re-plan and retry")[1]


_PARTIAL_UPDATE = r'''
import json, sys
import tensorflow as tf
import tfmemopt
# "function": tfmemopt.function's retries; "guarded": enable()'s function_retries.
retries = {"function": 0, "guarded": 2}[sys.argv[1]]
tfmemopt.enable(budget=1 << 30, function_retries=retries, log_level=0)
counter = tf.Variable(0.0)
x = tf.ones([1024, 1024])  # 4 MiB

decorate = tfmemopt.function(retries=2) if sys.argv[1] == "function" else tf.function

@decorate
def step(x):
    with tf.control_dependencies([counter.assign_add(1.0)]):
        # 64 MiB at once: more than the 48 MiB cap whatever the plan.
        big = tf.tile(x, [16, 1])
    return tf.reduce_sum(tf.tanh(big))

try:
    step(x)
    error = None
except tf.errors.ResourceExhaustedError as e:
    error = type(e).__name__
from tfmemopt import function_guard
retries = step.retries_done if sys.argv[1] == "function" else function_guard.retries_done()
print("RESULT " + json.dumps({"error": error, "counter": float(counter.numpy()),
                              "retries": len(retries)}))
'''


def test_memory_held_outside_the_step_is_taken_from_its_budget():
    """The same run with the budget given as a fraction of the device's memory: the
    plan gets what is left of it once the allocator's other holdings are taken, and
    the first plan trains, with no retry, and gives the uncapped run's results."""
    plain, _ = _result(run_python(_CUSTOM_LOOP, TESTS, "plain", env=_capped(1024)))
    counted, log = _result(run_python(_CUSTOM_LOOP, TESTS, "counted", FIRST_BUDGET, HOG_MB,
                                      RETRIES, env=_capped(CAP_MB)))
    assert counted["retries"] == [], log[-3000:]
    held = counted["held"]["CPU:0"]
    # The hog, within 2 MiB: the step's inputs and variables are the graph's own and
    # not counted; what else TF has allocated when Grappler runs moves the figure by
    # up to 1.75 MiB from run to run (6.25 to 7.86 MiB measured for this 8 MiB hog).
    assert (HOG_MB - 2) * 2**20 <= held <= (HOG_MB + 1) * 2**20, held
    assert abs(counted["budget"]["CPU:0"] - (FIRST_BUDGET - held)) <= 1  # int(fraction)
    assert counted["predicted"]["CPU:0"] <= counted["budget"]["CPU:0"]
    assert "held outside this graph when it was planned" in counted["text"]
    assert counted["losses"] == plain["losses"]
    assert counted["weights"] == plain["weights"]
    assert 0 < counted["measured"]["CPU:0"] <= CAP_MB * 2**20


@pytest.mark.parametrize("wrapper", ["function", "guarded"])
def test_no_update_of_a_failed_attempt_survives(wrapper):
    # The counter is incremented before the allocation that fails, in every attempt:
    # in tfmemopt.function, and in a plain tf.function under enable() alone.
    result, log = _result(run_python(_PARTIAL_UPDATE, wrapper, env=_capped(48)))
    assert result["error"] == "ResourceExhaustedError"
    assert result["counter"] == 0.0
    # The first plan fits its 1 GiB budget and is retried; the re-plan cannot bring the
    # 64 MiB tile under the lowered budget, says so, and is not retried again (of 2).
    assert result["retries"] == 1, log[-3000:]
    assert log.count("retrying the call (retry" if wrapper == "guarded" else
                     "retrying the step (retry") == 1
    assert "could not meet its budget (smallest peak reachable" in log
    assert log.count("a lower budget cannot lower it") == 1


_PLANNED_LATER = r'''
import json
import tensorflow as tf
import tfmemopt
from tfmemopt import function_guard
counter = tf.Variable(0.0)
x = tf.ones([1024, 1024])  # 4 MiB

@tf.function
def step(x, big):
    with tf.control_dependencies([counter.assign_add(1.0)]):
        # big: 64 MiB at once, more than the 48 MiB cap whatever the plan.
        return tf.cond(big, lambda: tf.reduce_sum(tf.tanh(tf.tile(x, [16, 1]))),
                       lambda: tf.reduce_sum(tf.tanh(x)))

def big_step():
    try:
        step(x, tf.constant(True))
        return None
    except tf.errors.ResourceExhaustedError as e:
        return type(e).__name__

tfmemopt.enable(budget=1 << 30, function_retries=1, log_level=0)
# With Grappler off, the first call's graph is not planned: nothing to guard yet.
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
step(x, tf.constant(False))
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
tfmemopt.enable(budget=1 << 29, function_retries=1, log_level=0)
errors = [big_step()]  # planned now, during this call
retries = [len(function_guard.retries_done())]
tfmemopt.enable(budget=1 << 28, function_retries=1, log_level=0)
errors.append(big_step())  # re-planned under the new budget, with its own retry
retries.append(len(function_guard.retries_done()))
print("RESULT " + json.dumps({"errors": errors, "counter": float(counter.numpy()),
                              "retries": retries,
                              "planned": [r.status for r in tfmemopt.reports()]}))
'''


def test_each_enable_guards_a_function_again_with_its_own_retries():
    """A function first left alone (Grappler off) is guarded once a later enable()
    plans it, and another enable() gives its next plan the retries again."""
    result, log = _result(run_python(_PLANNED_LATER, env=_capped(48)))
    # Plans under 512 MiB, 4 MiB (the retry's) and 256 MiB; none for the first call's
    # graph. The second retry's 4 MiB is the first's, whose instance TF reuses.
    assert result["planned"] == ["ok"] * 3, log[-3000:]
    assert result["errors"] == ["ResourceExhaustedError"] * 2
    # Each big call retried once (function_retries=1), under each enable().
    assert result["retries"] == [1, 2], log[-3000:]
    assert log.count("retrying the call (retry 1 of 1)") == 2
    assert result["counter"] == 1.0  # the first call's update; none of the failed ones


_KERAS = _KERAS_MODEL + r'''
model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.standard_normal((3 * 1024, 256)).astype(np.float32)
y = rng.standard_normal((3 * 1024, 1)).astype(np.float32)
callbacks = []
FUNCTION_RETRIES = 5  # not the default: the fit's callback must leave it as it was
if mode == "enable":
    # The one line, no callback: fit gets the same loop (enable's fit_retries).
    hog = tf.fill([int(sys.argv[3]) << 18], 1.0)
    tfmemopt.enable(budget=int(sys.argv[2]), enable_split=False, log_level=0,
                    fit_retries=int(sys.argv[4]), function_retries=FUNCTION_RETRIES)
if mode == "as_built":
    # Every plan holds argv[3] bytes it did not predict (test_only_hold_bytes).
    tfmemopt.enable(budget=int(sys.argv[2]), test_only_hold_bytes=int(sys.argv[3]),
                    fit_retries=int(sys.argv[4]), enable_split=False, log_level=0)
if mode == "retry":
    hog = tf.fill([int(sys.argv[3]) << 18], 1.0)  # HOG_MB MiB held for the whole run
    callback = MemoryOptimizer(budget=int(sys.argv[2]), enable_split=False, log_level=0,
                               print_report=False,
                               retries=int(sys.argv[4]), guard_steps=10)
    callbacks = [callback]
history = model.fit(x, y, batch_size=1024, epochs=2, shuffle=False, verbose=0,
                    callbacks=callbacks)
# The metric over the epoch's batches: a failed attempt's update must not count.
out = {"losses": [float(l).hex() for l in history.history["loss"]],
       "mae": [float(l).hex() for l in history.history["mae"]],
       "weights": [w.numpy().tobytes().hex()[:4096] for w in model.weights]}
if mode == "retry":
    out.update(retries=callback.retries_done,
               measured=callback.report.measured_peak_bytes if callback.report else None)
if mode == "as_built":
    out.update(modes=[r.mode for r in tfmemopt.reports()])
if mode == "enable":
    out.update(graphs=[r.graph_id for r in tfmemopt.reports()],
               measured=[r.measured_peak_bytes for r in tfmemopt.reports()],
               retry_keywords_after=tfmemopt._retry_keywords(),
               enabled_after=tfmemopt.enabled_config() is not None)
print("RESULT " + json.dumps(out))
'''


def test_keras_fit_retries_the_batch_and_equals_an_uncapped_fit():
    # Without oneDNN: in TF 2.21 an out-of-memory error inside some oneDNN kernels
    # (mkl_util.h) kills the interpreter with SIGSEGV before Python sees the error, and
    # no retry can help a dead process (docs/troubleshooting.md).
    no_onednn = {"TF_ENABLE_ONEDNN_OPTS": "0"}
    plain, _ = _result(run_python(_KERAS, "plain", env={**_capped(1024), **no_onednn}))
    retried, log = _result(run_python(_KERAS, "retry", FIRST_BUDGET, HOG_MB, RETRIES,
                                      env={**_capped(CAP_MB), **no_onednn}))
    assert retried["retries"], "the first plan did not run out of memory"
    assert log.count("retrying the batch (retry") == len(retried["retries"])
    assert retried["losses"] == plain["losses"]
    assert retried["mae"] == plain["mae"]  # the failed attempts' metric updates are undone
    assert retried["weights"] == plain["weights"]
    assert 0 < retried["measured"]["CPU:0"] <= CAP_MB * 2**20


def test_keras_fit_under_enable_alone_retries_the_batch_and_equals_an_uncapped_fit():
    """tfmemopt.enable() and a plain fit, no callback: the batch that runs out of
    memory is re-planned and retried as with the MemoryOptimizer callback, the losses
    and weights are the uncapped run's, and enable()'s state is as it was after fit."""
    no_onednn = {"TF_ENABLE_ONEDNN_OPTS": "0"}  # see the test above
    plain, _ = _result(run_python(_KERAS, "plain", env={**_capped(1024), **no_onednn}))
    retried, log = _result(run_python(_KERAS, "enable", FIRST_BUDGET, HOG_MB, RETRIES,
                                      env={**_capped(CAP_MB), **no_onednn}))
    assert log.count("retrying the batch (retry") >= 1, log[-3000:]
    assert retried["losses"] == plain["losses"]
    assert retried["mae"] == plain["mae"]
    assert retried["weights"] == plain["weights"]
    assert "were created by the failed attempt" not in log
    assert any("multi_step_on_iterator" in g for g in retried["graphs"]), retried["graphs"]
    assert any(m for m in retried["measured"]), retried["measured"]
    assert retried["enabled_after"]
    assert retried["retry_keywords_after"] == {"fit_retries": RETRIES, "function_retries": 5}


def test_keras_fit_under_enable_trains_as_keras_built_it_when_every_plan_runs_out():
    """fit under enable(), every plan out of memory (test_only_hold_bytes, as above):
    the batch runs as TF built Keras's step, and the fit equals a plain one."""
    no_onednn = {"TF_ENABLE_ONEDNN_OPTS": "0"}  # see test_keras_fit_retries_the_batch...
    env = {**_capped(AS_BUILT_CAP_MB + 4), **no_onednn}  # + the fit's dataset on the CPU
    plain, _ = _result(run_python(_KERAS, "plain", env=env))
    mine, log = _result(run_python(_KERAS, "as_built", AS_BUILT_BUDGET, AS_BUILT_HOLD, 1,
                                   env=env))
    assert log.count("retrying the batch (retry") == 1, log[-3000:]
    assert log.count("running the batch as TF built it") == 1
    assert mine["modes"][-1] == "ANALYZE_ONLY"
    assert mine["losses"] == plain["losses"]
    assert mine["mae"] == plain["mae"]
    assert mine["weights"] == plain["weights"]


def test_keras_fit_under_enable_with_fit_retries_0_runs_as_keras_runs_it():
    """fit_retries=0: the pass plans Keras's own train step (the iterator read in the
    graph) and nothing is retried: the first plan runs out of memory as it would."""
    no_onednn = {"TF_ENABLE_ONEDNN_OPTS": "0"}
    proc = run_python(_KERAS, "enable", FIRST_BUDGET, HOG_MB, 0,
                      env={**_capped(CAP_MB), **no_onednn})
    assert proc.returncode != 0
    assert "ResourceExhaustedError" in proc.stderr or "OOM" in proc.stderr, proc.stderr[-3000:]
    assert "retrying the batch" not in proc.stderr


@pytest.mark.parametrize("name", ["fit_retries", "function_retries"])
def test_enable_rejects_a_bad_retry_count(name):
    before = tfmemopt.enabled_config()
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=rf"enable: {name}=.*allowed: an int >= 0"):
            tfmemopt.enable(**{name: bad})
    assert tfmemopt.enabled_config() is before  # nothing changed


def test_the_failed_allocation_is_read_from_tfs_error():
    error = tf.errors.ResourceExhaustedError(
        None, None, "OOM when allocating tensor with shape[320,16,16,256] and type float on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc")
    assert feedback.missing_bytes(error) == (320 * 16 * 16 * 256 * 4, "GPU:0")
    assert feedback.missing_bytes(ValueError("something else")) == (None, None)


@pytest.mark.parametrize("budget, predicted, missing, in_use, want", [
    (100, 90, 10, None, 80),      # below the prediction, by what was missing
    (100, 90, None, None, 86),    # 5 % of it when TF does not say
    (100, 90, 1, None, 86),       # and never less than 5 %
    (100, 90, 10, 50, 50),        # the allocator held 50 and could not add 10
    (100, 90, 200, None, 1),      # missing more than the budget: the lowest plan
])
def test_the_budget_goes_below_what_was_proven_too_much(budget, predicted, missing, in_use, want):
    assert feedback.lowered_budget(budget, predicted, missing, in_use) == want


def test_a_log_line_never_reads_a_budget_of_0_0_mib():
    assert feedback.mib(3 * 2**20) == "3.0 MiB"
    assert feedback.mib(200 * 2**10) == "0.2 MiB"
    assert feedback.mib(1) == "1 B" and feedback.mib(5000) == "4.88 KiB"
    assert feedback.mib(None) == feedback.mib(0) == "unknown"


_FIRST_SNAPSHOT = r'''
import json
import numpy as np
import keras
import tfmemopt
from tfmemopt import feedback
from tfmemopt.keras import MemoryOptimizer

snapshots = []
Snapshot = feedback.VariableSnapshot


class Recorded(Snapshot):
    def __init__(self, variables):
        super().__init__(variables)
        snapshots.append({id(v) for v, _ in self._pairs})


feedback.VariableSnapshot = Recorded
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(keras.optimizers.Adam(1e-3), "mse")
built_before_fit = model.optimizer.built
x = np.ones((64, 32), np.float32)
model.fit(x, x[:, :1], batch_size=32, epochs=1, verbose=0,
          callbacks=[MemoryOptimizer(budget="1GiB", log_level=0, print_report=False)])
print("RESULT " + json.dumps({
    "built_before_fit": built_before_fit,
    "optimizer_variables": len(model.optimizer.variables),
    "missing_from_first": [v.path for v in model.optimizer.variables
                           if id(v) not in snapshots[0]]}))
'''


def test_the_first_steps_snapshot_holds_the_optimizers_variables():
    """Keras creates Adam's moments and iteration count in the first step, which the
    snapshot guards: the callback creates them before it, so that the updates a failed
    first attempt made to them are put back too (without that, a retried first batch
    of a Conv1D/BatchNorm/Dropout model trained other weights than an uncapped fit)."""
    result, _ = _result(run_python(_FIRST_SNAPSHOT))
    assert not result["built_before_fit"]  # what makes this test meaningful
    assert result["optimizer_variables"] == 2 * 4 + 2  # m, v of 4 weights; iteration, lr
    assert result["missing_from_first"] == []


# A step whose plan meets its budget on paper only: traced with an unknown batch, which
# the model takes as assume_batch_size=512, and run at batch 1024, so that each
# activation is twice what the model counts (min_tensor_bytes lets the plan act on its
# 0.5 MiB). "plain": the same step as a tf.function, without tfmemopt.
_CALIBRATED = r'''
import json, sys
import tensorflow as tf
import tfmemopt
sys.path.insert(0, sys.argv[1])
from conftest import chain_mlp
mode, budget, min_tensor_bytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
step, x, ws = chain_mlp(depth=24)
if mode != "plain":
    tfmemopt.enable(budget=budget, enable_split=False, log_level=0, assume_batch_size=512,
                    min_tensor_bytes=min_tensor_bytes)
    step = tfmemopt.function(step.python_function, guard_steps=10,
                             input_signature=[tf.TensorSpec([None, 256])])
# Call 1 plans (not judged), 2 measures over the budget, 3 re-plans, 4 judges the
# calibration, 5 runs what was decided (after an undo, on a fresh trace).
losses = [float(step(x)).hex() for _ in range(5)]
out = {"losses": losses, "weights": [w.numpy().tobytes().hex()[:4096] for w in ws]}
if mode != "plain":
    report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")][-1]
    out.update(calibrations=step.calibrator.done, budget=report.budget_bytes["CPU:0"],
               predicted=report.predicted_peak_bytes["after"]["CPU:0"])
print("RESULT " + json.dumps(out))
'''
BUDGET_ON_PAPER = 20_000_000  # the plan predicts 19.0 MiB; the step measures about 31


def test_a_step_over_its_budget_on_paper_is_replanned_under_the_measured_error():
    plain, _ = _result(run_python(_CALIBRATED, TESTS, "plain", 0, 0, env=_capped(1024)))
    run, log = _result(run_python(_CALIBRATED, TESTS, "calibrate", BUDGET_ON_PAPER,
                                  1 << 16, env=_capped(1024)))
    [calibration] = run["calibrations"]
    measured = calibration["measured_step_bytes"]
    assert calibration["predicted_peak_bytes"] <= BUDGET_ON_PAPER < measured
    predicted = calibration["predicted_peak_bytes"]
    # Down by the error, or to the budget scaled by predicted / measured if that is more.
    assert calibration["new_budget_bytes"] == max(BUDGET_ON_PAPER - (measured - predicted),
                                                  int(BUDGET_ON_PAPER * predicted / measured))
    assert "re-planning the next calls under" in log
    # The plan that runs now is the calibrated one, and it lowered the measured peak by
    # at least half of what it predicted to save (else it would have been undone).
    assert run["budget"] == calibration["new_budget_bytes"]
    assert not calibration.get("reverted")
    saved_on_paper = calibration["predicted_peak_bytes"] - run["predicted"]
    assert measured - calibration["measured_after_bytes"] >= saved_on_paper / 2 > 0
    assert run["losses"] == plain["losses"]  # recomputing is bitwise
    assert run["weights"] == plain["weights"]


def test_a_calibration_that_saves_nothing_is_undone():
    # With the default min_tensor_bytes (1 MiB) no activation the model sees (0.5 MiB)
    # is a candidate, so the calibrated plan cannot lower anything: the budget of before
    # comes back, on a fresh trace whose report is that budget's.
    budget = 21_000_000  # the plan predicts 20.0 MiB, keeping everything
    run, log = _result(run_python(_CALIBRATED, TESTS, "calibrate", budget, 1 << 20,
                                  env=_capped(1024)))
    [calibration] = run["calibrations"]
    assert calibration["reverted"]
    assert "calibrations stop" in log
    assert run["budget"] == budget
    assert run["predicted"] == calibration["predicted_peak_bytes"]


@pytest.mark.parametrize("budget, predicted, peak, in_use_before, persistent, want", [
    (100, 90, 95, 10, 10, None),   # measured within the budget: nothing to do
    (1000, 900, 1010, 10, 10, None),  # 1 % over: within the tolerance
    (100, 90, 115, 10, 10, 78),    # 15 over: down by the error (25) or to 100 * 90 / 115
    (100, 90, 200, 10, 10, 45),    # a step twice its prediction: 100 * 90 / 200, not -10
    (100, 90, 115, 25, 10, None),  # of which 15 held outside the step: not its own
    (100, 110, 130, 10, 10, None), # the plan did not claim to meet its budget
])
def test_a_calibration_takes_the_budget_down_by_the_steps_own_error(
        budget, predicted, peak, in_use_before, persistent, want):
    class Planned:  # the fields of a tfmemopt.Report the calibration reads
        graph_id = "step"
        budget_bytes = {"CPU:0": budget}
        predicted_peak_bytes = {"after": {"CPU:0": predicted}}
        persistent_bytes = {"CPU:0": persistent}

    replan = feedback.Calibrator(limit=3).after_step(
        "the step", Planned, {"CPU:0": peak}, {"CPU:0": in_use_before})
    assert (replan and replan["budget_bytes"]) == want


_PARTIAL_BATCH = r'''
import json
import numpy as np
import keras
import tfmemopt
from tfmemopt.keras import MemoryOptimizer
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,))] +
                         [keras.layers.Dense(256, activation="relu") for _ in range(8)] +
                         [keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.01), "mse")
x = np.ones((4 * 1024 + 100, 256), np.float32)
callback = MemoryOptimizer(budget="1GiB", log_level=0, print_report=False, guard_steps=1)
model.fit(x, x[:, :1], batch_size=1024, epochs=2, shuffle=False, verbose=0,
          callbacks=[callback])
print("RESULT " + json.dumps([[r.graph_id, r.measured_peak_bytes] for r in callback.reports]))
'''


def test_a_partial_last_batch_runs_the_one_step_keras_traced_and_is_measured():
    """With a partial last batch Keras traces its step once, with an unknown batch
    dimension, and fit runs every batch through it; the callback's guarded steps run
    that same graph (their batches replayed through an iterator of the data's element
    spec), and measure it."""
    graphs, _ = _result(run_python(_PARTIAL_BATCH, env=_capped(1024)))
    assert len(graphs) == 1, graphs
    graph_id, measured = graphs[0]
    assert "multi_step_on_iterator" in graph_id
    assert measured and measured["CPU:0"] > 0, graph_id


def test_a_calibration_is_judged_on_its_own_graph_and_shapes_only():
    class Planned:
        graph_id = "step"
        budget_bytes = {"CPU:0": 100}
        predicted_peak_bytes = {"after": {"CPU:0": 90}}
        persistent_bytes = {"CPU:0": 0}

    class Replanned(Planned):
        predicted_peak_bytes = {"after": {"CPU:0": 70}}

    calibrator = feedback.Calibrator(limit=3)
    run = lambda report, peak, key, planned=False: calibrator.after_step(  # noqa: E731
        "the step", report, {"CPU:0": peak}, {"CPU:0": 0}, key=key, planned=planned)
    assert run(Planned, 200, "a", planned=True) is None  # a call that planned: not judged
    assert run(Planned, 115, "a") == {"budget_bytes": 78, "retrace": False}
    assert run(Replanned, 50, "b") is None      # a batch of another shape: not the judge
    assert run(Replanned, 114, "a") == {"budget_bytes": 100, "retrace": True}  # saved 1 of 20
    assert calibrator.done[0]["reverted"]
    assert run(Planned, 130, "a") is None       # undone once: no more calibrations


_KERAS_REPLAN = r'''
import json, sys
import numpy as np
import keras
import tfmemopt
from tfmemopt import feedback
from tfmemopt.keras import MemoryOptimizer
mode, budget = sys.argv[1], int(sys.argv[2])


class Decided(feedback.Calibrator):
    """Decides, at the first step it may judge, to re-plan under `budget` on a fresh
    trace (what an undone calibration does), and nothing after."""

    def after_step(self, what, report, peaks, in_use_before, key=None, planned=False):
        if planned or self.done:
            return None
        self.done.append({"judged": report.graph_id})
        return {"budget_bytes": budget, "retrace": True}


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,))] +
                         [keras.layers.Dense(256, activation="relu") for _ in range(24)] +
                         [keras.layers.Dense(1)])
model.compile(keras.optimizers.Adam(1e-3), "mse", metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.standard_normal((4 * 1024, 256)).astype(np.float32)
y = rng.standard_normal((4 * 1024, 1)).astype(np.float32)
callbacks = []
if mode == "replan":
    callback = MemoryOptimizer(budget=1 << 30, enable_split=False, log_level=0,
                               print_report=False)
    callback.calibrator = Decided(3)
    callbacks = [callback]
history = model.fit(x, y, batch_size=1024, epochs=2, shuffle=False, verbose=0,
                    callbacks=callbacks)
# The metric over the epoch's batches: a failed attempt's update must not count.
out = {"losses": [float(l).hex() for l in history.history["loss"]],
       "mae": [float(l).hex() for l in history.history["mae"]],
       "weights": [w.numpy().tobytes().hex()[:4096] for w in model.weights]}
if mode == "replan":
    out.update(judged=callback.calibrator.done,
               graphs=[[r.graph_id, r.budget_bytes["CPU:0"],
                        r.predicted_peak_bytes["after"]["CPU:0"]] for r in callback.reports])
print("RESULT " + json.dumps(out))
'''


def test_the_keras_callback_carries_out_a_calibrators_replan_on_a_fresh_trace():
    """What the callback does with a calibrator's decision: the next batches run a new
    train function, traced under the decided budget behind the callback's wrapper; the
    fit goes on and its results are those of a fit without tfmemopt."""
    budget = 20_000_000  # below the step's 35.5 MiB prediction: the new plan lowers it
    plain, _ = _result(run_python(_KERAS_REPLAN, "plain", 0, env=_capped(1024)))
    run, _ = _result(run_python(_KERAS_REPLAN, "replan", budget, env=_capped(1024)))
    [judged] = run["judged"]
    first, *later = run["graphs"]
    assert first[0] == judged["judged"] and first[1] == 1 << 30
    assert later, "no new trace after the decision"
    assert all(g[0] != first[0] and g[1] == budget and g[2] < first[2] for g in later), later
    assert run["losses"] == plain["losses"]
    assert run["mae"] == plain["mae"]
    assert run["weights"] == plain["weights"]


def test_a_calibration_follows_the_device_most_over_its_own_budget():
    class Planned:  # two devices of different budgets, the second listed first
        graph_id = "step"
        budget_bytes = {"GPU:0": 50, "GPU:1": 100}
        predicted_peak_bytes = {"after": {"GPU:0": 45, "GPU:1": 95}}
        persistent_bytes = {"GPU:0": 0, "GPU:1": 0}

    replan = feedback.Calibrator(limit=3).after_step(
        "the step", Planned, {"GPU:1": 105, "GPU:0": 60}, {"GPU:1": 0, "GPU:0": 0})
    # GPU:0 is 10 over its 50, GPU:1 5 over its 100: GPU:0's error sets the budget,
    # max(50 - 15, 50 * 45 / 60) = 37, which is below GPU:1's too.
    assert replan == {"budget_bytes": 37, "retrace": False}


class _Model(tf.Module):
    def __init__(self, scale):
        super().__init__()
        self.w = tf.Variable(tf.ones([16, 16]) * scale)

    @tfmemopt.function(input_signature=[tf.TensorSpec([None, 16])])
    def step(self, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(x @ self.w) ** 2)
        self.w.assign_sub(0.01 * tape.gradient(loss, self.w))
        return loss

    @tf.function(input_signature=[tf.TensorSpec([None, 16])])
    def plain_step(self, x):
        return self.step.python_function(x)


def test_a_method_binds_as_with_tf_function_input_signature_and_all():
    # `self` stays out of input_signature, each instance has its own state, and the
    # method gives what the same method as a tf.function gives.
    tfmemopt.enable("1GiB", log_level=0)
    a, b = _Model(0.1), _Model(0.2)
    assert a.step is a.step and a.step is not b.step
    x8, x4 = tf.ones([8, 16]), tf.ones([4, 16])
    losses = [float(a.step(x8)), float(a.step(x4)), float(b.step(x8))]
    ref_a, ref_b = _Model(0.1), _Model(0.2)
    ref = [float(ref_a.plain_step(x8)), float(ref_a.plain_step(x4)), float(ref_b.plain_step(x8))]
    assert losses == ref
    assert a.step.get_concrete_function().structured_input_signature[0][0].shape.as_list() == [None, 16]
