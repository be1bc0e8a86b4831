"""Every rejected input, with its exact message: docs/troubleshooting.md's table "Rejected inputs"
is the specification, and this test runs each of its rows.

A row is `| interface | input | exit | message |`:
  * python: `input` is a call evaluated with `tfmemopt`, `tf` and a few example objects
    in scope (see NAMESPACE); it must raise, and `Type: message` must be the message;
  * parameter_map: `input` is a dict of AttrValues, set as the TfMemOpt entry's
    parameter_map and parsed as the pass's Init() does (the message Grappler raises);
  * cli: `input` is a command line run in a directory holding the files of
    `cli_files()` (`[no matplotlib] ` before it: as if matplotlib were not
    installed); its exit code and the last line of its stderr must match.

A second test reads the package's sources: every `raise` of a rejected input must
have a row whose message contains its fixed text, so the table cannot miss a case.
"""

import ast
import contextlib
import io
import os
import re
import shlex

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import rewriter_config_pb2, saved_model_pb2

import tfmemopt
from tfmemopt import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "docs", "troubleshooting.md")
START, END = "<!-- rejected-inputs:start -->", "<!-- rejected-inputs:end -->"


def readme_rows():
    text = open(TABLE, encoding="utf-8").read()
    table = text[text.index(START) + len(START):text.index(END)]
    rows = []
    for line in table.strip().splitlines()[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, line
        interface, source, code, message = cells
        rows.append((interface, unquote(source), code, unquote(message)))
    return rows


def unquote(cell):
    assert cell.startswith("`") and cell.endswith("`"), cell
    return cell[1:-1].replace("\\|", "|")


def quote(text):
    return "`" + text.replace("|", "\\|") + "`"


# ---------------------------------------------------------------------------------
# Running one row

def namespace():
    tf.keras.utils.set_random_seed(0)
    compiled = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    compiled.compile(optimizer="sgd", loss="mse")
    uncompiled = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])

    @tf.function
    def step(x):
        return x * 2.0

    return {"tfmemopt": tfmemopt, "tf": tf, "np": np, "AttrValue": attr_value_pb2.AttrValue,
            "compiled_model": compiled, "uncompiled_model": uncompiled, "step": step,
            "x": np.zeros((2, 4), np.float32)}


def run_python_row(source, names):
    try:
        eval(source, dict(names))  # noqa: S307 (the table's own examples)
    except Exception as err:  # noqa: BLE001 (any rejection is what we look at)
        return "", f"{type(err).__name__}: {err}"
    return "", "(accepted)"


def run_parameter_map_row(source, names):
    entry = rewriter_config_pb2.RewriterConfig.CustomGraphOptimizer(name=tfmemopt.PASS_NAME)
    for key, value in eval(source, dict(names)).items():  # noqa: S307
        entry.parameter_map[key].CopyFrom(value)
    return "", tfmemopt.config._ext.check_custom_optimizer(entry.SerializeToString()) or "(accepted)"


def cli_files(directory):
    """The files the CLI rows name."""
    (directory / "empty.pb").write_bytes(b"")
    (directory / "garbage.pb").write_bytes(b"this is not a protobuf")
    (directory / "emptydir").mkdir()
    (directory / "no_graph").mkdir()
    (directory / "no_graph" / "saved_model.pb").write_bytes(
        saved_model_pb2.SavedModel(saved_model_schema_version=1).SerializeToString())
    graph = tf.Graph()
    with graph.as_default():
        tf.identity(tf.constant(1.0, name="x"), name="node")
    (directory / "graph.pb").write_bytes(graph.as_graph_def().SerializeToString())
    (directory / "step.py").write_text("def make_step(size):\n    return lambda: None\n")
    (directory / "benchmarks").mkdir()
    (directory / "benchmarks" / "toy.py").write_text('"""A toy benchmark."""\n')


NO_MATPLOTLIB = "[no matplotlib] "


