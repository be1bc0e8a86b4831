"""The Checkmate MILP (Jain et al., MLSys 2020) on the pass's own tensor table.

Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization, section 4:
stage t computes node t (the frontier) and may first recompute earlier nodes; binary
R[t,i] (node i computed in stage t), S[t,v] (value v kept in memory from stage t-1
into stage t), FREE[t,v,k] (v freed right after node k ran in stage t), and memory
U[t,k] after node k of stage t, with the linearized free constraints
    1 - FREE <= h <= kappa * (1 - FREE),
    h = (1 - R[t,k]) + S[t+1,v] + sum of R[t,j] over the readers j > k of v,
which make FREE[t,v,k] exactly R[t,k] * (1 - S[t+1,v]) * prod (1 - R[t,j]).
The objective is the compute of every R[t,i] = 1 beyond the one run of each node.

The model is built from `table_json` (tfmemopt._ext.run_pass(..., export_table=True)),
the table the planner analyzed, so that both see the same graph, and it counts memory
by the simulator's rules (grappler/simulate/liveness_simulator.cc):

* The stages follow the table's `order`, which is the order the simulator replays the
  unplanned graph in (ExecutorOrder: TF's executor's scheduling, emulated).
* Values are the table's buffers that are neither persistent nor caller-held
  (`external`: the function's inputs, live through the whole step) with bytes > 0,
  plus kernels' extra buffers (`extra_buffers`, oneDNN's MaxPool workspace), which
  are owned by their kernel and read by the node that releases them (`released_by`).
  A forwarding op such as Identity or Reshape shares its input's buffer, so it is
  contracted onto that buffer: whoever reads the forwarded tensor reads the buffer.
  S, FREE and the memory terms are per value; R is per node (recomputing a node
  regenerates all the values it owns).
* Stages are the nodes of the order that own a value, read one, or have temp bytes;
  the other nodes (constants, variable handles, ReadVariableOps that forward the
  variable, NoOps) allocate and free nothing the simulator counts, so their steps
  cannot hold the peak. "Nodes" (the size of a graph, at most 40 in the benchmark)
  counts only the stages that own a value: reader-only stages (variable updates,
  forwarding ops) add no decision.
* Costs are the table's compute_seconds; bytes and temp bytes are the table's.
  Persistent and caller-held bytes are a constant taken off the budget; a node's temp
  bytes count while it runs: U[t,k] + temp_k * R[t,k] <= budget - resident.
* Fetched values are kept from their production to the end (S = 1, never FREE).
* In-place reuse (the simulator's TakeOver): output 0 of node k takes over the buffer
  of a reusable input (`reusable_inputs`, same bytes, read once by k) when k is that
  buffer's last reader. In Checkmate's terms that is exactly FREE[t,v,k] = 1, so a
  variable 0 <= REUSE[t,k] <= sum of those FREEs takes the output's bytes off U[t,k]
  (the bytes after the step are the same either way). This is exact: the reuse
  depends on the schedule only through FREE, which the MILP already decides.
* Copy-on-write (`updated_variables`): an update of a variable while reads of its
  value made before the update are still pending copies the variable, and the copy
  lives until the last such read. The original readers are fixed in the order; a
  recomputation (in a later stage) of a node that reads the value is one more
  pending read, so COPY[t,k] >= R of every later such recomputation, and COPY[t,k]
  = 1 while an original read is still to come; its bytes count in U[t,k].
* The decision space: only forward nodes whose `recomputable` is "" (and which own a
  value) may run in a stage other than their own. With backward_only (what the
  benchmark compares with), only in the stage of a backward node: our recompute pass
  clones a node only for backward readers, so that is the planner's space. Without it,
  in any later stage (Checkmate's own space, which can also drop a forward activation
  between two forward readers). Unlike our planner, Checkmate may recompute a node in
  several stages (that is its bar).

Differences from our simulator that remain (each only makes the MILP count more than
the replay of its own schedule, never less, so its schedules fit when its rows do;
the benchmark checks every one by replay):
* Checkmate's memory is counted per stage: a value kept into a stage but read by
  nobody in it is only dropped at the stage's end (the optimum never keeps such a
  value, so this only removes useless solutions), and a value both kept and
  recomputed in one stage counts twice (as in the simulator, where the original and
  the clone are both live). A recomputed owner of an extra buffer that no releasing
  node reads allocates its workspace in the MILP (the simulator binds the workspace
  to the instance that MaxPoolGrad reads), again only in useless solutions.
  Copy-on-write is counted per step of the stage sequence (a recomputation in the
  stage of the update runs before the update and holds no copy).
* A clone of a forwarding op (our planner clones Reshape/Identity views of a
  recomputed buffer for their backward readers) is free in the MILP: the view is
  contracted onto its buffer. The estimator charges 1e-9 s for such ops, so our
  plans can cost a few nanoseconds more for this reason alone.
* Memory enters the MILP in MiB (bytes / 2**20, exact in floating point) and HiGHS
  accepts rows within its feasibility tolerance (1e-7 of a MiB, a fraction of a byte,
  for exact 0/1 values): the replay of the rounded schedule is what is checked.
* The order. Checkmate (like the paper) fixes it: the MILP's schedule runs the
  table's order with each stage's recomputations right before its node, and that is
  the order its replay uses (milp_steps). Our planner and verify stage run a plan in
  the executor order that the simulator emulates on the output graph, in which a
  clone runs where the executor would run it; in Checkmate's terms it is a recompute
  in the stage of the next original node. When a clone also moves original nodes
  (the executor runs what is ready, and the clone delays its backward reader), the
  plan is not exactly a Checkmate schedule on the MILP's stages (the benchmark counts
  these cases). Checkmate may recompute anywhere, several times, and orders each
  stage's recomputations freely.

Every solution is checked by replay() (simulate(): a plain-Python re-implementation
of the simulator's rules, run on the schedule rewritten as a table, not on the
MILP's U), and our planner's output graph, analyzed afresh as the verify stage does,
is replayed by the same function in its executor order (our_schedule()).
"""

