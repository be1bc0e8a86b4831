"""tfmemopt.pytest_plugin: a test suite run with tfmemopt on.

`python -m pytest -p tfmemopt.pytest_plugin --tfmemopt-budget 1` enables the pass for
the whole session; the suite's tests must pass as they do without it, and the
session ends with what the pass did (graphs planned and changed, fall-backs, and the
test whose graph fell back). Each case runs pytest in a fresh process on a suite
written here, or on a test module of the installed Keras package (third-party tests
the pass was not written for).
"""

import json
import os
import re
import subprocess
import sys

import keras
import pytest

from tfmemopt.pytest_plugin import parse_budget, parse_fields

# A user's suite: a tf.function training step checked against the same step run
# eagerly (no Grappler, so no tfmemopt), and a Keras fit whose losses must repeat
# exactly from the same seed. Large enough that a one-byte budget makes the pass
# rewrite the step.
SUITE = '''
import numpy as np
import tensorflow as tf


def _step_and_data():
    rng = np.random.default_rng(0)
    ws = [tf.Variable(rng.standard_normal((256, 256), dtype=np.float32) * 0.08)
          for _ in range(6)]
    x = tf.constant(rng.standard_normal((1024, 256), dtype=np.float32))

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in ws:
                h = tf.nn.relu(h @ w)
            loss = tf.reduce_sum(h * h) / 1024.0
        grads = tape.gradient(loss, ws)
        for w, g in zip(ws, grads):
            w.assign_sub(0.01 * g)
        return loss

    return step, ws, x


def test_graph_step_equals_eager_step():
    step, ws, x = _step_and_data()
    start = [w.numpy() for w in ws]
    graph_losses = [tf.function(step)(x).numpy() for _ in range(2)]
    graph_weights = [w.numpy() for w in ws]
    for w, v in zip(ws, start):
        w.assign(v)
    eager_losses = [step(x).numpy() for _ in range(2)]
    np.testing.assert_allclose(graph_losses, eager_losses, rtol=1e-5)
    for w, v in zip(ws, graph_weights):
        np.testing.assert_allclose(w.numpy(), v, rtol=1e-4, atol=1e-6)


def _fit_losses():
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((64,))]
                                + [tf.keras.layers.Dense(128, activation="relu")
                                   for _ in range(4)] + [tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 64)).astype("float32")
    y = rng.standard_normal((512, 1)).astype("float32")
    return model.fit(x, y, batch_size=256, epochs=2, verbose=0, shuffle=False).history["loss"]


def test_fit_repeats_itself():
    assert _fit_losses() == _fit_losses()
'''


def run_suite(tmp_path, *options, files=None, cwd=None):
    """pytest in a fresh process on SUITE (or `files`); returns the finished process."""
    if files is None:
        (tmp_path / "test_user_suite.py").write_text(SUITE)
        files = [str(tmp_path / "test_user_suite.py")]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "tfmemopt.pytest_plugin", *options, *files]
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    return subprocess.run(command, capture_output=True, text=True, timeout=900,
                          cwd=cwd or tmp_path, env=env)


def outcomes(stdout):
    """{'passed': N, 'skipped': N, ...} from pytest's last line."""
    last = stdout.strip().splitlines()[-1]
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?)", last)}


