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
the table the planner analyzed, so that both see the same graph:

* Values are the table's non-persistent buffers with bytes > 0 (a buffer is what the
  simulator allocates and frees; a forwarding op such as Identity or Reshape shares
  its input's buffer, so it is contracted onto that buffer: whoever reads the
  forwarded tensor reads the buffer). S, FREE and the memory terms are per value;
  R is per node (recomputing a node regenerates all the values it owns).
* Stages are the nodes of the table's `order` that own a value, read one, or have
  temp bytes; the other nodes (constants, variable handles, ReadVariableOps that
  forward the variable, NoOps) neither allocate nor free anything the simulator
  counts, so their steps cannot hold the peak. "Nodes" (the size of a graph, at most
  40 in the benchmark) counts only the stages that own a value: reader-only stages
  (variable updates, forwarding ops) add no decision.
* Costs are the table's compute_seconds; bytes, temp bytes and persistent bytes are
  the table's (persistent bytes are a constant taken off the budget; a node's temp
  bytes count while it runs: U[t,k] + temp_k * R[t,k] <= budget - persistent).
* Fetched values are kept from their production to the end (S = 1, never FREE).
* The decision space is the planner's: only forward nodes whose `recomputable` is ""
  (and which own a value) may run in a stage other than their own. Unlike our
  planner, Checkmate may recompute a node in several stages (that is its bar).

Differences from our simulator (liveness_simulator.cc) that remain:
* Checkmate's memory is counted per stage: a value kept into a stage but read by
  nobody in it is only dropped at the stage's end (the optimum never keeps such a
  value, so this only removes useless solutions), and a value both kept and
  recomputed in one stage counts twice (as in the simulator, where the original and
  the clone are both live).
* A clone of a forwarding op (our planner clones Reshape/Identity views of a
  recomputed buffer for their backward readers) is free in the MILP: the view is
  contracted onto its buffer. The estimator charges 1e-9 s for such ops, so our
  plans can cost a few nanoseconds more for this reason alone.
* Memory enters the MILP in MiB (bytes / 2**20, exact in floating point) and HiGHS
  accepts rows within its feasibility tolerance (1e-7 of a MiB, a fraction of a byte,
  for exact 0/1 values): the replay of the rounded schedule is what is checked.
* Our planner and verify stage run a plan in Grappler's topological order of the
  output graph (breadth-first; grappler/simulate/execution_order.cc). A clone then
  runs where that order puts it, and in Checkmate's terms it is a recompute in the
  stage of the next original node. When a clone also delays an original node past
  others (its backward reader waits for it), the plan runs in another order than
  the table's, and is not exactly a Checkmate schedule on the MILP's stages (the
  benchmark counts these cases). Checkmate may recompute anywhere, several times,
  and orders each stage's recomputations freely.

Every solution is checked by replay() (a plain-Python liveness simulation with the
simulator's rules, run on the schedule itself, not on the MILP's U), and our
planner's output graph is replayed by the same function (our_schedule()).
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
    persistent_bytes: int
    stage_of_node: dict      # table node index -> stage

    @property
    def n(self):
        return len(self.stage_nodes)

    @property
    def allocating_nodes(self):
        """The size of the graph: stages that own a value."""
        return sum(1 for o in self.owned if o)

    def name(self, stage):
        return self.table["nodes"][self.stage_nodes[stage]]["name"]


def build_model(table):
    """The MILP's view of a run_pass table (see the module docstring)."""
    nodes, tensors, buffers = table["nodes"], table["tensors"], table["buffers"]
    is_value = [not b["persistent"] and b["bytes"] > 0 for b in buffers]
    fetched_buffers = {tensors[t]["buffer"] for t in table["fetch"]}

    def owned_buffers(n):
        out = []
        for t in nodes[n]["outputs"]:
            b = tensors[t]["buffer"]
            if is_value[b] and buffers[b]["owner"] == t:
                out.append(b)
        return out

    def read_buffers(n):
        return sorted({tensors[t]["buffer"] for t in nodes[n]["inputs"]
                       if is_value[tensors[t]["buffer"]]})

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
        persistent_bytes=sum(int(b["bytes"]) for b in buffers if b["persistent"]),
        stage_of_node=stage_of_node,
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


