"""The runtime feedback loop: measured peaks next to predictions, and re-planning when a
planned step runs out of memory anyway.

The pass predicts a step's peak before the step runs. Where the device's allocator can
tell its peak (TF's BFC allocator: every GPU, and the CPU test bed with
TF_CPU_ALLOCATOR_USE_BFC=true), the first steps of a planned graph are measured
(`tf.config.experimental.get_memory_info`) and recorded against the prediction:
`Report.measured_peak_bytes`, with one log line when the prediction is off by more
than 5 %.

When a planned step runs out of memory, the budget it was planned under was too high
for what TF really allocated. `Retrier` (used by tfmemopt.function and the Keras
callback) puts back every variable the failed attempt may have updated, lowers the
budget by the allocation that failed (or by 5 % when TF does not say), re-plans by
re-instantiating the function under the lower budget, and retries the same step with
the same inputs: the step's results are those of a run that never ran out of memory.
Variables are snapshot to host memory only for the first `guard_steps` calls after
each (re)plan, where an out-of-memory error is to be expected (BFC's regions settle in
the first steps). Past them, a step that runs out of memory may have updated some
variables already, so it is not retried: the lower budget is kept for the next plan
and the error is raised with a line saying so.

A guarded step that succeeds but whose own measured peak exceeds the budget its plan
met on paper is a warning of such an error: `Calibrator` re-plans it under the budget
less the measured error, and undoes that when the re-plan does not lower the
measured peak.
"""

import re
import threading

import numpy as np
import tensorflow as tf

from tfmemopt.report import format_bytes

_lock = threading.Lock()
_measured = {}  # graph_id -> {device: peak bytes}
ERROR_TO_LOG = 0.05
_OOM = re.compile(r"OOM when allocating tensor with shape\[([0-9, ]*)\] and type (\w+)"
                  r"(?: on (\S+))?")
DEFAULT_STEP = 0.05  # of the budget, when TF does not say what it could not allocate
# A step's own peak this far over its budget is not worth a re-plan (a new trace, more
# guarded steps): the budget's default headroom (0.9 of the device) covers it.
CALIBRATION_TOLERANCE = 0.01

# The calls guarded after each (re)plan: the steps the pass's allocator model replays
# to find the peak (SimulationOptions in simulate/liveness_simulator.h: 2 warm-up
# steps while BFC's regions grow, then 5 measured ones, over which the peak still
# moves as variable copies land in other chunks). An out-of-memory error is to be
# expected until then: the bidirectional LSTM of benchmarks/bilstm_fit.py, fit under
# enable() at batch 128 (256 MiB), ran out of memory in its third step, past two guarded
# ones, in 2 of 11 processes, and in its first two (retried, trained) in 4 more.
DEFAULT_GUARD_STEPS = 7


def measured_peak(graph_id):
    """{device: bytes} recorded for graph `graph_id`, or None."""
    with _lock:
        peaks = _measured.get(graph_id)
        return dict(peaks) if peaks else None


def record_measured_peak(report, peaks):
    """Records measured peaks {device: bytes} for `report`'s graph and logs one line
    per device whose prediction is off by more than 5 %."""
    if not peaks:
        return
    with _lock:
        _measured[report.graph_id] = dict(peaks)
    predicted = report.predicted_peak_bytes["after"]
    for device, measured in peaks.items():
        want = predicted.get(device)
        if not want or not measured:
            continue
        error = want / measured - 1
        if abs(error) > ERROR_TO_LOG:
            tf.get_logger().info(
                "tfmemopt: graph %s on %s: measured peak %.1f MiB, predicted %.1f MiB "
                "(%+.1f %%)", report.graph_id, device, measured / 2**20, want / 2**20,
                100 * error)


def memory_devices(devices):
    """Of the short device names `devices` ('CPU:0', 'GPU:0'), those whose allocator
    reports its peak (get_memory_info works), as {name: tf device string}."""
    if not devices:
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name.split("device:")[-1] for d in gpus] or ["CPU:0"]
    out = {}
    for name in devices:
        try:
            tf.config.experimental.get_memory_info(name)
        except (ValueError, tf.errors.OpError):
            continue
        out[name] = name
    return out


