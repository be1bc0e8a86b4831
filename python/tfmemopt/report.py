"""Reports of the TfMemOpt pass: one per graph it optimized in this process."""

import base64
import collections
import html
import io
import json
import re

PeakTensor = collections.namedtuple("PeakTensor", "name op bytes role device")


def format_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _histories(device):
    """', worst of N allocator histories: NAME' for a device dict whose allocator model
    replayed several histories of the memory before the step, ', allocator history:
    NAME' for one that replayed the one it knew (docs/allocator.md)."""
    peaks = device.get("allocator_history_peaks") or {}
    if not peaks:
        return ""
    if len(peaks) == 1:
        return f", allocator history: {device['allocator_history']}"
    return f", worst of {len(peaks)} allocator histories: {device['allocator_history']}"


def _before_after(section, field, changed_only=False):
    """'DEVICE BEFORE -> AFTER, ...' of a report section's per-device
    {field}_before_bytes and {field}_after_bytes (only the devices where it changed,
    with changed_only)."""
    after = section.get(f"{field}_after_bytes", {})
    return ", ".join(
        f"{device or '(unplaced)'} {format_bytes(before)} -> "
        f"{format_bytes(after.get(device, before))}"
        for device, before in sorted(section.get(f"{field}_before_bytes", {}).items())
        if not changed_only or after.get(device, before) != before)


_PLOT_HINT = "pip install 'tfmemopt[plot]'"

# Stack order and colours of the timeline chart, bottom to top.
_SERIES = (
    ("weights and optimizer state", "#9e9e9e"),
    ("activations", "#4c72b0"),
    ("gradients", "#dd8452"),
)
_HOST_SERIES = ("swapped to host", "#55a868")
_CALL_SCOPE = re.compile(r"(Stateful)?PartitionedCall(_[0-9]+)?")