import dataclasses
import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

MIB = float(1 << 20)
NS = 1e9  # costs enter the objective in nanoseconds (HiGHS's absolute gap is 1e-6)


@dataclasses.dataclass
class Model:
    """A graph as the MILP sees it (indices are stages 0..n-1 unless named)."""
    table: dict
    stage_nodes: list        # table node index per stage
    cost: list               # compute_seconds per stage
    temp: list               # temp bytes per stage
    recomputable: list       # may run in a stage other than its own
    owned: list              # value ids per stage
    reads: list              # value ids per stage (sorted, no duplicates)
    value_buffer: list       # table buffer per value
    value_bytes: list
    value_owner: list        # stage per value
    value_readers: list      # stages per value (sorted)
    fetched: list            # bool per value
    persistent_bytes: int    # persistent and caller-held (external) bytes: a constant
    stage_of_node: dict      # table node index -> stage
    reuse: list              # per stage: values whose buffer its output 0 may take over
    reuse_bytes: list        # per stage: the bytes that taking one over saves
    copies: list             # Copy per (variable update, variable) with pending reads

    @property
    def n(self):
        return len(self.stage_nodes)

    @property
    def allocating_nodes(self):
        """The size of the graph: stages that own a value."""
        return sum(1 for o in self.owned if o)

    def name(self, stage):
        return self.table["nodes"][self.stage_nodes[stage]]["name"]


@dataclasses.dataclass
class Copy:
    """Copy-on-write: the update at stage `stage` copies a variable of `bytes` while
    reads of its value are pending. The copy lives until the last of them: the
    original readers (up to table-order position `last_read`, -1 if none) and the
    recomputations, in a later stage, of the stages in `clone_readers`."""
    stage: int
    bytes: int
    last_read: int
    clone_readers: set