def reset_peaks(devices):
    for name in devices:
        tf.config.experimental.reset_memory_stats(name)


def read_peaks(devices):
    return {name: tf.config.experimental.get_memory_info(name)["peak"] for name in devices}


def read_in_use(devices):
    return {name: tf.config.experimental.get_memory_info(name)["current"] for name in devices}


def missing_bytes(error):
    """(bytes of the allocation that failed, its device) from an out-of-memory error, or
    (None, None) when its message does not say."""
    match = _OOM.search(str(error))
    if not match:
        return None, None
    dims = [int(d) for d in match.group(1).replace(" ", "").split(",") if d]
    try:
        size = tf.as_dtype(match.group(2)).size
    except TypeError:
        return None, None
    device = match.group(3)
    if device:
        device = device.rsplit("device:", 1)[-1]
    return int(np.prod(dims, dtype=np.int64)) * size, device


def lowered_budget(budget, predicted, missing, peak_at_failure=None):
    """The next budget after an out-of-memory error, in bytes.

    It starts from the lowest of the budget the plan was made under, the peak the plan
    predicted, and what the allocator proved it cannot hold (the bytes in use when it
    failed, `peak_at_failure`, plus the allocation it could not make), and goes below
    that by what TF could not allocate, and by at least 5 %.
    """
    bounds = [b for b in (budget, predicted) if b]
    if peak_at_failure and missing:
        bounds.append(peak_at_failure + missing)
    if not bounds:
        return None
    start = min(bounds)
    # A plan that ran out of memory was too close to the device's limit: the next one
    # keeps at least 5 % free, so that run-to-run changes in TF's order fit too.
    return max(1, int(start - max(missing or 0, int(DEFAULT_STEP * start))))


def next_budget(report, error, peaks):
    """What an out-of-memory error of the step planned in `report` says about the next
    plan: a dict with graph_id, device, budget_bytes, predicted_peak_bytes,
    missing_bytes, in_use_at_failure and new_budget_bytes (None when nothing is known
    to plan from). `peaks`: {device: bytes in use when the step failed}."""
    missing, device = missing_bytes(error)
    if device not in report.budget_bytes:
        device = max(report.budget_bytes, key=lambda d: report.budget_bytes[d], default=None)
    budget = report.budget_bytes.get(device) or None
    predicted = report.predicted_peak_bytes["after"].get(device) or None
    in_use = peaks.get(device)
    # The next budget is in bytes, the step's own; what the allocator held outside the
    # step when it was planned (counted for a budget_fraction) is not the step's.
    if in_use is not None:
        in_use = max(1, in_use - report.held_outside_bytes.get(device, 0))
    return {"graph_id": report.graph_id, "device": device, "budget_bytes": budget,
            "predicted_peak_bytes": predicted, "missing_bytes": missing,
            "in_use_at_failure": in_use,
            "new_budget_bytes": lowered_budget(budget, predicted, missing, in_use)}


def mib(n):
    """`n` bytes in MiB for a log line (below 0.1 MiB, where one decimal of MiB would
    read 0.0, as the report writes sizes); "unknown" for None or 0."""
    if not n:
        return "unknown"
    return f"{n / 2**20:.1f} MiB" if n >= 0.1 * 2**20 else format_bytes(int(n))


def ran_out_of_memory(record):
    """The head of every line about an out-of-memory error (next_budget's record):
    "graph G ran out of memory on D (could not allocate N MiB)"."""
    missing = record["missing_bytes"]
    return (f"graph {record['graph_id']} ran out of memory on {record['device']} ("
            + (f"could not allocate {mib(missing)}" if missing else
               "allocation size not given") + ")")


def log_retry(what, record, retry, retries):
    """One WARNING line for a re-plan; `retry` is its number, or None when the step is
    not retried (past the guarded steps)."""
    then = (f"retrying {what} (retry {retry} of {retries})" if retry is not None else
            f"not retrying {what}: past the first steps after a plan, variables may "
            f"be partly updated; the next plan uses this budget")
    tf.get_logger().warning(
        "tfmemopt: %s; re-planning under a budget of %s (was %s, predicted peak %s), %s",
        ran_out_of_memory(record), mib(record["new_budget_bytes"]),
        mib(record["budget_bytes"]), mib(record["predicted_peak_bytes"]), then)


