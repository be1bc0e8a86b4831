"""The Checkmate MILP of benchmarks/optimality.py: its formulation on a hand-made
table whose optimum is known by hand, and our recompute planner measured against it
on tiny train steps (the optimum is a lower bound on the same memory model)."""

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)

import checkmate_milp as cm  # noqa: E402

MIB = 1 << 20


def chain_table():
    """P -> A -> B -> L forward, G1(B, L) -> G2(G1, A) -> G3(G2, P) backward.

    Unplanned, G1 runs with P, A, B, L and its output live: 13 MiB + 4 B. Dropping A
    after B and recomputing it (cost 1) for G2 leaves G2's working set (P, L, G1, A,
    G2: 10 MiB + 4 B) as the peak; nothing goes lower.
    """
    nodes, tensors, buffers = [], [], []

    def node(name, inputs, size, backward=False, cost=0.1, recomputable=""):
        n = len(nodes)
        t = len(tensors)
        tensors.append({"node": n, "port": 0, "bytes": size, "buffer": len(buffers),
                        "role": "gradient" if backward else "activation"})
        buffers.append({"owner": t, "bytes": size, "host_bytes": 0, "persistent": False,
                        "device": "CPU:0"})
        nodes.append({"name": name, "op": name, "device": "CPU:0", "backward": backward,
                      "stateful": False, "compute_seconds": cost, "temp_bytes": 0,
                      "inputs": inputs, "outputs": [t], "control_inputs": [],
                      "recomputable": "backward" if backward else recomputable})
        return t

    p = node("P", [], MIB, recomputable="input_or_structural")
    a = node("A", [p], 4 * MIB, cost=1.0)
    b = node("B", [a], 4 * MIB, cost=10.0)
    loss = node("L", [b], 4, cost=0.5)
    g1 = node("G1", [b, loss], 4 * MIB, backward=True)
    g2 = node("G2", [g1, a], MIB, backward=True)
    node("G3", [g2, p], MIB, backward=True)
    return {"nodes": nodes, "tensors": tensors, "buffers": buffers,
            "order": list(range(len(nodes))), "fetch": [loss], "devices": ["CPU:0"]}


def test_replay_of_the_unplanned_order_follows_the_simulator_rules():
    model = cm.build_model(chain_table())
    assert model.allocating_nodes == 7
    assert cm.replay(model, cm.base_steps(model)) == 13 * MIB + 4


def test_milp_recomputes_the_cheap_producer_in_the_stage_that_needs_it():
    model = cm.build_model(chain_table())
    solution = cm.solve(model, 11 * MIB, time_limit=30)
    assert solution.status == "optimal"
    assert solution.added_seconds == pytest.approx(1.0)
    recomputed = [(model.name(t), [model.name(i) for i in run if i != t])
                  for t, run in solution.schedule if len(run) > 1]
    assert recomputed == [("G2", ["A"])]
    assert cm.replay(model, cm.milp_steps(model, solution.schedule)) == 10 * MIB + 4


def test_milp_costs_nothing_when_the_unplanned_order_fits():
    model = cm.build_model(chain_table())
    solution = cm.solve(model, 14 * MIB, time_limit=30)
    assert solution.status == "optimal"
    assert solution.added_seconds == 0


def test_milp_proves_a_budget_below_the_working_set_infeasible():
    model = cm.build_model(chain_table())
    assert cm.solve(model, 10 * MIB - 1, time_limit=30).status == "infeasible"
    lowest = cm.solve(model, minimize_peak=True, time_limit=30)
    assert lowest.status == "optimal"
    assert lowest.peak_bytes == 10 * MIB + 4


def test_a_fixed_schedule_outside_the_decision_space_is_refused():
    model = cm.build_model(chain_table())
    # P is a graph input: never recomputed.
    with pytest.raises(ValueError, match="outside the decision space"):
        cm.solve(model, 11 * MIB, fixed_recompute={(4, 0)})
    # Recomputing A for G1 does not lower G1's step: infeasible at 11 MiB.
    assert cm.solve(model, 11 * MIB, fixed_recompute={(4, 1)}).status == "infeasible"
    assert cm.solve(model, 11 * MIB, fixed_recompute={(5, 1)}).status == "optimal"


