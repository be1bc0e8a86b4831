"""`tfmemopt analyze PATH`: a SavedModel, MetaGraphDef or GraphDef in, the pass's
report out (text, JSON, PNG, HTML); bad input exits 2 with one line saying why."""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from conftest import BATCH, CLASSES, FEATURES, HIDDEN, build_v1_mlp_train_op, tfmemopt_cli

VARIABLE_BYTES = (FEATURES * HIDDEN + HIDDEN * CLASSES) * 4
W1_BYTES = FEATURES * HIDDEN * 4
EXPECTED = "expected a SavedModel directory or a GraphDef/MetaGraphDef .pb file"


class MlpTrainer(tf.Module):
    """A TF2 training step as people export it: variables, a GradientTape loss and
    in-place SGD updates, behind a signature."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.w1 = tf.Variable(rng.standard_normal((FEATURES, HIDDEN), dtype=np.float32) * 0.05)
        self.w2 = tf.Variable(rng.standard_normal((HIDDEN, CLASSES), dtype=np.float32) * 0.05)

    @tf.function(input_signature=[tf.TensorSpec([BATCH, FEATURES], tf.float32),
                                  tf.TensorSpec([BATCH], tf.int32)])
    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            logits = tf.matmul(tf.nn.relu(tf.matmul(x, self.w1)), self.w2)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, [self.w1, self.w2])
        for variable, grad in zip([self.w1, self.w2], grads):
            variable.assign_sub(0.1 * grad)
        return {"loss": loss}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "mlp_train_step"
    module = MlpTrainer()
    tf.saved_model.save(module, str(path), signatures={"train_step": module.train_step})
    return path


@pytest.fixture(scope="module")
def v1_files(tmp_path_factory):
    """A v1 train graph as a MetaGraphDef (minimize() put its op in the train_op
    collection) and as a bare GraphDef; and the train op's name."""
    directory = tmp_path_factory.mktemp("v1")
    graph = tf.Graph()
    with graph.as_default():
        _, _, train_op = build_v1_mlp_train_op()
        assert graph.get_collection("train_op") == [train_op]
        meta = directory / "train.meta.pb"
        tf.compat.v1.train.export_meta_graph(str(meta), as_text=False, graph=graph)
    graph_def = directory / "train.graph.pb"
    graph_def.write_bytes(graph.as_graph_def().SerializeToString())
    return meta, graph_def, train_op.name