def _missed_budget(record):
    predicted, budget = record["predicted_peak_bytes"], record["budget_bytes"]
    return bool(predicted and budget and predicted > budget)


def log_not_replanned(what, record):
    """One WARNING line for an out-of-memory error that no re-plan can help."""
    tf.get_logger().warning(
        "tfmemopt: %s; not retrying %s: its plan could not meet its budget (smallest "
        "peak reachable %s, budget %s), and a lower budget cannot lower it. Lower the "
        "batch size, or see docs/usage.md#when-a-plan-runs-out-of-memory.",
        ran_out_of_memory(record), what, mib(record["predicted_peak_bytes"]),
        mib(record["budget_bytes"]))


def replan(what, report, error, peaks, retries_done, retries, retrying=True):
    """The budget to plan under after `error`, logged; re-raises `error` when nothing
    is known to plan from, or when the plan had already missed its budget (a lower one
    gives the same plan). A retried step's record goes into `retries_done`."""
    record = next_budget(report, error, peaks)
    if not _replannable(record):
        if record["new_budget_bytes"] is not None:
            log_not_replanned(what, record)
        raise error
    if retrying:
        retries_done.append(record)
    log_retry(what, record, len(retries_done) if retrying else None, retries)
    return record["new_budget_bytes"]


def _replannable(record):
    # When the planner already went as low as it could and missed the budget, the
    # smallest peak it reached does not depend on the budget: a re-plan under a lower
    # one gives the same plan and runs out of memory again.
    return record["new_budget_bytes"] is not None and not _missed_budget(record)


# The graph as TF built it is tried after the plans failed only where it may train:
# its predicted peak within this factor of the device's memory. The memory model
# over-predicts an unplanned step by up to 15 % on the models measured
# (docs/accuracy.md); beyond that, the attempt would only run out of memory again.
ORIGINAL_GRAPH_REACH = 1.25


def after_failed_attempt(what, report, error, peaks, retries_done, retries):
    """What to do after a guarded attempt of a step that the pass planned ran out of
    memory (the wrapper has put its variables back): "replan" with the budget to plan
    under, or "original": run the step as TF built it, without the pass's changes.
    Raises `error` when neither can help.

    Re-plans under lower budgets come first, up to `retries` of them. When they are
    used up, or no lower budget can change the plan (it had already missed its
    budget), a graph the pass changed is run once as TF built it, unless its
    predicted peak is far over the device's memory (ORIGINAL_GRAPH_REACH): a step that
    trains without tfmemopt then trains with it. With `retries` 0 nothing is tried
    again. Each decision is logged."""
    if retries <= 0:
        raise error
    record = next_budget(report, error, peaks)
    if len(retries_done) < retries and _replannable(record):
        retries_done.append(record)
        log_retry(what, record, len(retries_done), retries)
        return "replan", record["new_budget_bytes"]
    if original_graph_may_train(report, record["device"]):
        tf.get_logger().warning(
            "tfmemopt: %s %s; running %s as TF built it, without tfmemopt's changes "
            "(predicted peak %s, device memory %s): where that trains, tfmemopt leaves "
            "this graph as it is", ran_out_of_memory(record),
            (f"after {len(retries_done)} re-plan(s)" if len(retries_done) >= retries
             else "with a plan that could not meet its budget"), what,
            mib(report.predicted_peak_bytes["before"].get(record["device"])),
            mib(_memory_bytes(report, record["device"])))
        return "original", None
    if record["new_budget_bytes"] is not None and _missed_budget(record):
        log_not_replanned(what, record)
    raise error


def original_graph_may_train(report, device):
    """Whether the graph as TF built it may train where `report`'s plan ran out of
    memory on `device`: the pass changed it, and its predicted peak is within
    ORIGINAL_GRAPH_REACH of the device's memory (or either is unknown)."""
    if report is None or not report.graph_changed:
        return False  # the same graph: it would run out of memory the same way
    before = report.predicted_peak_bytes["before"].get(device)
    memory = _memory_bytes(report, device)
    return not (before and memory and before > ORIGINAL_GRAPH_REACH * memory)