def reuse_and_update_table():
    """x (caller's input, 1 MiB) -> A (2 MiB) -> B (2 MiB); W is a variable (1 MiB)
    read by M(A, W) (4 MiB) and updated by U(W, M) before G(B, W) reads it.

    Order: x, W, R=ReadVariableOp(W), A, M(A, R), B(A), U(W, M), G(B, R). B is A's last
    reader and reusable: it takes A's buffer over. U updates W while G's read of R is
    still pending: W is copied (1 MiB) until G has run."""
    nodes, tensors, buffers = [], [], []

    def node(name, inputs, size, backward=False, persistent=False, external=False,
             dtype="float", reusable=(), updated=(), buffer=None):
        n = len(nodes)
        t = len(tensors)
        if buffer is None:
            buffer = len(buffers)
            buffers.append({"owner": t, "bytes": size, "host_bytes": 0,
                            "persistent": persistent, "device": "CPU:0", "external": external,
                            "released_by": -1, "pieces": 1})
        tensors.append({"node": n, "port": 0, "bytes": size, "buffer": buffer,
                        "role": "gradient" if backward else "activation", "dtype": dtype})
        nodes.append({"name": name, "op": name, "device": "CPU:0", "backward": backward,
                      "stateful": False, "compute_seconds": 0.1, "temp_bytes": 0,
                      "inputs": inputs, "outputs": [t], "control_inputs": [],
                      "recomputable": "backward" if backward else "",
                      "reusable_inputs": list(reusable), "updated_variables": list(updated),
                      "extra_buffers": []})
        return t

    x = node("x", [], MIB, external=True)
    w = node("W", [], MIB, persistent=True, dtype="resource")
    read = node("R", [w], MIB, buffer=tensors[w]["buffer"])
    a = node("A", [x], 2 * MIB, reusable=[0])
    m = node("M", [a, read], 4 * MIB)
    b = node("B", [a], 2 * MIB, reusable=[0])
    node("U", [w, m], 0, backward=True, updated=[0])
    node("G", [b, read], 2 * MIB, backward=True)
    return {"nodes": nodes, "tensors": tensors, "buffers": buffers,
            "order": list(range(len(nodes))), "fetch": [], "devices": ["CPU:0"]}


def test_replay_counts_in_place_reuse_caller_inputs_and_copy_on_write():
    table = reuse_and_update_table()
    # W and x (1 MiB each) are resident. B takes A's buffer over (B's step: W, x, M,
    # B = 8 MiB); at U, W's copy joins W, x, B and M: 9 MiB.
    assert cm.simulate(table, table["order"]) == 9 * MIB
    # Without the reuse, A and B are both live at B's step: 10 MiB.
    no_reuse = reuse_and_update_table()
    for node in no_reuse["nodes"]:
        node["reusable_inputs"] = []
    assert cm.simulate(no_reuse, no_reuse["order"]) == 10 * MIB
    # Without G's pending read of W, U copies nothing: 8 MiB.
    no_copy = reuse_and_update_table()
    no_copy["nodes"][7]["inputs"] = [no_copy["nodes"][5]["outputs"][0]]
    assert cm.simulate(no_copy, no_copy["order"]) == 8 * MIB


def workspace_table():
    """x (caller's, 1 MiB) -> P (1 MiB, plus a 1 MiB workspace that G releases, like
    oneDNN's MaxPool) -> Q (2 MiB); G(P, Q) (1 MiB) is backward."""
    nodes, tensors, buffers = [], [], []

    def node(name, inputs, size, backward=False, external=False):
        n, t = len(nodes), len(tensors)
        buffers.append({"owner": t, "bytes": size, "host_bytes": 0, "persistent": False,
                        "device": "CPU:0", "external": external, "released_by": -1,
                        "pieces": 1})
        tensors.append({"node": n, "port": 0, "bytes": size, "buffer": len(buffers) - 1,
                        "role": "activation", "dtype": "float"})
        nodes.append({"name": name, "op": name, "device": "CPU:0", "backward": backward,
                      "stateful": False, "compute_seconds": 0.1, "temp_bytes": 0,
                      "inputs": inputs, "outputs": [t], "control_inputs": [],
                      "recomputable": "backward" if backward else "",
                      "reusable_inputs": [], "updated_variables": [], "extra_buffers": []})
        return t

    x = node("x", [], MIB, external=True)
    p = node("P", [x], MIB)
    q = node("Q", [p], 2 * MIB)
    node("G", [p, q], MIB, backward=True)
    buffers.append({"owner": p, "bytes": MIB, "host_bytes": 0, "persistent": False,
                    "device": "CPU:0", "external": False, "released_by": 3, "pieces": 1})
    nodes[1]["extra_buffers"].append(len(buffers) - 1)
    return {"nodes": nodes, "tensors": tensors, "buffers": buffers,
            "order": [0, 1, 2, 3], "fetch": [], "devices": ["CPU:0"]}


def test_a_kernel_workspace_lives_until_its_releasing_node_has_run():
    table = workspace_table()
    # At G: x, P, its workspace, Q and G: 6 MiB.
    assert cm.simulate(table, table["order"]) == 6 * MIB
    model = cm.build_model(table)
    workspace = model.value_buffer.index(4)
    assert model.name(model.value_owner[workspace]) == "P"
    assert [model.name(s) for s in model.value_readers[workspace]] == ["G"]