def build_model(table):
    """The MILP's view of a run_pass table (see the module docstring)."""
    nodes, tensors, buffers = table["nodes"], table["tensors"], table["buffers"]
    is_value = [not b["persistent"] and not b.get("external", False) and b["bytes"] > 0
                for b in buffers]
    fetched_buffers = {tensors[t]["buffer"] for t in table["fetch"]}
    extra_of = {}  # releasing node -> extra buffers it reads (their release)
    for n, node in enumerate(nodes):
        for b in node.get("extra_buffers", []):
            if buffers[b].get("released_by", -1) >= 0:
                extra_of.setdefault(buffers[b]["released_by"], []).append(b)

    def owned_buffers(n):
        out = []
        for t in nodes[n]["outputs"]:
            b = tensors[t]["buffer"]
            if is_value[b] and buffers[b]["owner"] == t:
                out.append(b)
        return out + [b for b in nodes[n].get("extra_buffers", []) if is_value[b]]

    def read_buffers(n):
        return sorted({tensors[t]["buffer"] for t in nodes[n]["inputs"]
                       if is_value[tensors[t]["buffer"]]} |
                      {b for b in extra_of.get(n, []) if is_value[b]})

    stage_nodes = [n for n in table["order"]
                   if owned_buffers(n) or read_buffers(n) or nodes[n]["temp_bytes"] > 0]
    stage_of_node = {n: s for s, n in enumerate(stage_nodes)}
    value_of_buffer = {}
    value_buffer, value_owner = [], []
    owned = []
    for s, n in enumerate(stage_nodes):
        mine = []
        for b in owned_buffers(n):
            value_of_buffer[b] = len(value_buffer)
            mine.append(len(value_buffer))
            value_buffer.append(b)
            value_owner.append(s)
        owned.append(mine)
    reads = []
    readers = [[] for _ in value_buffer]
    for s, n in enumerate(stage_nodes):
        mine = []
        for b in read_buffers(n):
            v = value_of_buffer.get(b)
            if v is None or value_owner[v] >= s:
                raise ValueError(f"checkmate: {nodes[n]['name']} reads buffer {b}, "
                                 f"which no earlier node owns (a loop?)")
            mine.append(v)
            readers[v].append(s)
        reads.append(mine)
    # In-place reuse (TakeOver): output 0 takes over the buffer of a reusable input
    # of its size that this node reads once, if that read is the buffer's last.
    reuse, reuse_bytes = [], []
    for s, n in enumerate(stage_nodes):
        node, mine, out_bytes = nodes[n], [], 0
        if node["outputs"]:
            out = node["outputs"][0]
            own = tensors[out]["buffer"]
            if is_value[own] and buffers[own]["owner"] == out:
                out_bytes = int(buffers[own]["bytes"])
                edges = [tensors[t]["buffer"] for t in node["inputs"]]
                for port in node.get("reusable_inputs", []):
                    b = edges[port]
                    if (is_value[b] and edges.count(b) == 1 and buffers[b]["bytes"] == out_bytes
                            and value_of_buffer[b] not in mine):
                        mine.append(value_of_buffer[b])
        reuse.append(mine)
        reuse_bytes.append(out_bytes)
    # Copy-on-write of variable updates: the reads of a variable's value (tensors on
    # its persistent buffer) made before the update and read after it.
    position = {n: i for i, n in enumerate(table["order"])}
    copies = []
    for u, node in enumerate(nodes):
        for port in node.get("updated_variables", []):
            b = tensors[node["inputs"][port]]["buffer"]
            if not buffers[b]["persistent"]:
                continue
            if u not in stage_of_node:
                raise ValueError(f"checkmate: the update {node['name']} is no stage")
            last_read, clone_readers = -1, set()
            for c, reader in enumerate(nodes):
                for t in reader["inputs"]:
                    if (tensors[t]["buffer"] != b or tensors[t].get("dtype") == "resource"
                            or position[tensors[t]["node"]] > position[u]):
                        continue
                    if position[c] > position[u]:
                        last_read = max(last_read, position[c])
                    if c in stage_of_node:
                        clone_readers.add(stage_of_node[c])
            if last_read >= 0 or clone_readers:
                copies.append(Copy(stage_of_node[u], int(buffers[b]["bytes"]), last_read,
                                   clone_readers))
    return Model(
        table=table,
        stage_nodes=stage_nodes,
        cost=[float(nodes[n]["compute_seconds"]) for n in stage_nodes],
        temp=[int(nodes[n]["temp_bytes"]) for n in stage_nodes],
        recomputable=[nodes[n]["recomputable"] == "" and not nodes[n]["backward"]
                      and bool(owned[s]) for s, n in enumerate(stage_nodes)],
        owned=owned,
        reads=reads,
        value_buffer=value_buffer,
        value_bytes=[int(buffers[b]["bytes"]) for b in value_buffer],
        value_owner=value_owner,
        value_readers=readers,
        fetched=[b in fetched_buffers for b in value_buffer],
        persistent_bytes=sum(int(b["bytes"]) for b in buffers
                             if b["persistent"] or (b.get("external", False) and b["bytes"] > 0)),
        stage_of_node=stage_of_node,
        reuse=reuse,
        reuse_bytes=reuse_bytes,
        copies=copies,
    )


