"""Report.figure(), plot() and to_html() on the report of a real CNN train step."""

import base64
import copy
import re
import struct
import sys

import pytest

import tfmemopt
from tfmemopt.demo import seed_cnn_train_step
from tfmemopt.report import Report, format_bytes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIB = 2**20


@pytest.fixture(scope="module")
def cnn_data():
    """The report dict of the seed CNN's train step at batch 64."""
    step, x, y = seed_cnn_train_step(64)
    return tfmemopt.analyze(step, x, y).to_dict()


@pytest.fixture
def cnn(cnn_data):
    return Report(copy.deepcopy(cnn_data))


def with_changes(data, budget=None, host=False, **top):
    data = copy.deepcopy(data)
    data.update(top)
    if budget is not None:
        data["devices"][0]["budget_bytes"] = budget
    if host:
        timeline = data["timeline"][0]
        timeline["host_bytes"] = [MIB] * len(timeline["activation_bytes"])
    return Report(data)


def png_size(data):
    """(width, height) from the IHDR chunk, which a PNG must start with."""
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def legend_labels(ax):
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_plot_writes_a_png_of_the_timeline(cnn, tmp_path):
    path = tmp_path / "timeline.png"
    assert cnn.plot(path) == path
    data = path.read_bytes()
    width, height = png_size(data)
    assert (width, height) == (1000, 500)  # 10 x 5 in at 100 dpi
    assert len(data) > 10_000


def test_chart_stacks_the_roles_and_marks_the_peak(cnn):
    device = cnn.to_dict()["devices"][0]
    peak = device["peak_after_bytes"]
    fig = cnn.figure()
    (ax,) = fig.axes
    assert cnn.graph_id in ax.get_title()
    assert f"predicted peak {format_bytes(peak)}" in ax.get_title()
    assert ax.get_ylabel() == "live memory (MiB)"
    labels = legend_labels(ax)
    assert labels[:3] == ["weights and optimizer state", "activations", "gradients"]
    assert not any("host" in label for label in labels)
    (marker,) = [line for line in ax.get_lines() if line.get_label() == "peak of live tensors"]
    assert list(marker.get_xdata()) == [device["peak_step"]]
    # Without a BFC allocator to model, the predicted peak is the live-tensor peak.
    assert device["allocator"] == "none" and device["live_peak_bytes"] == peak
    assert list(marker.get_ydata()) == pytest.approx([peak / MIB])
    # The stack's top at the peak step is the peak: persistent + activations + gradients.
    timeline = cnn.to_dict()["timeline"][0]
    step = device["peak_step"]
    assert (timeline["persistent_bytes"] + timeline["activation_bytes"][step]
            + timeline["gradient_bytes"][step]) == peak
    (note,) = ax.texts
    largest = sorted(device["top_tensors_at_peak"], key=lambda t: (-t["bytes"], t["name"]))[:3]
    assert note.get_text().splitlines()[0] == f"peak {format_bytes(peak)} at step {step}"
    for tensor, line in zip(largest, note.get_text().splitlines()[1:]):
        assert format_bytes(tensor["bytes"]) in line
        assert "/".join(tensor["name"].split("/")[-2:]) in line
    assert len(note.get_text().splitlines()) == 1 + len(largest)