def log_original_failed(what, report, error):
    """One WARNING line when the graph as TF built it ran out of memory too."""
    record = next_budget(report, error, {})
    tf.get_logger().warning(
        "tfmemopt: %s as TF built it too, as it would without tfmemopt; not retrying "
        "%s. Lower the batch size, or see docs/usage.md#when-a-plan-runs-out-of-memory.",
        ran_out_of_memory(record), what)


def _memory_bytes(report, device):
    return report.memory_bytes.get(device) or None


def step_own_peak(report, device, peak, in_use_before):
    """Of a measured peak, the step's own: less what the allocator held before the step
    beyond the graph's persistent buffers (other models, a dataset, eager tensors, the
    step's inputs), which no plan of this step can lower."""
    outside = max(0, in_use_before - report.persistent_bytes.get(device, 0))
    return max(0, peak - outside)


def planned_report(graph_id):
    """The pass's last report of graph `graph_id` when it planned the graph (status
    ok, changed or left as it was because it predicted that it fits), else None."""
    import tfmemopt

    mine = [r for r in tfmemopt.reports() if r.graph_id == graph_id]
    return mine[-1] if mine and mine[-1].status == "ok" else None


def report_count():
    """How many reports the pass has made in this process: a call after which it grew
    planned a graph (TF traced or re-instantiated the function during the call)."""
    from tfmemopt import _ext

    return _ext.num_reports()