@pytest.fixture(scope="module")
def saved_model_run(saved_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    result = tfmemopt_cli("analyze", saved_model, "--budget", "64MiB", "--json",
                          "--plot", out / "timeline.png", "--html", out / "report.html")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result, out


def json_report(result):
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_analyze_help():
    result = tfmemopt_cli("analyze", "--help")
    assert result.returncode == 0
    for option in ("PATH", "--budget", "--fetch", "--json", "--plot", "--html",
                   "--assume-batch-size", "SavedModel"):
        assert option in result.stdout


def test_saved_model_report_covers_the_function_body(saved_model_run, saved_model):
    result, _ = saved_model_run
    lines = result.stdout.strip().splitlines()
    assert lines[0] == (f"tfmemopt analyze: {saved_model} (SavedModel, meta graph tagged "
                        "serve); fetching StatefulPartitionedCall:0 (from signature train_step)")
    assert lines[1].startswith("TfMemOpt report for graph")
    data = json_report(result)  # the last line
    assert data["status"] == "ok"
    assert data["unresolved_tensors"] == 0  # save/restore placeholders were not analyzed
    (device,) = data["devices"]
    assert device["device"] == "CPU:0" and device["budget_bytes"] == 64 * 2**20
    # Grappler inlined the signature's StatefulPartitionedCall: the train step's
    # gradient of w1 is live at the peak (its scaled copy for the update reuses
    # its buffer in place, as TF's Mul kernel does).
    tensors = {t["name"]: t for t in device["top_tensors_at_peak"]}
    grad = tensors["StatefulPartitionedCall/StatefulPartitionedCall/gradient_tape/MatMul/MatMul"]
    assert (grad["bytes"], grad["role"]) == (W1_BYTES, "gradient")
    assert device["peak_after_bytes"] >= 2 * W1_BYTES


def test_saved_model_persistent_bytes_are_the_variables(saved_model_run):
    # After Grappler inlines the signature's call, the variables' readers see the
    # handles only through Identity nodes; VarHandleOp's dtype/shape still size them.
    (device,) = json_report(saved_model_run[0])["devices"]
    assert VARIABLE_BYTES <= device["persistent_bytes"] <= VARIABLE_BYTES + 4096
    assert device["peak_after_bytes"] >= VARIABLE_BYTES + W1_BYTES


def test_saved_model_plot_and_html_files(saved_model_run):
    result, out = saved_model_run
    png, page = out / "timeline.png", out / "report.html"
    assert f"wrote plot {png}" in result.stdout and f"wrote html {page}" in result.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    text = page.read_text(encoding="utf-8")
    assert "data:image/png;base64," in text
    assert "mlp_train_step (graph graph_to_optimize)" in text
    assert len(re.findall(r'<tr class="tensor">', text)) == len(
        json_report(result)["devices"][0]["top_tensors_at_peak"])


def test_v1_metagraph_and_graphdef_give_the_same_report(v1_files):
    meta, graph_def, train_op = v1_files
    from_meta = tfmemopt_cli("analyze", meta, "--json")
    assert from_meta.returncode == 0, from_meta.stderr[-3000:]
    assert f"fetching {train_op} (from collection train_op)" in from_meta.stdout
    from_graph = tfmemopt_cli("analyze", graph_def, "--fetch", train_op, "--json")
    assert from_graph.returncode == 0, from_graph.stderr[-3000:]
    assert f"fetching {train_op} (from --fetch)" in from_graph.stdout
    (a,), (b,) = json_report(from_meta)["devices"], json_report(from_graph)["devices"]
    assert VARIABLE_BYTES <= a["persistent_bytes"] <= VARIABLE_BYTES + 4096
    assert a["peak_after_bytes"] >= VARIABLE_BYTES + W1_BYTES  # weights + w1's gradient
    for key in ("persistent_bytes", "peak_after_bytes", "peak_step"):
        assert a[key] == b[key]


def bad_inputs(saved_model, v1_files, tmp_path):
    """{case: (args, the whole stderr line as a regex)}."""
    missing = tmp_path / "no_such_model"
    notes = tmp_path / "notes.txt"
    notes.write_text("a text file, not a graph\n")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    graph_def = v1_files[1]
    return {
        "missing path": (
            [missing], re.escape(f"{missing}: no such file or directory; {EXPECTED}")),
        "not a graph": (
            [notes], re.escape(f"{notes} is not a GraphDef, MetaGraphDef or SavedModel "
                               "(a binary protobuf with graph nodes expected)")),
        "directory without saved_model.pb": (
            [empty_dir], re.escape(f"{empty_dir} is a directory without saved_model.pb, "
                                   f"so not a SavedModel; {EXPECTED}")),
        "no train op or fetch": (
            [graph_def], re.escape(f"{graph_def} has no train op or fetch; pass --fetch NODE")),
        "fetch of no node": (
            [saved_model, "--fetch", "StatefulPartitionedCal:0"],
            re.escape(f"{saved_model}: fetch 'StatefulPartitionedCal:0' from --fetch names "
                      "no node of the graph (did you mean 'StatefulPartitionedCall'") + ".*"),
        "bad budget": (
            [saved_model, "--budget", "2XB"],
            re.escape("--budget 2XB: budget='2XB' is not a size; allowed: ") + ".*GiB.*"),
        "budget fraction above 1": (
            [saved_model, "--budget", "1.5"],
            re.escape("--budget 1.5: budget=1.5 is a float, i.e. a fraction of device "
                      "memory, and must be in (0, 1]") + ".*"),
    }


@pytest.mark.parametrize("case", [
    "missing path", "not a graph", "directory without saved_model.pb", "no train op or fetch",
    "fetch of no node", "bad budget", "budget fraction above 1"])
def test_bad_input_exits_2_with_one_line_saying_what_was_expected(
        case, saved_model, v1_files, tmp_path):
    args, expected = bad_inputs(saved_model, v1_files, tmp_path)[case]
    result = tfmemopt_cli("analyze", *args)
    assert result.returncode == 2, result.stdout + result.stderr[-2000:]
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("tfmemopt")]
    assert len(ours) == 1 and ours[0] == result.stderr.strip().splitlines()[-1]
    assert re.fullmatch("tfmemopt analyze: " + expected, ours[0]), ours[0]


def test_plot_without_matplotlib_exits_2_saying_how_to_install(saved_model, tmp_path):
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked here')\n")
    path = os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))
    result = tfmemopt_cli("analyze", saved_model, "--plot", tmp_path / "t.png",
                          env={"PYTHONPATH": path})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tfmemopt analyze: --plot needs matplotlib: pip install 'tfmemopt[plot]'")
    assert not (tmp_path / "t.png").exists()