class _Builder:
    """Variables and sparse constraint rows for scipy.optimize.milp."""

    def __init__(self):
        self.lb, self.ub, self.integer, self.c = [], [], [], []
        self.rows, self.cols, self.vals, self.row_lb, self.row_ub = [], [], [], [], []

    def var(self, lb=0.0, ub=1.0, integer=True, cost=0.0):
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(1 if integer else 0)
        self.c.append(cost)
        return len(self.lb) - 1

    def row(self, terms, lb=-np.inf, ub=np.inf):
        """sum(coef * x[var]) + constant in [lb, ub]; terms: (coef, var or None)."""
        r = len(self.row_lb)
        constant = 0.0
        for coef, v in terms:
            if v is None:
                constant += coef
            elif coef != 0:
                self.rows.append(r)
                self.cols.append(v)
                self.vals.append(coef)
        self.row_lb.append(lb - constant)
        self.row_ub.append(ub - constant)

    def solve(self, time_limit, mip_rel_gap):
        a = sparse.coo_matrix((self.vals, (self.rows, self.cols)),
                              shape=(len(self.row_lb), len(self.lb))).tocsr()
        return milp(np.array(self.c), integrality=np.array(self.integer),
                    bounds=Bounds(np.array(self.lb), np.array(self.ub)),
                    constraints=LinearConstraint(a, np.array(self.row_lb), np.array(self.row_ub)),
                    options={"time_limit": time_limit, "mip_rel_gap": mip_rel_gap,
                             "disp": False})


@dataclasses.dataclass
class Solution:
    status: str          # "optimal", "infeasible", "time_limit" (feasible or not), "error"
    proven_optimal: bool
    added_seconds: float  # Checkmate's objective (None without a solution)
    peak_bytes: int       # min_peak(): the optimum's peak incl. persistent (else None)
    schedule: list        # [(stage t, [stages computed in t, in order])]
    solve_seconds: float
    variables: int
    message: str
    mip_gap: float = None
    objective_bytes: int = None  # minimize_peak: the MILP's own peak (U), persistent included