def solve(model, budget_bytes=None, time_limit=60.0, mip_rel_gap=1e-6, fixed_recompute=None,
          minimize_peak=False, once=False):
    """Solves Checkmate's MILP for `budget_bytes` (a device budget, persistent bytes
    included), or, with minimize_peak, the lowest peak reachable (objective: the peak;
    the compute is ignored). fixed_recompute: {(t, i)} forces exactly these R[t,i] = 1
    for t != i (all others 0): a given schedule, checked for feasibility. once: each
    node is recomputed at most once (our planner's restriction; a diagnostic, not
    Checkmate)."""
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

    # Memory, and FREE, stage by stage: U[t,k] is a sum of terms.
    for t in range(n):
        terms = [(model.value_bytes[v] / MIB * coef, var) for v, (coef, var) in S[t].items()]
        for k in range(t + 1):
            rk = r(t, k)
            if rk == ZERO:
                continue
            alloc = sum(model.value_bytes[v] for v in model.owned[k]) / MIB
            terms.append((alloc * rk[0], rk[1]))
            temp = model.temp[k] / MIB
            row = terms + [(temp * rk[0], rk[1])]
            if minimize_peak:
                b.row(row + [(-1.0, peak)], ub=0.0)
            else:
                b.row(row, ub=cap)
            # Frees after node k: the values it read or owns, when nothing later in
            # this stage reads them and they are not kept into the next stage.
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
                terms.append((-model.value_bytes[v] / MIB, free))
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
    peak_bytes = None
    if minimize_peak:  # the exact peak of the schedule found
        peak_bytes = replay(model, milp_steps(model, schedule))
    return Solution(status, status == "optimal", added, peak_bytes, schedule, seconds, variables,
                    res.message, gap)


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


# ---- Replay: the simulator's rules on an explicit schedule ----------------------

@dataclasses.dataclass
class Step:
    """One node run: `node` is a stage; `outputs` are instance ids it creates (one per
    value it owns), `reads` the instance ids it reads."""
    node: int
    outputs: list
    reads: list


def replay(model, steps):
    """Peak bytes (persistent included) of running `steps` in order: a step allocates
    its outputs, counts live bytes plus its temp bytes, then frees every instance whose
    last reader it was (instances of fetched values are never freed)."""
    size, fetched_instance = {}, set()
    last_read = {}
    for i, step in enumerate(steps):
        for inst, v in step.outputs:
            size[inst] = model.value_bytes[v]
            if model.fetched[v]:
                fetched_instance.add(inst)
            last_read.setdefault(inst, i)
        for inst in step.reads:
            if inst not in size:
                raise ValueError(f"replay: step {i} ({model.name(step.node)}) reads an "
                                 f"instance that was never computed")
            last_read[inst] = max(last_read[inst], i)
    live = 0
    peak = 0
    frees_at = {}
    for inst, i in last_read.items():
        if inst not in fetched_instance:
            frees_at.setdefault(i, []).append(inst)
    for i, step in enumerate(steps):
        live += sum(size[inst] for inst, _ in step.outputs)
        peak = max(peak, live + model.temp[step.node])
        live -= sum(size[inst] for inst in frees_at.get(i, []))
    return peak + model.persistent_bytes


def milp_steps(model, schedule):
    """The steps of a Checkmate schedule: each run reads the latest instance of each
    value (computed earlier in the stage, or kept from before)."""
    latest = {}
    steps = []
    for _, run in schedule:
        for k in run:
            reads = []
            for v in model.reads[k]:
                if v not in latest:
                    raise ValueError(f"replay: {model.name(k)} reads a value not computed yet")
                reads.append(latest[v])
            outputs = []
            for v in model.owned[k]:
                inst = (v, len(steps))
                outputs.append((inst, v))
                latest[v] = inst
            steps.append(Step(k, outputs, reads))
    return steps


def base_steps(model):
    """The steps of the table's order as it is (no recompute)."""
    return milp_steps(model, [(t, [t]) for t in range(model.n)])