def test_budget_near_the_peak_is_drawn_and_a_far_one_is_named(cnn_data):
    peak = cnn_data["devices"][0]["peak_after_bytes"]
    near = with_changes(cnn_data, budget=peak + peak // 5)
    (ax,) = near.figure().axes
    (line,) = [line for line in ax.get_lines() if line.get_label().startswith("budget")]
    assert list(line.get_ydata()) == pytest.approx([(peak + peak // 5) / MIB] * 2)
    assert ax.get_ylim()[1] > (peak + peak // 5) / MIB

    far = with_changes(cnn_data, budget=100 * peak)
    (ax,) = far.figure().axes
    assert f"budget {format_bytes(100 * peak)} (above the chart)" in legend_labels(ax)
    assert peak / MIB < ax.get_ylim()[1] < 100 * peak / MIB

    unknown = with_changes(cnn_data, budget=0)
    (ax,) = unknown.figure().axes
    assert not any(label.startswith("budget") for label in legend_labels(ax))


def test_over_budget_is_in_the_title(cnn_data):
    peak = cnn_data["devices"][0]["peak_after_bytes"]
    (ax,) = with_changes(cnn_data, budget=peak - 2 * MIB).figure().axes
    assert "2.00 MiB over budget" in ax.get_title()


def test_host_series_only_when_the_timeline_has_host_bytes(cnn_data):
    (ax,) = with_changes(cnn_data, host=True).figure().axes
    assert "swapped to host (off device)" in legend_labels(ax)


def test_one_subplot_per_device(cnn_data, tmp_path):
    data = copy.deepcopy(cnn_data)
    second = copy.deepcopy(data["devices"][0])
    second["device"] = "GPU:0"
    second["peak_after_bytes"] = second["peak_before_bytes"] = 3 * MIB
    data["devices"].append(second)
    timeline = copy.deepcopy(data["timeline"][0])
    timeline["device"] = "GPU:0"
    data["timeline"].append(timeline)
    report = Report(data)
    titles = [ax.get_title() for ax in report.figure(title="two devices").axes]
    assert len(titles) == 2
    assert f"two devices (graph {report.graph_id}) on CPU:0" in titles[0]
    assert "on GPU:0: predicted peak 3.00 MiB" in titles[1]
    width, height = png_size(report.plot(tmp_path / "two.png").read_bytes())
    assert (width, height) == (1000, 800)


def test_a_fallback_report_plots_why_there_is_no_timeline(tmp_path):
    step, x, y = seed_cnn_train_step(8)
    report = tfmemopt.analyze(step, x, y, test_only_fail_stage="simulate")
    assert report.status == "fallback"
    (ax,) = report.figure().axes
    assert "no memory timeline" in ax.get_title()
    assert "stage 'simulate' failed" in ax.texts[0].get_text()
    assert png_size(report.plot(tmp_path / "fallback.png").read_bytes()) == (1000, 500)


def test_without_matplotlib_the_error_says_how_to_install(cnn, tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for write in (cnn.plot, cnn.to_html):
        with pytest.raises(ImportError, match=re.escape("pip install 'tfmemopt[plot]'")):
            write(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_html_has_the_summary_the_chart_and_a_row_per_peak_tensor(cnn, tmp_path):
    path = tmp_path / "report.html"
    assert cnn.to_html(path) == path
    text = path.read_text(encoding="utf-8")
    device = cnn.to_dict()["devices"][0]
    assert text.startswith("<!DOCTYPE html>")
    assert f"<code>{cnn.graph_id}</code>" in text and "status <b>ok</b>" in text
    summary = re.search(r'<tr class="device">(.*?)</tr>', text).group(1)
    assert format_bytes(device["peak_after_bytes"]) in summary
    assert format_bytes(device["budget_bytes"]) in summary
    assert summary.endswith("<td>yes</td>")
    assert "fits the budget: <b>yes</b>" in text

    (chart,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    png = base64.b64decode(chart)
    assert png_size(png) == (1000, 500) and len(png) > 10_000

    rows = re.findall(r'<tr class="tensor">(.*?)</tr>', text)
    assert len(rows) == len(device["top_tensors_at_peak"]) > 3
    by_name = {re.search(r"<code>(.*?)</code>", row).group(1): row for row in rows}
    for tensor in device["top_tensors_at_peak"]:
        row = by_name[tensor["name"]]
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells[1:4] == [tensor["op"], tensor["role"], "CPU:0"]
        assert cells[4] == format_bytes(tensor["bytes"])
        assert f'title="{tensor["bytes"]} bytes"' in row


def test_html_escapes_names(cnn_data, tmp_path):
    data = copy.deepcopy(cnn_data)
    data["graph_id"] = "train<step>"
    data["devices"][0]["top_tensors_at_peak"][0]["name"] = 'scope/<script>alert("x")</script>&y'
    data["devices"][0]["top_tensors_at_peak"][1]["op"] = "My<Op>"
    text = Report(data).to_html(tmp_path / "escaped.html").read_text(encoding="utf-8")
    assert "<script>" not in text and "<step>" not in text and "My<Op>" not in text
    assert "scope/&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;y" in text
    assert "<code>train&lt;step&gt;</code>" in text and "My&lt;Op&gt;" in text
    assert len(re.findall(r'<tr class="tensor">', text)) == len(
        data["devices"][0]["top_tensors_at_peak"])


def test_html_over_budget_says_it_does_not_fit(cnn_data, tmp_path):
    peak = cnn_data["devices"][0]["peak_after_bytes"]
    report = with_changes(cnn_data, budget=peak // 2)
    text = report.to_html(tmp_path / "over.html").read_text(encoding="utf-8")
    assert report.fits is False
    assert "fits the budget: <b>no</b>" in text
    assert re.search(r'<tr class="device">.*<td>no</td></tr>', text)


def _paced_unplanned(peak_after):
    return Report({
        "graph_id": "g", "status": "ok", "failed_stage": "", "message": "", "mode": "AUTO",
        "num_nodes": 1, "num_tensors": 1, "unresolved_tensors": 0, "graph_changed": True,
        "stage_seconds": {}, "total_seconds": 0.0,
        "loop_pacing": {"edges": [["a", "b"]], "values": 1, "unplanned": True},
        "devices": [{"device": "CPU:0", "budget_bytes": 100, "persistent_bytes": 0,
                     "memory_bytes": 1000, "memory_source": "cluster",
                     "peak_before_bytes": peak_after, "peak_after_bytes": peak_after,
                     "top_tensors_at_peak": []}]})


def test_the_pacing_line_says_the_graph_fits_only_when_it_does():
    assert "the graph fits, but iterations" in _paced_unplanned(90).to_text()
    text = _paced_unplanned(150).to_text()
    assert "the graph fits" not in text and "the budget is not met" in text