def solve(model, budget_bytes=None, time_limit=60.0, mip_rel_gap=1e-6, fixed_recompute=None,
          minimize_peak=False, once=False, backward_only=False):
    """Solves Checkmate's MILP for `budget_bytes` (a device budget, persistent bytes
    included), or, with minimize_peak, the lowest peak reachable (objective: the peak;
    the compute is ignored). fixed_recompute: {(t, i)} forces exactly these R[t,i] = 1
    for t != i (all others 0): a given schedule, checked for feasibility. once: each
    node is recomputed at most once (our planner's restriction; a diagnostic, not
    Checkmate). backward_only: recomputations only in the stages of backward nodes
    (our planner's space; see the module docstring)."""
    n = model.n
    b = _Builder()
    start = time.perf_counter()
    peak = b.var(0.0, np.inf, integer=False, cost=1.0) if minimize_peak else None
    cap = None if minimize_peak else (budget_bytes - model.persistent_bytes) / MIB
    if cap is not None and cap < 0:
        return Solution("infeasible", True, None, None, [], 0.0, 0,
                        "the persistent bytes alone exceed the budget")

    # Every R and S entry is a term (coefficient, variable): ONE, ZERO or (1, var).
    R = [[ZERO] * (t + 1) for t in range(n)]
    for t in range(n):
        R[t][t] = ONE
        for i in range(t):
            if not model.recomputable[i]:
                continue
            if backward_only and not model.table["nodes"][model.stage_nodes[t]]["backward"]:
                continue
            if fixed_recompute is not None:
                if (t, i) in fixed_recompute:
                    R[t][i] = ONE
                continue
            R[t][i] = (1.0, b.var(cost=0.0 if minimize_peak else model.cost[i] * NS))
    if fixed_recompute is not None:
        for t, i in fixed_recompute:
            if not (i < t and R[t][i] == ONE):
                raise ValueError(f"checkmate: fixed R[{t},{i}] ({model.name(i)} in the stage "
                                 f"of {model.name(t)}) is outside the decision space")

    def r(t, i):
        return R[t][i] if i <= t else ZERO

    if once:
        for i in range(n):
            b.row([R[t][i] for t in range(i + 1, n) if R[t][i] != ZERO], ub=1.0)

    # Last stage at which a value can be read: a reader that is never recomputed
    # reads it only in its own stage.
    last_use = []
    for v in range(len(model.value_buffer)):
        last = model.value_owner[v]
        for j in model.value_readers[v]:
            last = max(last, n - 1 if model.recomputable[j] else j)
        last_use.append(last)
    # S[t][v]: kept from stage t-1 into stage t (absent: ZERO; S[n] is all ZERO).
    S = [dict() for _ in range(n + 1)]

    def s(t, v):
        return S[t].get(v, ZERO)

    for v in range(len(model.value_buffer)):
        for t in range(model.value_owner[v] + 1, n):
            if model.fetched[v]:
                S[t][v] = ONE
            elif t <= last_use[v]:
                S[t][v] = (1.0, b.var())
    # Keeping: S[t+1,v] <= R[t,owner] + S[t,v].
    for v in range(len(model.value_buffer)):
        o = model.value_owner[v]
        for t in range(o, n - 1):
            if s(t + 1, v) == ZERO:
                continue
            b.row([s(t + 1, v), _neg(r(t, o)), _neg(s(t, v))], ub=0.0)
    # Dependencies: R[t,k] <= R[t,owner(v)] + S[t,v] for every value k reads.
    for t in range(n):
        for k in range(t + 1):
            if r(t, k) == ZERO:
                continue
            for v in model.reads[k]:
                b.row([r(t, k), _neg(r(t, model.value_owner[v])), _neg(s(t, v))], ub=0.0)

    # Copy-on-write: COPY[t,k] (the copy is live at step k of stage t) is 1 from
    # the update's step on while an original old read is still to come, and else at
    # least every later recomputation that reads the old value (chained backwards).
    steps = [(t, k) for t in range(n) for k in range(t + 1) if r(t, k) != ZERO]
    position = {node: i for i, node in enumerate(model.table["order"])}
    copy_terms = {}
    for copy in model.copies:
        later = ZERO
        for t, k in reversed(steps):
            if (t, k) < (copy.stage, copy.stage):
                break
            if copy.last_read >= position[model.stage_nodes[t]]:
                live = ONE
            else:
                read = r(t, k) if (k != t and t > copy.stage and k in copy.clone_readers) else ZERO
                if ONE in (later, read):
                    live = ONE
                elif later == ZERO and read == ZERO:
                    live = ZERO
                else:
                    live = (1.0, b.var(integer=False))
                    for x in (later, read):
                        if x != ZERO:
                            b.row([live, _neg(x)], lb=0.0)
            if live != ZERO:
                copy_terms.setdefault((t, k), []).append((copy.bytes / MIB * live[0], live[1]))
            later = live

    # Memory, and FREE, stage by stage: U[t,k] is a sum of terms.
    for t in range(n):
        terms = [(model.value_bytes[v] / MIB * coef, var) for v, (coef, var) in S[t].items()]
        for k in range(t + 1):
            rk = r(t, k)
            if rk == ZERO:
                continue
            alloc = sum(model.value_bytes[v] for v in model.owned[k]) / MIB
            terms.append((alloc * rk[0], rk[1]))
            # Frees after node k: the values it read or owns, when nothing later in
            # this stage reads them and they are not kept into the next stage.
            frees = {}
            for v in sorted(set(model.reads[k]) | set(model.owned[k])):
                if model.fetched[v]:
                    continue
                later = [r(t, j) for j in model.value_readers[v] if k < j <= t]
                later = [x for x in later if x != ZERO]
                nxt = s(t + 1, v)
                if ONE in later or nxt == ONE:
                    continue  # a later reader surely runs, or v is kept: not freed here
                # h = (1 - R[t,k]) + S[t+1,v] + sum R[t,j]; 1 - FREE <= h <= kappa (1 - FREE)
                h = [(1.0, None), _neg(rk), nxt] + later
                kappa = 2.0 + len(later)
                free = b.var()
                b.row(h + [(1.0, free)], lb=1.0)
                b.row(h + [(kappa, free)], ub=kappa)
                frees[v] = free
            # In-place reuse: output 0 takes over an input freed here (REUSE <= the
            # FREEs of the candidates), saving its bytes during this step.
            step = terms + [(model.temp[k] / MIB * rk[0], rk[1])] + copy_terms.get((t, k), [])
            candidates = [frees[v] for v in model.reuse[k] if v in frees]
            if candidates:
                reuse = b.var(integer=False)
                b.row([(1.0, reuse)] + [(-1.0, f) for f in candidates], ub=0.0)
                step.append((-model.reuse_bytes[k] / MIB, reuse))
            if minimize_peak:
                b.row(step + [(-1.0, peak)], ub=0.0)
            else:
                b.row(step, ub=cap)
            terms.extend((-model.value_bytes[v] / MIB, f) for v, f in frees.items())
            terms = _compact(terms)

    res = b.solve(time_limit, mip_rel_gap)
    seconds = time.perf_counter() - start
    variables = len(b.lb)
    status = {0: "optimal", 1: "time_limit", 2: "infeasible"}.get(res.status, "error")
    gap = getattr(res, "mip_gap", None)
    if res.x is None:
        return Solution(status, status == "infeasible", None, None, [], seconds, variables,
                        res.message, gap)
    x = np.round(res.x).astype(int)
    schedule = []
    added = 0.0
    for t in range(n):
        run = [i for i in range(t + 1)
               if R[t][i] == ONE or (R[t][i] != ZERO and x[R[t][i][1]] == 1)]
        added += sum(model.cost[i] for i in run if i != t)
        schedule.append((t, run))
    peak_bytes = objective = None
    if minimize_peak:  # the exact peak of the schedule found
        peak_bytes = replay(model, milp_steps(model, schedule))
        objective = int(round(res.fun * MIB)) + model.persistent_bytes
    return Solution(status, status == "optimal", added, peak_bytes, schedule, seconds, variables,
                    res.message, gap, objective)


