"""The Bazel build: `bazel build //:libtfmemopt.so` against the installed TF wheel
gives a library that tf.load_library() loads and whose pass rewrites a Session's
training graph.

The library is loaded in fresh interpreters that do not import tfmemopt: one process
can hold only one registration of the pass. The Bazel output root is
$TFMEMOPT_BAZEL_OUTPUT_ROOT if set (CI keeps it in its temp dir), else Bazel's default
(so that a second run is incremental).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_python, subprocess_result

ROOT = Path(__file__).resolve().parents[1]
BAZEL = shutil.which("bazel")

pytestmark = pytest.mark.skipif(
    BAZEL is None,
    reason="bazel is not on PATH; install it with `apt-get install bazel-bootstrap` "
           "(Debian, works offline; .ci/run does this)")


def bazel(*args, timeout=3600):
    startup = ["--batch"]  # no server left running after the test
    if os.environ.get("TFMEMOPT_BAZEL_OUTPUT_ROOT"):
        startup.append(f"--output_user_root={os.environ['TFMEMOPT_BAZEL_OUTPUT_ROOT']}")
    return subprocess.run(
        [BAZEL, *startup, *args, f"--repo_env=PYTHON_BIN_PATH={sys.executable}"],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def libtfmemopt():
    build = bazel("build", "//:libtfmemopt.so")
    assert build.returncode == 0, build.stderr[-5000:]
    info = bazel("info", "bazel-bin")
    assert info.returncode == 0, info.stderr[-2000:]
    library = Path(info.stdout.strip()) / "libtfmemopt.so"
    assert library.is_file(), build.stderr[-2000:]
    return library


# A 12-layer ReLU MLP (activations 1 MiB each) trained with SGD in a v1 Session,
# without and then with TfMemOpt in the Session's ConfigProto; prints one JSON line.
TRAIN_IN_SESSION = r'''
import json, sys
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.framework import op_def_registry

tf.load_library(sys.argv[1])
assert "tfmemopt" not in sys.modules

def train(with_pass):
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((1024, 256), dtype=np.float32))
        h = x
        for i in range(12):
            with tf.name_scope(f"layer_{i}"):
                w = tf.Variable(rng.standard_normal((256, 256), dtype=np.float32) * 0.08)
                h = tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h))
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    config = config_pb2.ConfigProto()
    if with_pass:
        entry = config.graph_options.rewrite_options.custom_optimizers.add(name="TfMemOpt")
        entry.parameter_map["budget_bytes"].i = int(sys.argv[2])
        entry.parameter_map["enable_swap"].b = False  # recomputation: clones to look for
    run_options = config_pb2.RunOptions(output_partition_graphs=True)
    metadata = config_pb2.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        losses = [float(sess.run([loss, train_op], options=run_options,
                                 run_metadata=metadata)[0]) for _ in range(3)]
    names = [n.name for g in metadata.partition_graphs for n in g.node]
    return losses, [n for n in names if n.startswith("TfMemOpt/Recompute/")]

plain, no_clones = train(False)
losses, clones = train(True)
print("RESULT " + json.dumps({
    "plain": plain, "losses": losses, "no_clones": no_clones, "clones": clones,
    "swap_ops": [op for op in ("TfMemSwapOut", "TfMemSwapIn")
                 if op_def_registry.get(op) is not None]}))
'''


def test_the_library_registers_the_pass_and_its_ops_and_rewrites_a_session_graph(libtfmemopt):
    budget = 14 * 2**20  # the step's predicted peak is about 19 MiB
    process = run_python(TRAIN_IN_SESSION, libtfmemopt, budget)
    assert process.returncode == 0, process.stderr[-5000:]
    result = subprocess_result(process, only=True)
    assert result["swap_ops"] == ["TfMemSwapOut", "TfMemSwapIn"]
    assert result["no_clones"] == []
    assert result["clones"], "the pass recomputed nothing"
    assert all(name.split("/")[2].startswith("layer_") for name in result["clones"])
    assert result["losses"] == result["plain"]  # bitwise
    summaries = [l for l in process.stderr.splitlines() if "TfMemOpt: graph" in l]
    assert any(f"({len(result['clones'])} recomputed" in l for l in summaries), summaries


def test_loading_the_library_after_import_tfmemopt_is_refused_not_fatal(libtfmemopt):
    process = run_python(r'''
import sys
import tensorflow as tf
import tfmemopt
tf.load_library(sys.argv[1])
print("STILL ALIVE")
''', libtfmemopt)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "STILL ALIVE" in process.stdout
    assert ("libtfmemopt.so: a Grappler pass named 'TfMemOpt' is already registered"
            in process.stderr)


def test_import_tfmemopt_after_the_library_is_refused_with_a_message(libtfmemopt):
    process = run_python(r'''
import sys
import tensorflow as tf
tf.load_library(sys.argv[1])
try:
    import tfmemopt
except ImportError as err:
    print("REFUSED:", err)
print("STILL ALIVE")
''', libtfmemopt)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "REFUSED: tfmemopt: a Grappler pass named 'TfMemOpt' is already registered" in process.stdout
    assert "STILL ALIVE" in process.stdout
