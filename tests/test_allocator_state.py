"""Starting the allocator model from the pool as it is (observe_allocator).

The allocator model cannot know how the memory before a step was allocated, so by
default it replays four plausible histories and keeps the worst. The pass runs in the
process that runs the step, after the step's function was traced and before its
first run: with observe_allocator it reads the CPU test bed's BFC pool
(grappler/analyze/allocator_state.h) and starts from it, the variables in the chunks
that hold them.
"""

from conftest import BENCHMARKS, capped_allocator_env, run_python, subprocess_result

MIB = 2**20

_CODE = r"""
import json, sys
import tensorflow as tf
import tfmemopt
from tfmemopt._loader import load_extension
observe = sys.argv[1] == "1"
fields = {"observe_allocator": True} if observe else {}
tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0, **fields)
# A 48 MiB variable made eagerly before the step: its chunk is in the pool the pass reads.
v = tf.Variable(tf.zeros([12 << 20]))

@tf.function
def step():
    a = v * 2.0          # 48 MiB
    b = tf.tanh(a) + a   # 48 MiB more while a is live
    return tf.reduce_sum(b)

step.get_concrete_function()
pool = load_extension().cpu_pool_chunks()
step()
measured = 0
if pool:  # TF keeps memory statistics only for BFC
    tf.config.experimental.reset_memory_stats("CPU:0")
    step()
    measured = tf.config.experimental.get_memory_info("CPU:0")["peak"]
report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)
device = [d for d in report.to_dict()["devices"] if d["device"] == "CPU:0"][0]
print("RESULT " + json.dumps({
    "history": device["allocator_history"], "histories": list(device["allocator_history_peaks"]),
    "observed_pool_bytes": device["observed_pool_bytes"], "pool_bytes": sum(c[1] for c in pool),
    "pool_in_use": sum(c[1] for c in pool if c[2]), "chunks": len(pool),
    "predicted": report.predicted_peak_bytes["after"]["CPU:0"], "measured": measured}))
"""


def run(observe, env):
    return subprocess_result(run_python(_CODE, "1" if observe else "0", env=env))


def test_the_model_starts_from_the_pool_the_pass_read_with_the_variable_in_its_chunk():
    r = run(True, capped_allocator_env(512, TF_CPP_MIN_LOG_LEVEL="2"))
    assert r["history"] == "observed" and r["histories"] == ["observed"]
    # The pool the pass read is the one the step found: read after tracing, before the run.
    assert r["observed_pool_bytes"] == r["pool_bytes"] > 0
    assert r["pool_in_use"] >= 48 * MIB
    # The variable is placed in its chunk, not allocated again (that would add 48 MiB):
    # the prediction is within 5 % of the allocator's measured peak.
    assert abs(r["predicted"] - r["measured"]) <= 0.05 * r["measured"], r


def test_by_default_the_model_replays_four_histories_and_reads_no_pool():
    r = run(False, capped_allocator_env(512, TF_CPP_MIN_LOG_LEVEL="2"))
    assert len(r["histories"]) == 4 and r["history"] in r["histories"]
    assert r["observed_pool_bytes"] == 0


def test_without_bfc_there_is_no_pool_to_read_and_the_histories_stay():
    r = run(True, {"TF_CPU_ALLOCATOR_USE_BFC": "false", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert r["chunks"] == 0 and r["observed_pool_bytes"] == 0
    assert "observed" not in r["histories"]


_TEXT_CNN = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import tfmemopt
from models import MODELS
tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0, observe_allocator=True,
                model_inter_op_threads=int(sys.argv[2]))
tf.keras.utils.set_random_seed(0)
step, args = MODELS["text_cnn"]()
for _ in range(2):
    step(*args)
peaks = []
for _ in range(3):
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(*args)
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)
print("RESULT " + json.dumps({"predicted": report.predicted_peak_bytes["after"]["CPU:0"],
                              "measured": max(peaks)}))
"""


def test_kernels_started_together_hold_their_memory_together():
    # text_cnn's second convolution: its filter gradient (14.5 MiB of im2col scratch on
    # TF's own kernels, forced here so that the test does not depend on the CPU) and its
    # data gradient (a 15.75 MiB output) are made ready by one kernel and start
    # together on TF's default threads. One kernel at a time, the model misses that
    # overlap; with the machine's threads it counts it, and comes closer to TF's peak
    # without passing it.
    env = capped_allocator_env(16384, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    one = subprocess_result(run_python(_TEXT_CNN, BENCHMARKS, 1, env=env))
    # TF's peak moves between processes (docs/allocator.md): 117.0, 117.5, 128.1 and
    # 128.7 MiB in four processes on an idle Xeon (120.7 predicted), 141.8 MiB in both of
    # a CI run's beside another test process. The lower of two.
    machine = [subprocess_result(run_python(_TEXT_CNN, BENCHMARKS, 0, env=env)) for _ in range(2)]
    measured = min(r["measured"] for r in machine)
    predicted = machine[0]["predicted"]
    assert predicted >= one["predicted"] + 10 * MIB
    assert one["predicted"] < 0.92 * measured
    assert abs(predicted - measured) < abs(one["predicted"] - measured), (predicted, measured)
    assert predicted <= 1.05 * measured, (predicted, measured)