ONE = (1.0, None)
ZERO = (0.0, None)


def _neg(term):
    return (-term[0], term[1])


def _compact(terms):
    """Sums the coefficients of equal variables (constants under None)."""
    out = {}
    for coef, v in terms:
        out[v] = out.get(v, 0.0) + coef
    return [(coef, v) for v, coef in out.items() if coef != 0.0 or v is None]


# ---- Replay: the simulator's rules on a table and an order ----------------------

def simulate(table, order):
    """Peak bytes (persistent included) of replaying `table` (a table_json, or a
    schedule's table from milp_steps) in `order`, by liveness_simulator.cc's rules
    (Replay::RunStep), re-implemented here so that the planner's figures are checked,
    not echoed: a step allocates its outputs (output 0 takes over a reusable input's
    buffer when this step is that buffer's last reader), its extra buffers, and a copy
    of each variable it updates while reads of the variable's value are pending
    (copy-on-write); it counts the live bytes plus its temp bytes; then it frees the
    buffers whose last reader it was (fetched and caller-held buffers never), the old
    variable copies whose last read it was, and the extra buffers it releases.
    One device: the benchmark's graphs run on one."""
    nodes, tensors, buffers = table["nodes"], table["tensors"], table["buffers"]
    if len(set(b["device"] for b in buffers)) > 1:
        raise ValueError("simulate: more than one device")
    position = {}
    for i, n in enumerate(order):
        if n in position or not 0 <= n < len(nodes):
            raise ValueError(f"simulate: bad order entry {n}")
        position[n] = i
    if len(position) != len(nodes):
        raise ValueError(f"simulate: the order covers {len(position)} of {len(nodes)} nodes")
    buffer_of = [t["buffer"] for t in tensors]
    resource = [t.get("dtype") == "resource" for t in tensors]
    persistent = [b["persistent"] for b in buffers]
    external = [b.get("external", False) for b in buffers]
    size = [int(b["bytes"]) for b in buffers]
    consumers = [[] for _ in tensors]
    for n, node in enumerate(nodes):
        for t in node["inputs"]:
            consumers[t].append(n)

    def forward(t, consumer):
        return position[tensors[t]["node"]] < position[consumer]

    alias = list(range(len(buffers)))

    def resolve(b):
        while alias[b] != b:
            b = alias[b]
        return b

    pending = [0] * len(buffers)
    for t in range(len(tensors)):
        pending[buffer_of[t]] += sum(1 for c in consumers[t] if forward(t, c))
    for t in table["fetch"]:
        pending[buffer_of[t]] += 1
    live = [False] * len(buffers)
    transient = 0
    for b in range(len(buffers)):
        if external[b] and not persistent[b]:
            pending[b] += 1
            live[b] = True
            transient += size[b]
    value_reads = [0] * len(buffers)
    old_reads = [0] * len(buffers)
    copy_bytes = [0] * len(buffers)
    generation = [0] * len(buffers)
    tensor_generation = [0] * len(tensors)
    released_here = {}
    for b, buffer in enumerate(buffers):
        if buffer.get("released_by", -1) >= 0:
            released_here.setdefault(buffer["released_by"], []).append(b)
    resident = sum(size[b] for b in range(len(buffers)) if persistent[b])
    peak = None

    def release(b):
        nonlocal transient
        if pending[b] == 0 and live[b]:
            live[b] = False
            transient -= size[b]

    def take_over(node, n, t):
        own = buffer_of[t]
        for port in node.get("reusable_inputs", []):
            u = node["inputs"][port]
            if not forward(u, n):
                continue
            b = resolve(buffer_of[u])
            if (live[b] and not persistent[b] and not external[b] and pending[b] == 1
                    and size[b] == size[own]):
                return b
        return -1

    for n in order:
        node = nodes[n]
        for i, t in enumerate(node["outputs"]):
            own = buffer_of[t]
            if persistent[own]:
                if not resource[t]:
                    b = resolve(own)
                    value_reads[b] += sum(1 for c in consumers[t] if forward(t, c))
                    tensor_generation[t] = generation[b]
                continue
            if live[own] or buffers[own]["owner"] != t or alias[own] != own:
                continue
            reused = take_over(node, n, t) if i == 0 else -1
            if reused >= 0:
                alias[reused] = own
                pending[own] += pending[reused]
                pending[reused] = 0
                live[reused] = False
                transient -= size[reused]
            live[own] = True
            transient += size[own]
        for b in node.get("extra_buffers", []):
            live[b] = True
            transient += size[b]
        for port in node.get("updated_variables", []):
            b = resolve(buffer_of[node["inputs"][port]])
            if not persistent[b] or value_reads[b] == 0:
                continue
            old_reads[b] += value_reads[b]
            value_reads[b] = 0
            generation[b] += 1
            copy_bytes[b] += size[b]
            transient += size[b]
        total = resident + transient + int(node["temp_bytes"])
        peak = total if peak is None else max(peak, total)
        for t in node["inputs"]:
            if not forward(t, n):
                continue
            b = resolve(buffer_of[t])
            pending[b] -= 1
            if persistent[b] and not resource[t]:
                if tensor_generation[t] == generation[b]:
                    value_reads[b] -= 1
                elif old_reads[b] > 0:
                    old_reads[b] -= 1
                    if old_reads[b] == 0:
                        transient -= copy_bytes[b]
                        copy_bytes[b] = 0
            release(b)
        for t in node["outputs"]:
            release(resolve(buffer_of[t]))
        # Extra buffers go after their reader has run, or at once without one.
        extra = [b for b in node.get("extra_buffers", [])
                 if buffers[b].get("released_by", -1) < 0
                 or position[buffers[b]["released_by"]] <= position[n]]
        for b in extra + released_here.get(n, []):
            if live[b]:
                live[b] = False
                transient -= size[b]
    return peak or 0