def test_milp_counts_what_the_replay_counts():
    for table in (reuse_and_update_table(), chain_table(), workspace_table()):
        model = cm.build_model(table)
        lowest = cm.solve(model, minimize_peak=True, time_limit=30)
        assert lowest.status == "optimal"
        # The MILP's own peak (its objective) is the replay's peak of its schedule.
        assert lowest.objective_bytes == lowest.peak_bytes
    model = cm.build_model(reuse_and_update_table())
    # Caller-held x is resident, as variables are.
    assert model.persistent_bytes == 2 * MIB
    assert [model.name(c.stage) for c in model.copies] == ["U"]


@pytest.fixture(scope="module")
def optimality():
    import optimality as module
    return module


def evaluate_graph(optimality, name, fraction):
    """(graph figures, cases, checks) of benchmark graph `name` at one budget fraction."""
    return optimality.evaluate(name, optimality.load(name), [fraction], time_limit=30,
                               log=lambda *_: None)


@pytest.fixture(scope="module")
def mlp3_relu(optimality):
    return evaluate_graph(optimality, "mlp3_relu", 0.5)


def test_replays_agree_with_the_planner_and_the_verify_stage(optimality, mlp3_relu):
    graph, cases, checks = mlp3_relu
    # The unplanned order replays to peak_before_bytes, our output graph (in the
    # executor order the simulator emulates) to the planner's and the verify stage's peaks, our clones
    # cost what the report says, and the MILP's schedule fits its budget.
    assert checks == []
    assert graph["nodes"] <= optimality.MAX_NODES
    assert graph["floor_status"] == "optimal"
    assert graph["floor"] <= graph["once_floor"] <= graph["ours_floor"]
    (case,) = cases
    assert case["floor"] < case["budget"] < case["before"]
    assert case["ours_replay"] == case["ours_peak"] == case["ours_verify_peak"]
    assert case["milp_status"] == "optimal"
    assert case["milp_replay"] <= case["budget"]


def test_our_plan_matches_the_optimum_on_a_three_layer_mlp(mlp3_relu):
    _, (case,), _ = mlp3_relu
    # Both recompute the first layer (MatMul + ReLU) once, for the backward pass.
    assert case["ours_fits"], case
    assert case["milp_recomputed"] == [["matmul", "Relu"]]
    assert sorted(case["ours_recomputed"]) == ["Relu", "matmul"]
    assert case["ratio"] == pytest.approx(1.0)


def test_clones_run_where_the_plan_puts_them_so_dag7_costs_the_optimum(optimality):
    # dag7's cheapest plan recomputes `add` for gradient_tape/mul/Mul. Left to itself
    # the executor runs the clone as soon as its trigger allows, past other big steps,
    # and the plan no longer lowers the peak (the planner then paid 16.9x the MILP's
    # added compute for a plan that fits). Now the simulator runs a clone right after
    # the control edge that triggers it (as TF's executor does), and where the emulated
    # order still differs from the plan's, control edges pin it (report.plan_choice.
    # order_edges): the MILP's plan, at the MILP's cost.
    graph, (case,), checks = evaluate_graph(optimality, "dag7", 0.5)
    assert checks == []
    assert case["milp_status"] == "optimal" and case["ours_fits"], case
    assert case["ours_replay"] == case["ours_peak"] == case["ours_verify_peak"]
    assert case["ours_peak"] <= case["budget"]
    assert case["ratio"] == pytest.approx(1.0, abs=0.01), case


def test_a_clone_serves_only_the_readers_after_the_peak_so_dag8_costs_the_optimum(optimality):
    # dag8's peak falls between the two backward readers of the first ReLU: the
    # weight gradient of the next MatMul reads it before the peak, ReluGrad after.
    # A clone serving both is made before the first and is live across the peak, so
    # no recomputation lowered it (ours missed every budget). The MILP recomputes
    # MatMul + ReLU for ReluGrad only; so does the pinned plan whose clones serve the
    # backward readers from the peak on (Choice::clone_readers_from).
    graph, (case,), checks = evaluate_graph(optimality, "dag8", 0.8)
    assert checks == []
    assert case["milp_status"] == "optimal" and case["ours_fits"], case
    assert sorted(case["ours_recomputed"]) == ["Relu", "matmul"]
    assert case["ours_replay"] == case["ours_peak"] == case["ours_verify_peak"]
    assert case["ours_peak"] == case["milp_replay"] <= case["budget"]
    assert case["ratio"] == pytest.approx(1.0, abs=0.01), case


def test_quick_run_prints_the_summary_as_its_last_line():
    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "optimality.py"), "--json",
         "--only", "mlp3_wide_narrow", "--time-limit", "30"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["cases"] == 3 and summary["graphs"] == 1
    assert summary["proven_optimal"] == 3
    assert summary["check_failures"] == 0
    assert summary["max_nodes"] <= 40
    # Ratios only over proven optima where our plan fits; misses are listed apart.
    assert summary["ratios_counted"] + summary["missed_budget"] == summary["proven_optimal"]
    assert "proven optimality" in out