class Calibrator:
    """Re-plans a step whose measured peak went over the budget its plan said it met.

    Such a plan fits on paper only (the executor ran ops in another order than the
    model, the allocator fragmented, the batch was not the one assumed), and the next
    step that peaks a little higher runs out of memory, past the guarded steps, where
    it cannot be retried. So when a guarded step's own peak (step_own_peak) exceeds the
    budget (by more than CALIBRATION_TOLERANCE), the steps after it are planned under
    the budget less the measured error, and never below the budget scaled by
    predicted / measured (an error that grows with the step, such as a batch larger
    than assumed, would otherwise take the budget to nothing). If that plan does not
    lower the measured peak by at least half of what it predicted to save, the error
    is memory the plan cannot act on (a shape the model does not know, a kernel's
    scratch): the budget before the calibration comes back, on a fresh trace, and no
    more calibrations are made. At most `limit` calibrations; each is logged, and
    listed in `done` (an undone one with "reverted": True).

    Only calls that planned nothing are judged: the call that traces or
    re-instantiates a function also runs Grappler, whose constant folding allocates on
    the CPU, and, on a GPU, autotunes kernels with scratch memory. A calibration is
    judged by the next such call of the same graph with the same input shapes (`key`).
    """

    def __init__(self, limit):
        self.limit = limit
        self.done = []  # one dict per calibration, as next_budget's, with measured_step_bytes
        self._pending = None  # the calibration whose first measurement is awaited
        self._stopped = False

    def after_step(self, what, report, peaks, in_use_before, key=None, planned=False):
        """After a guarded step that succeeded: None, or {"budget_bytes": the budget
        (bytes, the step's own) to re-plan the step under, "retrace": whether to trace
        the step afresh for it}. `peaks`, `in_use_before`: {device: bytes} measured
        around the step; `key`: what identifies the step's graph and input shapes;
        `planned`: whether a graph was planned during the step (see the class)."""
        if planned:
            return None
        pending = self._pending
        if pending is not None:
            if pending["graph_id"] != report.graph_id or pending["key"] != key:
                return None  # another graph or batch shape: wait for the calibrated one
            verdict = self._verdict(pending, report, peaks, in_use_before)
            if verdict is None:
                return None
            self._pending = None
            if verdict == "undo":
                # The budget that plan had, in bytes, with a fresh trace: under a config
                # TF has instantiated before, the step would run the old instantiation
                # while the latest report would be the calibrated plan's.
                return {"budget_bytes": pending["budget_bytes"], "retrace": True}
        if self._stopped or len(self.done) >= self.limit:
            return None
        over = self._overshoot(report, peaks, in_use_before)
        if over is None:
            return None
        over["key"] = key
        self.done.append(over)
        self._pending = over
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        tf.get_logger().warning(
            "tfmemopt: graph %s on %s measured %s of its own, over the budget of %s its "
            "plan met on paper (predicted peak %s); re-planning %s under %s "
            "(calibration %d of %d)", over["graph_id"], over["device"],
            mib(over["measured_step_bytes"]), mib(over["budget_bytes"]),
            mib(over["predicted_peak_bytes"]), what, mib(over["new_budget_bytes"]),
            len(self.done), self.limit)
        return {"budget_bytes": over["new_budget_bytes"], "retrace": False}

    def replanned(self):
        """The step was re-planned for another reason (an out-of-memory retry): the
        next measurement is not the calibrated plan's."""
        self._pending = None

    @staticmethod
    def _overshoot(report, peaks, in_use_before):
        """The calibration record of the device most over its budget, or None."""
        worst, worst_excess = None, 0
        # One budget in bytes is given to every device: never more than the least of
        # theirs, so that no device is planned above its own.
        least = min((b for b in report.budget_bytes.values() if b), default=None)
        for device, peak in peaks.items():
            budget = report.budget_bytes.get(device)
            predicted = report.predicted_peak_bytes["after"].get(device)
            if not budget or not predicted or predicted > budget:
                continue  # no budget, or the plan did not claim to meet it
            own = step_own_peak(report, device, peak, in_use_before.get(device, 0))
            if own <= budget * (1 + CALIBRATION_TOLERANCE):
                continue
            new = max(budget - (own - predicted), int(budget * predicted / own))
            record = {"graph_id": report.graph_id, "device": device,
                      "budget_bytes": min(budget, least), "predicted_peak_bytes": predicted,
                      "measured_step_bytes": own, "new_budget_bytes": min(new, least)}
            # Over its own budget, not the least one the record carries.
            if own - budget > worst_excess:
                worst, worst_excess = record, own - budget
        return worst

    def _verdict(self, pending, report, peaks, in_use_before):
        """"keep" or "undo" for the calibration `pending`, judged by this step; None
        when this step does not tell."""
        device = pending["device"]
        predicted = report.predicted_peak_bytes["after"].get(device)
        if device not in peaks or not predicted:
            return None
        own = step_own_peak(report, device, peaks[device], in_use_before.get(device, 0))
        saved_on_paper = pending["predicted_peak_bytes"] - predicted
        saved = pending["measured_step_bytes"] - own
        pending["measured_after_bytes"] = own
        if saved_on_paper > 0 and saved >= saved_on_paper / 2:
            return "keep"
        self._stopped = pending["reverted"] = True
        tf.get_logger().warning(
            "tfmemopt: graph %s on %s: the plan under the calibrated budget saved %.1f MiB "
            "on paper but %.1f MiB measured (%.1f MiB of its own now); the budget of "
            "before the calibration (%.1f MiB) comes back, and calibrations stop: the "
            "model's error here is memory the plan cannot act on", report.graph_id, device,
            saved_on_paper / 2**20, saved / 2**20, own / 2**20, pending["budget_bytes"] / 2**20)
        return "undo"


class VariableSnapshot:
    """Host copies of variables, to put back what a failed step may have updated."""

    def __init__(self, variables):
        seen, self._pairs = set(), []
        for var in variables:
            if id(var) in seen:
                continue
            seen.add(id(var))
            self._pairs.append((var, np.array(var.numpy(), copy=True)))

    def restore(self):
        for var, value in self._pairs:
            var.assign(value)

    def not_covered(self, variables):
        """The variables of `variables` this snapshot does not hold (created since),
        each once."""
        held = {id(var) for var, _ in self._pairs}
        missing = {}
        for var in variables:
            if id(var) not in held:
                missing.setdefault(id(var), var)
        return list(missing.values())

    def __len__(self):
        return len(self._pairs)
