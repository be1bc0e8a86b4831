"""Reports of the TfMemOpt pass: one per graph it optimized in this process."""

import collections
import json

PeakTensor = collections.namedtuple("PeakTensor", "name op bytes role device")


def format_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class Report:
    """What the pass found (and did) for one graph.

    Attributes: graph_id, status ('ok' or 'fallback'), failed_stage, message, mode,
    num_nodes, num_tensors, unresolved_tensors, devices (list of device names),
    budget_bytes ({device: bytes}, 0 = unknown), persistent_bytes ({device: bytes}),
    predicted_peak_bytes ({'before': {device: bytes}, 'after': {...}}),
    top_tensors_at_peak (10 largest PeakTensor across devices), fits (bool or None),
    stage_seconds, total_seconds.
    """

    def __init__(self, data):
        self._data = data
        self.graph_id = data["graph_id"]
        self.status = data["status"]
        self.failed_stage = data["failed_stage"]
        self.message = data["message"]
        self.mode = data["mode"]
        self.num_nodes = data["num_nodes"]
        self.num_tensors = data["num_tensors"]
        self.unresolved_tensors = data["unresolved_tensors"]
        self.graph_changed = data["graph_changed"]
        devices = data["devices"]
        self.devices = [d["device"] for d in devices]
        self.budget_bytes = {d["device"]: d["budget_bytes"] for d in devices}
        self.persistent_bytes = {d["device"]: d["persistent_bytes"] for d in devices}
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
        self.stage_seconds = data["stage_seconds"]
        self.total_seconds = data["total_seconds"]

    @property
    def fits(self):
        """True/False when every device has a known budget, else None."""
        if not self.devices or any(b <= 0 for b in self.budget_bytes.values()):
            return None
        after = self.predicted_peak_bytes["after"]
        return all(after[d] <= self.budget_bytes[d] for d in self.devices)

    def to_dict(self):
        return json.loads(json.dumps(self._data))

    def to_text(self):
        lines = [f"TfMemOpt report for graph {self.graph_id} ({self.mode})"]
        if self.status != "ok":
            lines.append(
                f"  FALLBACK: stage '{self.failed_stage}' failed: {self.message}; "
                "the original graph was used"
            )
        lines.append(f"  {self.num_nodes} nodes, {self.num_tensors} tensors")
        for d in self._data["devices"]:
            name = d["device"] or "(unplaced)"
            budget = format_bytes(d["budget_bytes"]) if d["budget_bytes"] else "unknown"
            lines.append(
                f"  {name}: predicted peak {format_bytes(d['peak_before_bytes'])}"
                f" -> {format_bytes(d['peak_after_bytes'])}, budget {budget}"
                f" (device memory {format_bytes(d['memory_bytes'])} from "
                f"{d['memory_source']}), persistent {format_bytes(d['persistent_bytes'])}"
            )
        if self.unresolved_tensors:
            examples = ", ".join(self._data["unresolved_examples"])
            lines.append(
                f"  {self.unresolved_tensors} tensors have unknown dimensions, counted as 1"
                f" (e.g. {examples}); set assume_batch_size to resolve the batch dimension"
            )
        if self.top_tensors_at_peak:
            lines.append("  largest tensors live at the peak:")
            for t in self.top_tensors_at_peak:
                lines.append(f"    {format_bytes(t.bytes):>10}  {t.name} ({t.op}, {t.role}, {t.device})")
        lines.append(f"  pass time {self.total_seconds * 1000:.1f} ms")
        return "\n".join(lines)

    def __repr__(self):
        peaks = ", ".join(
            f"{d or 'unplaced'}={format_bytes(b)}"
            for d, b in self.predicted_peak_bytes["after"].items()
        )
        return f"<tfmemopt.Report {self.graph_id} {self.status} peak {peaks}>"