def grappler_order(graph_def):
    """Node names of `graph_def` in the order Grappler's ComputeTopologicalOrder gives
    (grappler/simulate/execution_order.cc): nodes without fan-ins first, in node order,
    then breadth-first, each node's fan-outs in increasing node order, a node entering
    the queue when its last distinct fan-in (data or control) has run. The planner
    simulates every plan in this order, and the verify stage sorts the output graph
    with this function."""
    names = [d.name for d in graph_def.node]
    index = {name: i for i, name in enumerate(names)}
    fanins = []
    for d in graph_def.node:
        producers = {index[inp.lstrip("^").split(":")[0]] for inp in d.input}
        fanins.append(sorted(producers))
    fanouts = [[] for _ in names]
    for i, producers in enumerate(fanins):
        for p in producers:
            fanouts[p].append(i)
    if any(d.op in ("Merge", "RefMerge", "NextIteration") for d in graph_def.node):
        raise ValueError("grappler_order: loops are not supported")
    ready = [0] * len(names)
    order = [i for i in range(len(names)) if not fanins[i]]
    front = 0
    while front < len(order):
        for nxt in fanouts[order[front]]:
            ready[nxt] += 1
            if ready[nxt] == len(fanins[nxt]):
                order.append(nxt)
        front += 1
    if len(order) != len(names):
        raise ValueError("grappler_order: the graph has a cycle")
    return [names[i] for i in order]


@dataclasses.dataclass
class OurSchedule:
    steps: list           # Steps of the output graph in Grappler's order
    fixed: set            # {(stage t, stage i)}: the clones as Checkmate's R entries
    clone_seconds: float  # compute of all clones
    base_order_kept: bool  # the original nodes run in the table's order
    checkmate_exact: bool  # ...and each stage's clones run in stage order, before it
    clone_names: list     # clones in the order they run


def our_schedule(model, graph_def, clone_prefix="TfMemOpt/Recompute/"):
    """Our planner's output graph, run as the planner and the verify stage simulate it:
    in Grappler's topological order of the output graph (grappler_order). Reads follow
    the output graph's wiring.

    In Checkmate's terms, a clone belongs to the stage of the next original node that
    owns a stage. That is exact when the original nodes keep the table's order
    (base_order_kept); a clone can delay the backward reader it feeds past other
    nodes, and then the plan runs in another order than the MILP's (fixed is still
    given, on the table's stages, but only as an approximation)."""
    table = model.table
    nodes = table["nodes"]
    index = {node["name"]: i for i, node in enumerate(nodes)}
    defs = {node.name: node for node in graph_def.node}
    original = {d.name: index[d.name[len(clone_prefix):]]
                for d in graph_def.node if d.name.startswith(clone_prefix)}
    missing = [d.name for d in graph_def.node
               if d.name not in original and d.name not in index]
    if missing:
        raise ValueError(f"our_schedule: nodes outside the table: {missing[:5]}")
    sequence = grappler_order(graph_def)

    def producer(name):
        base, _, port = name.lstrip("^").partition(":")
        return base, int(port) if port else 0

    tensors, buffers = table["tensors"], table["buffers"]
    value_of_buffer = {bf: v for v, bf in enumerate(model.value_buffer)}
    instance_of = {}  # (graph node name, port) -> instance or None
    steps = []
    clone_seconds = 0.0
    pending = []  # stages of clones waiting for the next original stage
    fixed = set()
    base_stages = []
    exact = True
    for name in sequence:
        base = original.get(name, index.get(name))
        node = nodes[base]
        inputs = [i for i in defs[name].input if not i.startswith("^")]
        read_instances = [instance_of.get(producer(inp)) for inp in inputs]
        outputs = []
        for t in node["outputs"]:
            tensor = tensors[t]
            b = tensor["buffer"]
            v = value_of_buffer.get(b)
            if v is None:
                instance_of[(name, tensor["port"])] = None
            elif buffers[b]["owner"] == t:
                inst = (v, name)
                outputs.append((inst, v))
                instance_of[(name, tensor["port"])] = inst
            else:  # forwarded: the instance of the input on the same buffer
                slot = [tensors[u]["buffer"] for u in node["inputs"]].index(b)
                instance_of[(name, tensor["port"])] = read_instances[slot]
        stage = model.stage_of_node.get(base)
        if name in original:
            clone_seconds += node["compute_seconds"]
            if stage is not None and model.owned[stage]:
                pending.append(stage)
        elif stage is not None:
            base_stages.append(stage)
            exact = exact and pending == sorted(set(pending)) and all(i < stage for i in pending)
            fixed.update((stage, i) for i in pending if i < stage)
            pending = []
        if stage is None:
            continue
        reads = [inst for inst in read_instances if inst is not None]
        steps.append(Step(stage, outputs, reads))
    if pending:
        raise ValueError("our_schedule: clones run after the last original node")
    kept = base_stages == list(range(model.n))
    return OurSchedule(steps, fixed, clone_seconds, kept, kept and exact,
                       [n for n in sequence if n in original])