def summary_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_suite_passes_with_every_rewrite_a_one_byte_budget_forces(tmp_path):
    summary = tmp_path / "summary.jsonl"
    proc = run_suite(tmp_path, "--tfmemopt-budget=1", f"--tfmemopt-summary={summary}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout
    assert "= tfmemopt =" in proc.stdout.replace("==", "=")
    (record,) = summary_records(summary)
    assert record["process"] == "total"
    assert record["graphs"] >= 2  # the tf.function step and fit's train function
    assert record["changed"] >= 1
    assert record["swapped_tensors"] + record["recomputed_ops"] > 0
    assert record["fallbacks"] == 0, record["fallback_messages"]
    line = next(l for l in proc.stdout.splitlines() if "graphs planned" in l)
    assert line.startswith(f"{record['graphs']} graphs planned, {record['changed']} changed")
    assert line.endswith("0 fell back to the original graph")


def test_fields_reach_the_pass(tmp_path):
    summary = tmp_path / "summary.jsonl"
    proc = run_suite(tmp_path, "--tfmemopt-budget=1", "--tfmemopt-field=enable_swap=false",
                     "--tfmemopt-field=enable_split=false", f"--tfmemopt-summary={summary}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = summary_records(summary)
    assert record["swapped_tensors"] == 0
    assert record["recomputed_ops"] > 0


def test_workers_summaries_add_up(tmp_path):
    summary = tmp_path / "summary.jsonl"
    proc = run_suite(tmp_path, "-n", "2", "--tfmemopt-budget=1",
                     f"--tfmemopt-summary={summary}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = summary_records(summary)
    workers = [r for r in records if r["process"] == "worker"]
    (total,) = [r for r in records if r["process"] == "total"]
    assert len(workers) == 2
    for key in ("graphs", "changed", "swapped_tensors", "recomputed_ops", "fallbacks"):
        assert total[key] == sum(w[key] for w in workers), key
    assert total["graphs"] >= 2


@pytest.mark.parametrize("option, named", [
    ("--tfmemopt-field=no_such_field=1", "no_such_field"),
    ("--tfmemopt-field=enable_swap", "enable_swap"),
    ("--tfmemopt-budget=-3", "-3"),
])
def test_a_bad_option_stops_the_session_naming_it(tmp_path, option, named):
    proc = run_suite(tmp_path, option)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # usage error
    assert named in proc.stderr
    assert "passed" not in proc.stdout


def test_command_line_values():
    assert parse_budget("1") == 1
    assert parse_budget("0.5") == 0.5
    assert parse_budget("512MiB") == "512MiB"
    assert parse_budget(None) is None
    assert parse_fields(["enable_swap=false", "min_tensor_bytes=0",
                         'exclude_scopes=["a/", "b/"]', "mode=MANUAL"]) == {
        "enable_swap": False, "min_tensor_bytes": 0, "exclude_scopes": ["a/", "b/"],
        "mode": "MANUAL"}


# Third-party tests: a module of Keras's own suite, shipped in its wheel. It builds
# and fits small models through Keras's own test harness; with the pass on and a
# budget no graph meets, every test that passes without tfmemopt must still pass.
KERAS_SRC = os.path.join(os.path.dirname(keras.__file__), "src")
KERAS_MODULES = ["layers/core/dense_test.py", "models/sequential_test.py"]


@pytest.mark.skipif(not all(os.path.exists(os.path.join(KERAS_SRC, m)) for m in KERAS_MODULES),
                    reason="this Keras wheel does not ship its tests")
def test_keras_own_tests_pass_with_the_pass_on(tmp_path):
    site = os.path.dirname(os.path.dirname(KERAS_SRC))
    files = [os.path.join("keras", "src", m) for m in KERAS_MODULES]
    summary = tmp_path / "summary.jsonl"
    plain = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        capture_output=True, text=True, timeout=900, cwd=site,
        env=dict(os.environ, KERAS_BACKEND="tensorflow"))
    with_pass = run_suite(tmp_path, "--tfmemopt-budget=1", f"--tfmemopt-summary={summary}",
                          files=files, cwd=site)
    assert plain.returncode == 0, plain.stdout[-3000:]
    assert with_pass.returncode == 0, with_pass.stdout[-3000:]
    assert outcomes(with_pass.stdout) == outcomes(plain.stdout)
    assert outcomes(plain.stdout)["passed"] > 0
    (record,) = summary_records(summary)
    assert record["graphs"] > 0 and record["changed"] > 0
    assert record["fallbacks"] == 0, record["fallback_messages"]