def replay(model, run):
    """Peak bytes of a run: (table, order), as milp_steps and base_steps give."""
    table, order = run
    return simulate(table, order)


def _forwarded_slot(table, node, t):
    """The input position whose buffer forwarded output tensor t shares."""
    tensors = table["tensors"]
    return [tensors[u]["buffer"] for u in node["inputs"]].index(tensors[t]["buffer"])


def milp_steps(model, schedule):
    """A Checkmate schedule as (table, order), the table rewritten as our recompute
    pass would: each recomputation of a stage is a clone of its node with new output
    buffers, and every run reads the latest instance of each value (computed earlier
    in its stage, or kept from before). A read through a forwarding op (Reshape,
    Identity) of a value recomputed since that op ran goes through a clone of the op
    (which allocates nothing). A kernel's extra buffer (oneDNN's MaxPool workspace)
    goes with the instance that its releasing node reads, as BuildTensorTable binds it
    on a rewritten graph. Nodes that are no stage keep their place in the table's
    order; each stage's recomputations run right before its node."""
    src = model.table
    nodes = [dict(n, inputs=list(n["inputs"]), outputs=list(n["outputs"]),
                  extra_buffers=list(n.get("extra_buffers", []))) for n in src["nodes"]]
    tensors = [dict(t) for t in src["tensors"]]
    buffers = [dict(b) for b in src["buffers"]]
    table = dict(src, nodes=nodes, tensors=tensors, buffers=buffers)
    value_of_buffer = {b: v for v, b in enumerate(model.value_buffer)}
    latest = {}      # value -> node index of its latest instance
    base_of = {}     # clone -> table node
    forwarding = {}  # (forwarding node, tensor it reads now) -> its clone
    order = []

    def owns(t):
        return src["buffers"][src["tensors"][t]["buffer"]]["owner"] == t

    def clone(n):
        index = len(nodes)
        nodes.append(dict(src["nodes"][n], name=f"checkmate/{index}/{src['nodes'][n]['name']}",
                          outputs=[], extra_buffers=[]))
        base_of[index] = n
        for t in src["nodes"][n]["outputs"]:
            tensors.append(dict(src["tensors"][t], node=index))
            nodes[index]["outputs"].append(len(tensors) - 1)
            if owns(t):
                buffers.append(dict(src["buffers"][src["tensors"][t]["buffer"]],
                                    owner=len(tensors) - 1, external=False))
                tensors[-1]["buffer"] = len(buffers) - 1
        return index

    def wire(index, base, inputs):
        """Gives run `index` of table node `base` these inputs; forwarded outputs
        share the buffer of the input they forward."""
        nodes[index]["inputs"] = inputs
        for j, t in enumerate(nodes[index]["outputs"]):
            orig = src["nodes"][base]["outputs"][j]
            if not owns(orig):
                slot = _forwarded_slot(src, src["nodes"][base], orig)
                tensors[t]["buffer"] = tensors[inputs[slot]]["buffer"]

    def current(t):
        """The tensor a run reads now for table tensor t."""
        v = value_of_buffer.get(src["tensors"][t]["buffer"])
        if v is None:
            return t
        producer, port = src["tensors"][t]["node"], src["tensors"][t]["port"]
        if owns(t):
            return nodes[latest.get(v, producer)]["outputs"][port]
        node = src["nodes"][producer]
        source = current(node["inputs"][_forwarded_slot(src, node, t)])
        if tensors[t]["buffer"] == tensors[source]["buffer"]:
            return t
        key = (producer, source)
        if key not in forwarding:
            forwarding[key] = clone(producer)
            nodes[forwarding[key]]["compute_seconds"] = 0.0
            wire(forwarding[key], producer, [current(u) for u in node["inputs"]])
            order.append(forwarding[key])
        return nodes[forwarding[key]]["outputs"][port]

    runs_of = {model.stage_nodes[t]: run for t, run in schedule}
    for n in src["order"]:
        if n not in runs_of:
            order.append(n)
            continue
        for k in runs_of[n]:
            base = model.stage_nodes[k]
            index = base if base == n else clone(base)
            inputs = [current(u) for u in src["nodes"][base]["inputs"]]
            wire(index, base, inputs)
            order.append(index)
            for v in model.owned[k]:
                latest[v] = index
    # Extra buffers: with the instance their releasing node reads.
    for p, node in enumerate(src["nodes"]):
        for e in node.get("extra_buffers", []):
            reader = src["buffers"][e].get("released_by", -1)
            if reader < 0:
                continue
            for u in nodes[reader]["inputs"]:
                c = tensors[u]["node"]
                if base_of.get(c) == p:
                    nodes[p]["extra_buffers"].remove(e)
                    buffers.append(dict(src["buffers"][e], owner=nodes[c]["outputs"][0]))
                    nodes[c]["extra_buffers"].append(len(buffers) - 1)
                    break
    return table, order