@contextlib.contextmanager
def hidden(modules):
    """Makes `import` of these modules fail, as where they are not installed."""
    import sys

    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update({name: None for name in modules})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def run_cli_row(source, directory):
    modules = []
    if source.startswith(NO_MATPLOTLIB):
        source = source[len(NO_MATPLOTLIB):]
        modules = ["matplotlib", "matplotlib.figure", "matplotlib.backends",
                   "matplotlib.backends.backend_agg"]
    argv = shlex.split(source)
    assert argv[0] == "tfmemopt"
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                hidden(modules):
            try:
                code = cli.main(argv[1:])
            except SystemExit as exit_:
                code = exit_.code
    finally:
        os.chdir(cwd)
    lines = err.getvalue().strip().splitlines()
    return str(code), lines[-1] if lines else ""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli")
    cli_files(directory)
    names = namespace()
    out = []
    for interface, source, code, message in readme_rows():
        if interface == "python":
            got = run_python_row(source, names)
        elif interface == "parameter_map":
            got = run_parameter_map_row(source, names)
        else:
            assert interface == "cli", interface
            got = run_cli_row(source, directory)
        out.append(((interface, source, code, message), got))
    tfmemopt.disable()
    return out


def test_every_row_is_rejected_with_its_exact_message(outcomes):
    wrong = []
    for (interface, source, code, message), (got_code, got_message) in outcomes:
        expected_code = "" if code == "—" else code
        if (got_code, got_message) != (expected_code, message):
            wrong.append(f"{interface} {source}:\n  docs: {code} {message}\n  "
                         f"actual: {got_code} {got_message}")
    assert not wrong, "\n".join(wrong)


def test_the_table_covers_the_three_interfaces():
    interfaces = [row[0] for row in readme_rows()]
    assert {"python", "parameter_map", "cli"} == set(interfaces)
    assert interfaces.count("python") >= 20 and interfaces.count("cli") >= 10


# ---------------------------------------------------------------------------------
# Coverage: every raise site of a rejected input has a row

SOURCES = ["config.py", "analysis.py", "cli.py"]
REJECTIONS = {"ValueError", "TypeError", "_InputError"}


def fixed_texts(node):
    """The literal pieces of a message expression (an f-string, a str, or a
    concatenation of them), longest first."""
    pieces = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            pieces.append(sub.value)
    return sorted(pieces, key=len, reverse=True)


def raise_sites():
    sites = []
    for name in SOURCES:
        path = os.path.join(ROOT, "python", "tfmemopt", name)
        tree = ast.parse(open(path, encoding="utf-8").read())
        functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            call = node.exc
            kind = getattr(call.func, "id", None)
            if kind == "bad_type":  # config._set_field's helper
                call = functions["bad_type"].body[0].value
                kind = call.func.id
            if kind not in REJECTIONS or not call.args:
                continue
            sites.append((f"{name}:{node.lineno}", fixed_texts(call.args[0])))
    return sites


def test_every_raise_of_a_rejected_input_has_a_row():
    messages = [row[3] for row in readme_rows()]
    missing = []
    sites = raise_sites()
    assert len(sites) >= 25, sites
    for where, pieces in sites:
        # The longest literal piece of the message, trimmed to words, must appear.
        piece = pieces[0].strip(" ;:,(") if pieces else ""
        piece = re.sub(r"^tfmemopt(\.analyze)?: ", "", piece)
        if len(piece) < 6:
            continue  # nothing distinctive (a message made of values only)
        if not any(piece in m for m in messages):
            missing.append(f"{where}: {piece!r}")
    assert not missing, "raise sites without a row in docs/troubleshooting.md:\n" + "\n".join(missing)


# ---------------------------------------------------------------------------------
# `python tests/test_bad_inputs.py INTERFACE INPUT...` prints rows for docs/troubleshooting.md.

if __name__ == "__main__":
    import sys
    import tempfile
    from pathlib import Path

    interface = sys.argv[1]
    names = namespace()
    with tempfile.TemporaryDirectory() as tmp:
        cli_files(Path(tmp))
        for source in sys.argv[2:]:
            if interface == "python":
                code, message = run_python_row(source, names)
            elif interface == "parameter_map":
                code, message = run_parameter_map_row(source, names)
            else:
                code, message = run_cli_row(source, Path(tmp))
            print(f"| {interface} | {quote(source)} | {code or '—'} | {quote(message)} |")
