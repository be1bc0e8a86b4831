"""TF1-style training graphs in a v1 Session (benchmarks/v1_graphs.py at a small size):
reference and resource variables, tf.gradients called twice, a gradient subgraph no
fetch needs. The pass predicts their peak within 15 %, lowers it under a budget of
0.55x the unplanned peak, and leaves the losses bitwise equal."""

import json
import sys

import pytest

from conftest import BENCHMARKS, capped_allocator_env, run_python

sys.path.insert(0, BENCHMARKS)
import v1_graphs  # noqa: E402

SMALL = {"blocks": 3, "batch": 32}
# At this size one 2 MiB activation more or less at the peak, which TF's parallel
# executor changes from run to run, is 7 % of it; benchmarks/v1_graphs.py measures the
# full-size graphs (122 layers, batch 128) against the 10 % target.
TOLERANCE = 0.15
# Half the measured peak is right at the smallest peak the planner reaches at this
# size (49.7 % of the predicted one), and the measured peak varies between machines
# by a few percent: 0.55 keeps the budget reachable everywhere.
BUDGET_FRACTION = 0.55


@pytest.fixture(scope="module", params=v1_graphs.GRAPHS)
def measured(request):
    return request.param, v1_graphs.measure(request.param, SMALL, BUDGET_FRACTION)


def test_unplanned_prediction_within_tolerance(measured):
    name, r = measured
    assert abs(r["error"]) <= TOLERANCE, r


def test_half_the_peak_budget_lowers_the_measured_peak(measured):
    name, r = measured
    assert r["planned_predicted"] <= r["budget"], r
    # Planned graphs are under-predicted more than unplanned ones (up to 17 % at this
    # size, benchmarks/v1_graphs.py reports it), so the test asks for a clear drop,
    # not for the budget itself.
    assert r["planned_measured"] <= 0.7 * r["measured"], r
    assert r["recomputed"] + r["swapped"] > 0


def test_losses_bitwise_equal(measured):
    name, r = measured
    assert r["losses_equal"], (r["losses"], r["losses_without"])


def test_reference_variable_reads_are_never_recomputed():
    # A clone of a conv reading `kernel/read` (which shares the VariableV2's buffer)
    # could run after the optimizer updated the kernel in place.
    proc = run_python(_LEFT_ALONE, BENCHMARKS, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    left_alone = json.loads(proc.stdout.splitlines()[-1])
    assert left_alone.get("reads_reference_variable", 0) >= 20  # every conv and the head


_LEFT_ALONE = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import tfmemopt
from v1_graphs import build
graph, feeds, loss, train, init_op = build("ref_double_gradients", blocks=3, batch=32)
meta = tf.compat.v1.train.export_meta_graph(graph=graph)
meta.collection_def["train_op"].node_list.value.append(train.name)
report = tfmemopt.analyze_metagraph(meta, budget=1, enable_swap=False, log_level=0)
print(json.dumps(report.recompute["left_alone"]))
'''

_NEVER_RUN = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import tfmemopt
from v1_graphs import build
graph, feeds, loss, train, init_op = build("resource_unused_head", blocks=3, batch=32)
meta = tf.compat.v1.train.export_meta_graph(graph=graph)
meta.collection_def["train_op"].node_list.value.append(train.name)
report = tfmemopt.analyze_metagraph(meta, mode="ANALYZE_ONLY", log_level=0)
print(json.dumps({"never_run": report.never_run_nodes, "nodes": report.num_nodes,
                  "peak": report.predicted_peak_bytes["before"]}))
'''


def test_nodes_no_fetch_needs_are_not_planned():
    # tfmemopt.analyze_metagraph sees the whole graph: the initializers and the unused
    # gradient subgraph are in it, and the executor never runs them for the train
    # op. They are left out of the plan and returned as they are; the prediction is
    # that of the step TF runs (measured in a Session, ANALYZE_ONLY). The analysis runs
    # under the allocator the Session trial measures with (TF's BFC CPU allocator,
    # whose chunks the model counts only where the process uses it: without it, the
    # same graph is predicted at its live bytes, 9 % below what BFC measures).
    env = capped_allocator_env(8192, TF_CPP_MIN_LOG_LEVEL="2")
    proc = run_python(_NEVER_RUN, BENCHMARKS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["never_run"] > 50
    (peak,) = out["peak"].values()
    session = v1_graphs.trial("resource_unused_head", {"mode": "ANALYZE_ONLY"}, SMALL)
    assert peak == pytest.approx(session["measured"], rel=TOLERANCE)


SESSION_NEAR_THE_CAP = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import tfmemopt
import models
tfmemopt.enable(log_level=0)
step, _ = models.v1_session_cnn(154)
losses = [float(step()) for _ in range(2)]
report = max(tfmemopt.reports(), key=lambda r: r.num_nodes)
device = report.to_dict()["devices"][0]
print("RESULT " + json.dumps({
    "losses": losses, "history": device["allocator_history"],
    "refused_before": device["allocator_refused_before_bytes"],
    "changed": report.graph_changed, "fits": report.fits,
    "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}))
'''


def test_a_session_near_its_cap_is_modelled_from_the_pool_its_initializer_left():
    """benchmarks/models.py's v1 Session CNN at batch 154 under a 128 MiB cap: its
    live tensors peak at 97.4 MiB, but BFC's regions, grown by the initializer's
    temporaries, leave its 19.25 MiB activations in 25 to 32 MiB chunks, and the step
    as TF builds it peaks at 127.7 MiB in some processes and runs out of memory in
    others. A replay of graph order predicted 110.9 MiB and left the graph as it was
    ("fits"); from the pool as the initializer left it the model finds the refusal
    and plans the step, which then trains under the cap."""
    from conftest import subprocess_result

    proc = run_python(SESSION_NEAR_THE_CAP, BENCHMARKS, env=capped_allocator_env(128))
    result = subprocess_result(proc)
    assert result["history"] == "observed"
    assert result["refused_before"] > 0  # the graph as TF builds it: BFC refuses
    assert result["changed"] and result["fits"]
    assert result["peak"] <= 128 << 20