def base_steps(model):
    """The table's order as it is (no recompute)."""
    return model.table, list(model.table["order"])


@dataclasses.dataclass
class OurSchedule:
    steps: tuple          # (table, order): the output graph's table and executor order
    fixed: set            # {(stage t, stage i)}: the clones as Checkmate's R entries
    clone_seconds: float  # compute of all clones
    base_order_kept: bool  # the original nodes run in the table's order
    checkmate_exact: bool  # ...and each stage's clones run in stage order, before it
    clone_names: list     # clones in the order they run


def our_schedule(model, output_table, clone_prefix="TfMemOpt/Recompute/"):
    """Our planner's output graph as the verify stage simulates it: `output_table` is
    the table of the output graph (run_pass on it, export_table=True), replayed in its
    own order (the executor order the simulator emulates, ExecutorOrder).

    In Checkmate's terms, a clone belongs to the stage of the next original node that
    is a stage. That is exact when the original stages keep the table's order
    (base_order_kept) and each stage's clones run in stage order; a clone can move the
    backward reader it feeds, and then the plan runs in another order than the
    MILP's (fixed is still given, on the table's stages, but only as an
    approximation)."""
    nodes = model.table["nodes"]
    index = {node["name"]: i for i, node in enumerate(nodes)}
    out_nodes = output_table["nodes"]
    original = {}
    for node in out_nodes:
        name = node["name"]
        if name.startswith(clone_prefix) and name[len(clone_prefix):] in index:
            original[name] = index[name[len(clone_prefix):]]
        elif name not in index:
            raise ValueError(f"our_schedule: {name} is neither in the table nor a clone")
    clone_seconds = 0.0
    pending = []  # stages of clones waiting for the next original stage
    fixed = set()
    base_stages = []
    exact = True
    sequence = [out_nodes[n]["name"] for n in output_table["order"]]
    for name in sequence:
        base = original.get(name, index.get(name))
        stage = model.stage_of_node.get(base)
        if name in original:
            clone_seconds += nodes[base]["compute_seconds"]
            if stage is not None and model.owned[stage]:
                pending.append(stage)
        elif stage is not None:
            base_stages.append(stage)
            exact = exact and pending == sorted(set(pending)) and all(i < stage for i in pending)
            fixed.update((stage, i) for i in pending if i < stage)
            pending = []
    if pending:
        raise ValueError("our_schedule: clones run after the last original node")
    kept = base_stages == list(range(model.n))
    return OurSchedule((output_table, list(output_table["order"])), fixed, clone_seconds,
                       kept, kept and exact, [n for n in sequence if n in original])