def _matplotlib():
    """Figure and the Agg canvas, without touching pyplot's global backend (which
    would switch the backend of a notebook or GUI the caller is running)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            f"tfmemopt: Report.plot() and Report.to_html() need matplotlib: {_PLOT_HINT}"
        ) from err
    return Figure, FigureCanvasAgg


def _axis_unit(top):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= size:
            return unit, size
    return "B", 1


def _short_name(name, limit=40):
    """The last two scopes of a node name: enough to recognise the layer and op.
    Scopes that inlined function calls add (StatefulPartitionedCall/) say neither."""
    parts = name.split("/")
    parts = [p for p in parts[:-1] if not _CALL_SCOPE.fullmatch(p)] + parts[-1:]
    short = "/".join(parts[-2:])
    return short if len(short) <= limit else "…" + short[-(limit - 1):]


class Report:
    """What the pass found (and did) for one graph.

    Attributes: graph_id, status ('ok' or 'fallback'), failed_stage, message, mode,
    num_nodes, num_tensors, unresolved_tensors (dense tensors with unknown dimensions,
    counted as 1 each), unresolved_variants (TensorLists and optionals whose contents
    shape inference does not give, counted as empty), devices (list of device names),
    budget_bytes ({device: bytes}, 0 = unknown; the step's share: what is left of the
    budget once held_outside_bytes, memory the device held outside this graph when it
    was planned, is taken), persistent_bytes ({device: bytes}), memory_bytes
    ({device: bytes}: the device's memory, 0 = unknown),
    predicted_peak_bytes ({'before': {device: bytes}, 'after': {...}}),
    top_tensors_at_peak (10 largest PeakTensor across devices), fits (bool or None;
    False also when the allocator model ran out of memory: to_dict()'s devices carry
    allocator_refused_bytes and allocator_refused, the first allocation BFC's model could
    not place, and allocator_refused_before_bytes, the first such allocation of the
    original graph: without a plan TF runs out of memory, and the 'before' peak is only
    how far the model got; allocator_history_peaks, the model's peak after each history of the memory
    before the step that it replays, 0 for one that ran out, and allocator_history, the
    worst of them, which the device's figures describe),
    recompute (what recomputation did: policy, nodes, added_seconds, step_seconds,
    feasible, search, checkpoints, left_alone, ...), swap (tensors, num_swap_out, num_swap_in,
    bytes_to_host, host_peak_bytes, copy_seconds), schedule (what the scheduling stage
    did before any swap or recompute: planned, num_edges, edges as [waited for, waiting]
    node names, peak_before_bytes and peak_after_bytes per device, the peak of the
    backward pass's own bytes in backward_peak_before_bytes and backward_peak_after_bytes,
    simulations),
    min_tensor_bytes (the smallest tensor size the applied plan considered; with the
    adaptive default, below 1 MiB only when the budget needed smaller tensors; -1 when
    nothing was planned),
    split (splitting per-sample work along the batch, the planner's fourth choice:
    planned, applied, batch, slices, rows, stages, ops (the split ops), op_types, cuts,
    joins, sums, added_seconds, through_batch_statistics (the split passes through
    gradients of batch statistics, used only when no other split fits:
    docs/split.md#batch-statistics), left_alone, trials (what the planner simulated:
    slices, region_ops, peak_bytes per device, fits, through_batch_statistics), note),
    order_guard (the orders TF's executor may run the rewritten graph in, checked
    against the budget: checked, edges that pin the planned order as [waited for,
    waiting] node names, complete, worst_peak_before_bytes and worst_peak_after_bytes
    per device, unplanned (the graph needed no plan and the edges pin its own order,
    which meets the budget where another order would not), deferred (how many of the
    edges, listed first, make a node that TF's executor would run at the start of the
    step wait for its reader's other input, such as SGD's `m * momentum`), and
    eager_start_peak_before_bytes / eager_start_peak_after_bytes per device (the peak
    when such nodes run at the start); see docs/design.md),
    onednn_merges (node pairs TF's oneDNN layout pass merges into one kernel, such as
    Conv2DBackpropFilter + BiasAddGrad, kept mergeable so that they run the kernels they
    run without tfmemopt: kept (false when the plan fits its budget only with the order
    edges that break them, which it then keeps: those pairs' gradients sum in another
    order), pairs, edges_shared, edges_removed, edges_moved, partner_edges (other
    Conv2DBackpropFilter nodes of a gradient made to wait for its BiasAddGrad's merge
    partner), cycle_edges (edges moved or taken back so that no merged pair has a path
    between its two nodes, which TF would find as a cycle), and unmerged, the pairs a
    swap or a clone reading the first node leaves unmerged),
    loop_pacing (values a loop would compute up to parallel_iterations iterations ahead
    of the carried value they are combined with, such as a recurrent layer's input
    projection and the terms of its weight gradients' sums, made to wait for that value:
    values (the carried values waited for), edges as [waited for, waiting] node
    names, and unplanned (true when nothing was planned: the graph fits its budget as
    predicted, but its loops running ahead could take it over); see docs/loops.md),
    arrival_order_sums (sums in the graph the pass was given that TF adds up in the
    order their terms finish, as [{name, terms}]: an AddN that TF's built-in memory
    optimizer turned into AssignAdds to a TemporaryVariable, or an AccumulateNV2. Their
    last bits follow the execution order, which differs from run to run with several
    inter-op threads and which any rewrite changes; see
    docs/design.md#arrival-order-sums),
    loops (per while-loop: its trip count, the TensorLists it fills, which of them were
    moved to host memory as they fill, with bytes and predicted copy time, and
    left_alone, why not; see docs/loops.md), stage_seconds, total_seconds.
    """

    def __init__(self, data):
        self._data = data
        self.graph_id = data["graph_id"]
        self.status = data["status"]
        self.failed_stage = data["failed_stage"]
        self.message = data["message"]
        self.mode = data["mode"]
        self.num_nodes = data["num_nodes"]
        self.never_run_nodes = data.get("never_run_nodes", 0)
        self.num_tensors = data["num_tensors"]
        self.unresolved_tensors = data["unresolved_tensors"]
        self.unresolved_variants = data.get("unresolved_variants", 0)
        self.graph_changed = data["graph_changed"]
        self.min_tensor_bytes = data.get("min_tensor_bytes", -1)
        devices = data["devices"]
        self.devices = [d["device"] for d in devices]
        self.budget_bytes = {d["device"]: d["budget_bytes"] for d in devices}
        self.persistent_bytes = {d["device"]: d["persistent_bytes"] for d in devices}
        # The device's memory the budget was taken from (0 where it is unknown).
        self.memory_bytes = {d["device"]: d.get("memory_bytes", 0) for d in devices}
        # Held by the device's allocator when the graph was planned and not the graph's
        # own (count_memory_held_outside): budget_bytes is what was left of the budget.
        self.held_outside_bytes = {d["device"]: d.get("held_outside_bytes", 0) for d in devices}
        # Sum of live tensors at the peak step; predicted_peak_bytes may be higher
        # where the device's BFC allocator is modelled (it counts whole chunks).
        self.live_peak_bytes = {d["device"]: d.get("live_peak_bytes", 0) for d in devices}
        self.allocator = {d["device"]: d.get("allocator", "none") for d in devices}
        self.predicted_peak_bytes = {
            "before": {d["device"]: d["peak_before_bytes"] for d in devices},
            "after": {d["device"]: d["peak_after_bytes"] for d in devices},
        }
        peak = [
            PeakTensor(t["name"], t["op"], t["bytes"], t["role"], d["device"])
            for d in devices
            for t in d["top_tensors_at_peak"]
        ]
        self.top_tensors_at_peak = sorted(peak, key=lambda t: (-t.bytes, t.name))[:10]
        # The largest single op's working set (inputs, outputs, scratch): no plan
        # that keeps ops whole goes below persistent + this.
        self.max_op_working_set_bytes = {
            d["device"]: d.get("max_op_working_set_bytes", 0) for d in devices}
        self.recompute = data.get("recompute", {})
        self.swap = data.get("swap", {})
        self.schedule = data.get("schedule", {})
        self.order_guard = data.get("order_guard", {})
        self.onednn_merges = data.get("onednn_merges", {})
        self.loop_pacing = data.get("loop_pacing", {})
        self.arrival_order_sums = data.get("arrival_order_sums", [])
        self.split = data.get("split", {})
        # Per while-loop: frame, backward, trip_count (+ trip_count_source),
        # parallel_iterations, left_alone (why nothing of it moved) and lists: the
        # TensorLists it fills ({list, item, capacity, capacity_source, bytes,
        # swapped, copy_seconds, left_alone}).
        self.loops = data.get("loops", [])
        self.stage_seconds = data["stage_seconds"]
        self.total_seconds = data["total_seconds"]
        # Where the allocator tells its peak: the first steps of this graph as run
        # by tfmemopt.function or the Keras callback, {device: bytes}; else None.
        from tfmemopt import feedback

        self.measured_peak_bytes = feedback.measured_peak(self.graph_id)

    @property
    def measured_peak_error(self):
        """{device: predicted / measured - 1} where a peak was measured, else None."""
        if not self.measured_peak_bytes:
            return None
        after = self.predicted_peak_bytes["after"]
        return {d: after[d] / m - 1 for d, m in self.measured_peak_bytes.items()
                if m and after.get(d)}

    @property
    def recomputed_ops(self):
        """Names of the ops recomputed in the graph the pass returned.

        Empty after a fallback, which returns the original graph; what was planned
        stays in ``recompute["nodes"]``.
        """
        return list(self.recompute.get("nodes", [])) if self.graph_changed else []

    @property
    def swapped_tensors(self):
        """Names of the tensors swapped to host memory and back in the returned graph.

        Empty after a fallback; what was planned stays in ``swap["tensors"]``.
        """
        return list(self.swap.get("tensors", [])) if self.graph_changed else []

    @property
    def scheduling_edges(self):
        """Control edges the scheduling stage added to the returned graph, as
        (waited-for node, waiting node) name pairs. Empty after a fallback."""
        if not self.graph_changed:
            return []
        return [tuple(edge) for edge in self.schedule.get("edges", [])]

    @property
    def split_ops(self):
        """Names of the ops the returned graph runs as micro-batches (slices of the
        batch), each as `split["slices"]` copies. Empty after a fallback."""
        if not self.graph_changed or not self.split.get("applied"):
            return []
        return list(self.split.get("ops", []))

    @property
    def estimated_split_overhead(self):
        """Predicted time the split adds, as a fraction of the step's compute."""
        step = self.recompute.get("step_seconds", 0)
        if not step or not self.split.get("applied"):
            return 0.0
        return self.split.get("added_seconds", 0) / step

    @property
    def estimated_recompute_overhead(self):
        """Predicted compute the recomputation adds, as a fraction of the step's."""
        step = self.recompute.get("step_seconds", 0)
        return self.recompute.get("added_seconds", 0) / step if step else 0.0

    @property
    def fits(self):
        """True/False when every device has a known budget, else None. False also when
        the allocator model ran out of memory (a device's allocator_refused_bytes)."""
        if not self.devices or any(b <= 0 for b in self.budget_bytes.values()):
            return None
        after = self.predicted_peak_bytes["after"]
        refused = any(d.get("allocator_refused_bytes") for d in self._data["devices"])
        return not refused and all(after[d] <= self.budget_bytes[d] for d in self.devices)

    def to_dict(self):
        data = json.loads(json.dumps(self._data))
        if self.measured_peak_bytes:
            data["measured_peak_bytes"] = dict(self.measured_peak_bytes)
        return data

    def _unresolved_hint(self):
        """What a user can do about tensors of unknown size."""
        if self._data.get("assume_batch_size"):
            # The batch is given: what is left is not the inputs' batch dimension (a
            # loop's plumbing, a shape only the running graph knows).
            return (f"assume_batch_size={self._data['assume_batch_size']} is set, so these "
                    "are tensors of unknown rank, which TF's shape inference does not give")
        return "set assume_batch_size to resolve the batch dimension"

    def _variants_note(self):
        """Variants of unknown size: nothing the user sets changes them."""
        return (f"{self.unresolved_variants} lists or optionals of unknown contents, counted "
                "as empty (such as a gradient loop's sums of TensorLists or an iterator's "
                "optional); assume_batch_size does not change them")

    def to_text(self):
        lines = [f"TfMemOpt report for graph {self.graph_id} ({self.mode})"]
        if self.status != "ok":
            lines.append(
                f"  FALLBACK: stage '{self.failed_stage}' failed: {self.message}; "
                "the original graph was used"
            )
        never_run = self._data.get("never_run_nodes", 0)
        lines.append(f"  {self.num_nodes} nodes, {self.num_tensors} tensors"
                     + (f" ({never_run} nodes never run: no fetch needs them; left as they are)"
                        if never_run else ""))
        for d in self._data["devices"]:
            name = d["device"] or "(unplaced)"
            budget = format_bytes(d["budget_bytes"]) if d["budget_bytes"] else "unknown"
            before = format_bytes(d["peak_before_bytes"])
            if d.get("allocator_refused_before_bytes"):
                # The model stopped at the device's memory: the step needs more.
                before = (f"over {before} (without a plan BFC runs out of memory allocating "
                          f"{format_bytes(d['allocator_refused_before_bytes'])})")
            lines.append(
                f"  {name}: predicted peak {before}"
                f" -> {format_bytes(d['peak_after_bytes'])}, budget {budget}"
                f" (device memory {format_bytes(d['memory_bytes'])} from "
                f"{d['memory_source']}"
                + (f", its share of one pool for {d['memory_shared_by']} CPU devices"
                   if d.get("memory_shared_by", 1) > 1 else "")
                + (f", of which {format_bytes(d['held_outside_bytes'])} held outside this"
                   " graph when it was planned" if d.get("held_outside_bytes") else "")
                + (f"; its pool holds one region of {format_bytes(d['allocator_region_bytes'])}"
                   if d.get("allocator") == "bfc" and d.get("allocator_region_bytes") else "")
                + f"), persistent {format_bytes(d['persistent_bytes'])}"
                + (f", live tensors at the peak {format_bytes(d['live_peak_bytes'])}"
                   f" (BFC allocator model{_histories(d)})" if d.get("allocator") == "bfc"
                   else "")
            )
            if d.get("allocator_refused_bytes"):
                why = (" no free chunk of its region is that large (the tensors live there"
                       " leave the free bytes in smaller pieces)"
                       if d.get("allocator_region_bytes") else
                       " no free chunk of its regions is that large (a tensor must fit in one"
                       " region; they start at 2 MiB, double and are never merged)")
                lines.append(
                    f"  {name}: BFC runs out of memory allocating "
                    f"{format_bytes(d['allocator_refused_bytes'])} for {d['allocator_refused']}:"
                    + why + ", although the peak is below the device's memory"
                )
            measured = (self.measured_peak_bytes or {}).get(d["device"])
            if measured:
                lines.append(
                    f"  {name}: measured peak {format_bytes(measured)} "
                    f"({100 * (d['peak_after_bytes'] / measured - 1):+.1f} % predicted)")
        if self.unresolved_tensors:
            examples = ", ".join(self._data["unresolved_examples"])
            lines.append(
                f"  {self.unresolved_tensors} tensors have unknown dimensions, counted as 1"
                f" (e.g. {examples}); {self._unresolved_hint()}"
            )
        if self._data.get("batch_dims_assumed"):
            lines.append(
                f"  {self._data['batch_dims_assumed']} dimensions that shape inference leaves "
                f"unknown (not traced to the inputs' batch) are taken as "
                f"assume_batch_size={self._data['assume_batch_size']}")
        if self.unresolved_variants:
            lines.append(f"  {self._variants_note()}")
        if self._data.get("min_tensor_bytes_adaptive") and 0 <= self.min_tensor_bytes < 2**20:
            lines.append(
                f"  tensors down to {format_bytes(self.min_tensor_bytes)} were considered: "
                "the budget could not be met with tensors of 1 MiB and more alone"
                " (min_tensor_bytes=-1, adaptive)")
        lines.extend(self._schedule_lines())
        lines.extend(self._order_guard_lines())
        lines.extend(self._merge_lines())
        lines.extend(self._arrival_order_lines())
        lines.extend(self._pacing_lines())
        lines.extend(self._split_lines())
        lines.extend(self._recompute_lines())
        lines.extend(self._swap_lines())
        lines.extend(self._loop_lines())
        if self.top_tensors_at_peak:
            lines.append("  largest tensors live at the peak:")
            for t in self.top_tensors_at_peak:
                lines.append(f"    {format_bytes(t.bytes):>10}  {t.name} ({t.op}, {t.role}, {t.device})")
        lines.append(f"  pass time {self.total_seconds * 1000:.1f} ms")
        return "\n".join(lines)

    def _schedule_lines(self):
        sc = self.schedule
        if not sc.get("planned"):
            return []
        peaks = _before_after(sc, "peak")
        backward = _before_after(sc, "backward_peak", changed_only=True)
        lines = [f"  schedule: {sc['num_edges']} control edges added, predicted peak {peaks}"
                 + (f", backward pass's own bytes {backward}" if backward else "")
                 + f", {sc['simulations']} orders simulated"]
        for before, after in sc.get("edges", [])[:5]:
            lines.append(f"    {after} waits for {before}")
        if len(sc.get("edges", [])) > 5:
            lines.append("    ...")
        return lines

    def _pacing_lines(self):
        edges = self.loop_pacing.get("edges", [])
        if not edges:
            return []
        why = ""
        if self.loop_pacing.get("unplanned"):
            why = (" (nothing else planned: the graph fits, but iterations run ahead could "
                   "exceed the budget)" if self.fits else
                   " (nothing else planned, and the budget is not met: iterations run ahead "
                   "would take the peak further over it)")
        return [f"  loops: {len(edges)} ops wait for the carried value they are combined with "
                f"({self.loop_pacing['values']} values), so that their results do not pile up "
                f"iterations ahead{why}"]

    def _merge_lines(self):
        merges = self.onednn_merges
        if merges.get("kept", True):
            return []
        return [f"  oneDNN merges: the plan fits only with order edges that keep some of "
                f"{merges['pairs']} mergeable pairs (e.g. Conv2DBackpropFilter + BiasAddGrad) "
                f"apart, so their gradients sum in another order than without tfmemopt"]

    def _arrival_order_lines(self):
        sums = self.arrival_order_sums
        if not sums:
            return []
        shown = ", ".join(f"{s['name']} ({s['terms']} terms)" for s in sums[:3])
        shown += ", ..." if len(sums) > 3 else ""
        return [f"  arrival-order sums: {len(sums)} ({shown}): TF adds their terms in the "
                f"order they finish, so their last bits follow the execution order, with or "
                f"without tfmemopt (tfmemopt.set_tf_memory_optimization('NO_MEM_OPT') keeps "
                f"the AddNs TF's memory optimizer rewrites whole, added in a fixed order)"]

    def _order_guard_lines(self):
        og = self.order_guard
        if not og.get("edges") and og.get("complete", True):
            return []
        worst = _before_after(og, "worst_peak")
        what = ("the graph's own order (it needs no plan: it meets the budget in that "
                "order, not in every order TF's executor may pick)"
                if og.get("unplanned") else "the planned order")
        line = (f"  order: {len(og['edges'])} control edges pin {what} "
                f"(peak in the worst order TF's executor may pick {worst})")
        if og.get("deferred"):
            line += (f"; {og['deferred']} of them make ops that need no gradient wait "
                     f"for their reader's other input instead of running at the start "
                     f"(peak in that eager start {_before_after(og, 'eager_start_peak')})")
        if not og.get("complete", True):
            line += "; not every order could be pinned, the worst is the predicted peak"
        return [line]

    def _recompute_lines(self):
        rc = self.recompute
        if not rc.get("planned"):
            return []
        lines = [f"  recompute ({rc['policy']}): {len(rc['nodes'])} ops recomputed, "
                 f"+{100 * self.estimated_recompute_overhead:.1f}% predicted compute, "
                 f"{rc['num_triggers']} triggers, {rc['simulations']} plans simulated"]
        if rc.get("search") == "exact":
            lines[-1] += f" (exact search over {rc['exact_candidates']} candidates)"
        if rc["nodes"]:
            shown = ", ".join(rc["nodes"][:5]) + (", ..." if len(rc["nodes"]) > 5 else "")
            lines.append(f"    recomputed: {shown}")
        if rc.get("checkpoints"):
            lines.append(f"    checkpoints kept: {len(rc['checkpoints'])}")
        if not rc.get("feasible", True):
            ways = (["swapping"] if self.swap.get("planned") else []) + ["recomputation"]
            ways += ["splitting"] if self.split.get("planned") else []
            means = ", ".join(ways[:-1]) + " and " + ways[-1] if len(ways) > 1 else ways[0]
            reached = ", ".join(f"{d} {format_bytes(b)}" for d, b in
                                sorted(self.predicted_peak_bytes["after"].items()))
            lines.append(f"    the budget cannot be met by {means}; the plan applied "
                         f"reaches the smallest peak found ({reached})")
        if rc.get("left_alone"):
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(rc["left_alone"].items()))
            lines.append(f"    forward ops never recomputed: {why}")
        if rc.get("note"):
            lines.append(f"    {rc['note']}")
        if rc.get("hinted_but_not_recomputable"):
            lines.append("    hinted but not recomputable: "
                         + ", ".join(rc["hinted_but_not_recomputable"][:5]))
        return lines

    def _split_lines(self):
        sp = self.split
        if not sp.get("planned"):
            return []
        # Gradients of batch statistics (a mean over the batch spread back over it)
        # end the regions unless no other split fits and split_batch_statistics
        # (on by default) allows passing through them.
        statistics = sp.get("left_alone", {}).get("batch_statistics", 0)
        statistics_line = (
            [f"    {statistics} op{'' if statistics == 1 else 's'} spreading a gradient of "
             "batch statistics over the batch left whole (split through them only when no "
             "other split fits, and split_batch_statistics is not False: "
             "docs/split.md#batch-statistics)"] if statistics else [])
        if not sp.get("applied"):
            return ([f"  split: nothing split ({sp.get('note') or 'no split helps'})"]
                    + statistics_line)
        rows = sp.get("rows", [])
        sizes = (f"{rows[0]} rows" if len(set(rows)) == 1 else
                 f"{min(rows)}-{max(rows)} rows") if rows else ""
        step = self.recompute.get("step_seconds", 0)
        cost = (f", +{100 * sp['added_seconds'] / step:.1f}% predicted time" if step else
                f", {sp['added_seconds'] * 1000:.1f} ms predicted")
        lines = [f"  split: {len(sp['ops'])} ops run as {sp['slices']} micro-batches of "
                 f"{sizes} (batch {sp['batch']}, {sp['stages']} stage"
                 f"{'' if sp['stages'] == 1 else 's'}){cost}; {sp['cuts']} inputs cut, "
                 f"{sp['joins']} outputs joined, {sp['sums']} weight gradients summed over "
                 "the slices"]
        types = ", ".join(f"{n} {op}" for op, n in sorted(sp.get("op_types", {}).items()))
        lines.append(f"    split ops: {types}")
        if sp.get("through_batch_statistics"):
            lines.append("    through batch statistics: the gradients of the layers below a "
                         "split normalization are summed in another order (up to about 1e-3 "
                         "relative in float32; docs/split.md#batch-statistics); "
                         "split_batch_statistics=False forbids it")
        tried = ", ".join(
            f"{t['slices']}: {format_bytes(max(t['peak_bytes'] or [0]))}"
            + (" through batch statistics" if t.get("through_batch_statistics") else "")
            + ("" if t["fits"] else " (does not fit)") for t in sp.get("trials", []))
        lines.append(f"    slices tried (predicted peak): {tried}")
        if sp.get("note"):
            lines.append(f"    {sp['note']}")
        return lines + statistics_line

    def _swap_lines(self):
        sw = self.swap
        if not sw.get("tensors"):
            return []
        shown = ", ".join(sw["tensors"][:5]) + (", ..." if len(sw["tensors"]) > 5 else "")
        return [f"  swap: {sw['num_swap_out']} swap-out and {sw['num_swap_in']} swap-in ops, "
                f"{format_bytes(sw['bytes_to_host'])} to host (at most "
                f"{format_bytes(sw['host_peak_bytes'])} at once), predicted copy time "
                f"{sw['copy_seconds'] * 1000:.1f} ms",
                f"    swapped: {shown}"]

    def _loop_lines(self):
        lines = []
        for loop in self.loops:
            trips = (f"{loop['trip_count']} iterations ({loop['trip_count_source']})"
                     if loop["trip_count"] >= 0 else "trip count unknown")
            moved = [li for li in loop["lists"] if li["swapped"]]
            kind = "gradient loop" if loop["backward"] else "loop"
            line = f"  {kind} {loop['frame']}: {trips}"
            if moved:
                total = sum(li["bytes"] for li in moved)
                copy = sum(li["copy_seconds"] for li in moved)
                line += (f"; {len(moved)} of {len(loop['lists'])} lists to host memory as they "
                         f"fill ({format_bytes(total)}, predicted copy time {copy * 1000:.1f} ms)")
            else:
                line += f"; left alone: {loop['left_alone']}"
            lines.append(line)
        return lines

    def figure(self, title=None):
        """The memory timeline as a matplotlib Figure: live bytes at each step of the
        simulated schedule, stacked by role, one subplot per device, with the budget
        and the predicted peak (annotated with the 3 largest tensors live there).

        title: a name for the graph, shown before its id in subplot titles. Needs
        matplotlib: pip install 'tfmemopt[plot]'.
        """
        figure_class, canvas_class = _matplotlib()
        import numpy as np  # a dependency of matplotlib, so present when it is

        title = f"{title} (graph {self.graph_id})" if title else f"graph {self.graph_id}"
        devices = self._data["devices"]
        timelines = {t["device"]: t for t in self._data.get("timeline", [])}
        rows = max(1, len(devices))
        fig = figure_class(figsize=(10, 5 if rows == 1 else 4 * rows), dpi=100,
                           layout="constrained")
        canvas_class(fig)
        axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
        if not devices:
            axes[0].set_axis_off()
            axes[0].set_title(f"{title}: no memory timeline", fontsize=10)
            why = (f"stage '{self.failed_stage}' failed: {self.message}"
                   if self.status != "ok" else "the pass found no tensors to place")
            axes[0].text(0.5, 0.5, why, ha="center", va="center", wrap=True)
            return fig
        for ax, device in zip(axes, devices):
            self._plot_device(ax, device, timelines.get(device["device"]), title, np)
        return fig

    def _plot_device(self, ax, device, timeline, title, np):
        name = device["device"] or "(unplaced)"
        peak, budget = device["peak_after_bytes"], device["budget_bytes"]
        heading = f"{title} on {name}: predicted peak {format_bytes(peak)}"
        if device["peak_before_bytes"] != peak:
            heading += f" (before the plan {format_bytes(device['peak_before_bytes'])})"
        if budget and peak > budget:
            heading += f", {format_bytes(peak - budget)} over budget"
        ax.set_title(heading, fontsize=10)
        if not timeline or not timeline["activation_bytes"]:
            ax.text(0.5, 0.5, "no timeline for this device", ha="center", va="center",
                    transform=ax.transAxes)
            return
        steps = len(timeline["activation_bytes"])
        layers = [
            np.full(steps, timeline["persistent_bytes"], dtype=float),
            np.asarray(timeline["activation_bytes"], dtype=float),
            np.asarray(timeline["gradient_bytes"], dtype=float),
        ]
        styles = [dict(label=label, color=color) for label, color in _SERIES]
        if timeline.get("host_bytes") is not None:
            # Stacked on top of device memory, hatched: the part of the step's data
            # that a swap keeps off the device, so the chart shows what the device
            # would hold without it.
            layers.append(np.asarray(timeline["host_bytes"], dtype=float))
            styles.append(dict(label=_HOST_SERIES[0] + " (off device)", facecolor="none",
                               edgecolor=_HOST_SERIES[1], hatch="///"))
        tops = np.cumsum(layers, axis=0)
        data_top = max(float(tops[-1].max()), float(peak), 1.0)  # BFC peak may be higher
        # The original graph's timeline, as an outline, when the pass changed it.
        before = {t["device"]: t for t in self._data.get("timeline_before", [])}.get(
            device["device"])
        before_total = None
        if self.graph_changed and before and before["activation_bytes"]:
            before_total = (before["persistent_bytes"]
                            + np.asarray(before["activation_bytes"], dtype=float)
                            + np.asarray(before["gradient_bytes"], dtype=float))
            data_top = max(data_top, float(before_total.max()))
        # A budget far above the data would flatten the chart: past 2.5x the peak it
        # is named in the legend instead of drawn.
        budget_drawn = 0 < budget <= 2.5 * data_top
        # Headroom above the data for the peak annotation box.
        y_top = max(data_top, budget if budget_drawn else 0) * 1.35
        unit, size = _axis_unit(y_top)
        x = np.arange(steps)
        bottom = np.zeros(steps)
        for top, style in zip(tops, styles):
            ax.fill_between(x, bottom / size, top / size, step="mid", linewidth=0, **style)
            bottom = top
        if before_total is not None:
            ax.plot(np.arange(len(before_total)), before_total / size, color="0.25",
                    linewidth=0.9, drawstyle="steps-mid", label="before tfmemopt")
        if budget_drawn:
            ax.axhline(budget / size, color="crimson", linestyle="--", linewidth=1.2,
                       label=f"budget {format_bytes(budget)}")
        elif budget > 0:
            ax.plot([], [], color="crimson", linestyle="--",
                    label=f"budget {format_bytes(budget)} (above the chart)")
        peak_step = device["peak_step"]
        # Under a BFC allocator the predicted peak counts whole chunks, so it sits
        # above the live tensors; the marker stays on the curve and a dotted line
        # shows what the allocator is predicted to hold.
        live = device.get("live_peak_bytes", peak) or peak
        ax.plot([peak_step], [live / size], marker="o", markersize=7, color="crimson",
                markeredgecolor="white", linestyle="none", label="peak of live tensors")
        if device.get("allocator") == "bfc" and peak > live:
            ax.axhline(peak / size, color="0.3", linestyle=":", linewidth=1.2,
                       label=f"predicted BFC peak {format_bytes(peak)}")
        tensors = sorted(device["top_tensors_at_peak"], key=lambda t: (-t["bytes"], t["name"]))
        headline = f"peak {format_bytes(peak)} at step {peak_step}"
        if live != peak:
            headline += f" (live tensors {format_bytes(live)})"
        lines = [headline] + [
            f"{format_bytes(t['bytes']):>10}  {_short_name(t['name'])} ({t['role']})"
            for t in tensors[:3]
        ]
        # The box goes to the side away from the peak so it does not hide it.
        left = peak_step > steps / 2
        ax.annotate("\n".join(lines), xy=(peak_step, live / size),
                    xytext=(0.01 if left else 0.99, 0.97), textcoords="axes fraction",
                    ha="left" if left else "right", va="top", fontsize=8, family="monospace",
                    bbox=dict(boxstyle="round,pad=0.4", facecolor="white", edgecolor="0.7",
                              alpha=0.9),
                    arrowprops=dict(arrowstyle="->", color="crimson", linewidth=1))
        ax.set_xlim(-0.5, steps - 0.5)
        ax.set_ylim(0, y_top / size)
        ax.set_xlabel("schedule step (nodes in the simulated order)")
        ax.set_ylabel(f"live memory ({unit})")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4,
                  fontsize=8, frameon=False)

    def _png(self, title=None):
        buffer = io.BytesIO()
        self.figure(title).savefig(buffer, format="png")
        return buffer.getvalue()

    def plot(self, path, title=None):
        """Writes the memory timeline chart (see figure()) to `path` as a PNG and
        returns `path`. Needs matplotlib: pip install 'tfmemopt[plot]'."""
        png = self._png(title)
        with open(path, "wb") as f:
            f.write(png)
        return path

    def to_html(self, path, title=None):
        """Writes one standalone HTML page: the summary per device, the timeline
        chart (embedded) and the tensors live at the peak. Returns `path`. Needs
        matplotlib: pip install 'tfmemopt[plot]'."""
        chart = base64.b64encode(self._png(title)).decode("ascii")
        esc = lambda value: html.escape(str(value), quote=True)  # noqa: E731
        heading = f"{title} (graph {self.graph_id})" if title else f"graph {self.graph_id}"
        fits = {True: "yes", False: "no", None: "unknown (no budget)"}[self.fits]
        devices = self._data["devices"]
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>tfmemopt memory report: {esc(heading)}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:70em}"
            "table{border-collapse:collapse;margin:1em 0}"
            "th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}"
            "td.num{text-align:right;font-variant-numeric:tabular-nums}"
            "img{max-width:100%}.fallback{color:#b00}</style></head><body>",
            f"<h1>tfmemopt memory report: {esc(heading)}</h1>",
            f"<p>graph <code>{esc(self.graph_id)}</code>, status <b>{esc(self.status)}</b>, "
            f"mode {esc(self.mode)}, {self.num_nodes} nodes, {self.num_tensors} tensors; "
            f"fits the budget: <b>{fits}</b></p>",
        ]
        if self.status != "ok":
            parts.append(
                f'<p class="fallback">stage {esc(self.failed_stage)} failed: '
                f"{esc(self.message)}; the original graph was used</p>")
        if self.unresolved_tensors:
            parts.append(
                f"<p>{self.unresolved_tensors} tensors have unknown dimensions, counted as 1 "
                f"(e.g. {esc(', '.join(self._data.get('unresolved_examples', [])))}); "
                f"{esc(self._unresolved_hint())}</p>")
        if self.unresolved_variants:
            parts.append(f"<p>{esc(self._variants_note())}</p>")
        parts.append(
            "<table><thead><tr><th>device</th><th>predicted peak</th><th>before the plan"
            "</th><th>budget</th><th>persistent</th><th>fits</th></tr></thead><tbody>")
        for d in devices:
            budget = d["budget_bytes"]
            device_fits = "unknown" if not budget else (
                "yes" if d["peak_after_bytes"] <= budget else "no")
            parts.append(
                f'<tr class="device"><td>{esc(d["device"] or "(unplaced)")}</td>'
                f'<td class="num">{format_bytes(d["peak_after_bytes"])}</td>'
                f'<td class="num">{format_bytes(d["peak_before_bytes"])}</td>'
                f'<td class="num">{format_bytes(budget) if budget else "unknown"}</td>'
                f'<td class="num">{format_bytes(d["persistent_bytes"])}</td>'
                f"<td>{device_fits}</td></tr>")
        parts.append("</tbody></table>")
        parts.append(f'<img alt="memory timeline of {esc(heading)}" '
                     f'src="data:image/png;base64,{chart}">')
        parts.append(
            "<h2>Tensors live at the peak</h2><table><thead><tr><th>name</th><th>op</th>"
            "<th>role</th><th>device</th><th>bytes</th></tr></thead><tbody>")
        for d in devices:
            for t in sorted(d["top_tensors_at_peak"], key=lambda t: (-t["bytes"], t["name"])):
                parts.append(
                    f'<tr class="tensor"><td><code>{esc(t["name"])}</code></td>'
                    f'<td>{esc(t["op"])}</td><td>{esc(t["role"])}</td>'
                    f'<td>{esc(d["device"] or "(unplaced)")}</td>'
                    f'<td class="num" title="{t["bytes"]} bytes">{format_bytes(t["bytes"])}'
                    "</td></tr>")
        parts.append("</tbody></table></body></html>")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(parts) + "\n")
        return path

    def __repr__(self):
        peaks = ", ".join(
            f"{d or 'unplaced'}={format_bytes(b)}"
            for d, b in self.predicted_peak_bytes["after"].items()
        )
        return f"<tfmemopt.Report {self.graph_id} {self.status} peak {peaks}>"
