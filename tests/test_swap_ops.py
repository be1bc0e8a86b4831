"""TfMemSwapOut / TfMemSwapIn: the swap mechanism of the CPU test bed.

A swapped tensor comes back bitwise identical; while it is swapped out its bytes
live in tfmemopt's host pool, outside TensorFlow's (capped) CPU allocator, whose
peak therefore drops; and TF's own Grappler passes leave the swap nodes alone.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.framework import op_def_registry
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer

import tfmemopt
from conftest import capped_allocator_env, run_python

SWAP_OUT, SWAP_IN = "TfMemSwapOut", "TfMemSwapIn"
PLAIN_TYPES = [tf.bool, tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.uint32,
               tf.int64, tf.uint64, tf.float16, tf.bfloat16, tf.float32, tf.float64,
               tf.complex64, tf.complex128]


def swap_out(tensor, name=None):
    return tensor.graph._create_op_internal(
        SWAP_OUT, [tensor], dtypes=[tensor.dtype], name=name).outputs[0]


def swap_in(stash, name=None, after=()):
    """SwapIn of `stash` that runs only once every op in `after` has run."""
    with stash.graph.control_dependencies(list(after)):
        return stash.graph._create_op_internal(
            SWAP_IN, [stash], dtypes=[stash.dtype], name=name).outputs[0]


def random_array(dtype, shape, seed=0):
    """Every bit pattern is fair game (NaN payloads, -0.0, subnormals), except for
    bool, whose bytes must be 0 or 1."""
    rng = np.random.default_rng(seed)
    np_dtype = dtype.as_numpy_dtype
    if dtype == tf.bool:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    count = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=count * np.dtype(np_dtype).itemsize, dtype=np.uint8)
    return raw.view(np_dtype).reshape(shape)


def session_config():
    """No graph rewriting: these tests are about the kernels."""
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
    return config


# --- Registration -------------------------------------------------------------

def test_import_tfmemopt_registers_both_ops_as_stateful_for_plain_types_only():
    for op in (SWAP_OUT, SWAP_IN):
        op_def = op_def_registry.get(op)
        assert op_def is not None, op
        assert op_def.is_stateful
        (attr,) = op_def.attr
        allowed = set(attr.allowed_values.list.type)
        assert allowed == {t.as_datatype_enum for t in PLAIN_TYPES}
        for excluded in (tf.string, tf.resource, tf.variant):
            assert excluded.as_datatype_enum not in allowed


def test_a_string_tensor_is_refused_when_the_graph_is_built():
    with tf.Graph().as_default():
        with pytest.raises((TypeError, ValueError), match="string"):
            swap_out(tf.constant(["a", "b"]))


def test_shape_is_inferred_from_the_input():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 5])
        stash = swap_out(x)
        y = swap_in(stash)
        assert stash.shape.as_list() == [None, 3, 5]
        assert y.shape.as_list() == [None, 3, 5]
        assert y.dtype == tf.float32


# --- Data -----------------------------------------------------------------------

SHAPES = [(), (0,), (4, 0, 3), (1,), (7,), (3, 5, 7), (2_500_001,)]


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.int32, tf.int64, tf.bool,
                                   tf.bfloat16, tf.float64, tf.complex64, tf.uint8],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swap_out_then_in_is_bitwise_identical(dtype, shape):
    value = random_array(dtype, shape, seed=len(shape))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(dtype, shape)
        y = swap_in(swap_out(x))
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        out = sess.run(y, {x: value})
    assert out.dtype == value.dtype and out.shape == value.shape
    assert out.tobytes() == value.tobytes()


def test_the_stash_itself_holds_the_value():
    value = random_array(tf.float32, (1000, 33), seed=3)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, value.shape)
        stash = swap_out(x)
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        out = sess.run(stash, {x: value})
    assert out.tobytes() == value.tobytes()


def test_one_stash_serves_several_swap_ins():
    value = random_array(tf.int64, (3, 1001), seed=4)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.int64, value.shape)
        stash = swap_out(x)
        first = swap_in(stash)
        second = swap_in(stash, after=[first.op])
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        a, b = sess.run([first, second], {x: value})
    assert a.tobytes() == value.tobytes() and b.tobytes() == value.tobytes()


def test_the_ops_run_inside_a_tf_function_after_grappler():
    """tf.function graphs are the ones TfMemOpt rewrites; TF's default passes run."""
    value = random_array(tf.float32, (300, 7), seed=8)

    @tf.function
    def step(x):
        stash = swap_out(x)
        gap_end = tf.reduce_sum(x * 2.0)
        return swap_in(stash, after=[gap_end.op]), gap_end

    swaps_before = tfmemopt.host_memory_stats()["swap_ins"]
    y, _ = step(tf.constant(value))
    assert y.numpy().tobytes() == value.tobytes()
    assert tfmemopt.host_memory_stats()["swap_ins"] == swaps_before + 1


# --- Host pool ------------------------------------------------------------------

def test_host_pool_holds_the_bytes_while_swapped_out_and_counts_swaps():
    big = random_array(tf.float32, (1 << 18,), seed=5)    # 1 MiB
    small = random_array(tf.int32, (1001,), seed=6)        # 4004 B
    observed = []

    def in_the_gap():
        observed.append(tfmemopt.host_memory_stats())
        return np.int64(0)

    with tf.Graph().as_default() as graph:
        x1 = tf.compat.v1.placeholder(tf.float32, big.shape)
        x2 = tf.compat.v1.placeholder(tf.int32, small.shape)
        s1, s2 = swap_out(x1), swap_out(x2)
        with graph.control_dependencies([s1.op, s2.op]):
            gap = tf.numpy_function(in_the_gap, [], tf.int64)
        y1 = swap_in(s1, after=[gap.op])
        y2 = swap_in(s2, after=[gap.op])
    before = tfmemopt.host_memory_stats(reset_peak=True)
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        out1, out2 = sess.run([y1, y2], {x1: big, x2: small})
    after = tfmemopt.host_memory_stats()

    assert out1.tobytes() == big.tobytes() and out2.tobytes() == small.tobytes()
    (during,) = observed
    held = big.nbytes + small.nbytes
    assert during["bytes_in_use"] == before["bytes_in_use"] + held
    assert after["bytes_in_use"] == before["bytes_in_use"]   # freed with the stash
    assert after["peak_bytes"] == before["bytes_in_use"] + held
    assert after["swap_outs"] == before["swap_outs"] + 2
    assert after["swap_ins"] == before["swap_ins"] + 2
    assert set(after) == {"bytes_in_use", "peak_bytes", "swap_outs", "swap_ins", "cached_bytes"}


def test_a_freed_block_is_reused_by_the_next_swap_out_of_its_size():
    # An odd size no other test uses; the pool allocates multiples of 64 bytes.
    value = random_array(tf.float32, (786_449,), seed=7)
    allocation = -(-value.nbytes // 64) * 64
    observed = []

    def in_the_gap():
        observed.append(tfmemopt.host_memory_stats())
        return np.int64(0)

    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, value.shape)
        stash = swap_out(x)
        with graph.control_dependencies([stash.op]):
            gap = tf.numpy_function(in_the_gap, [], tf.int64)
        y = swap_in(stash, after=[gap.op])
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        sess.run(y, {x: value})
        before_second = tfmemopt.host_memory_stats()
        assert before_second["cached_bytes"] >= allocation   # the first run's block
        out = sess.run(y, {x: value})
    second_gap = observed[1]
    assert second_gap["cached_bytes"] == before_second["cached_bytes"] - allocation
    assert tfmemopt.host_memory_stats()["cached_bytes"] == before_second["cached_bytes"]
    assert out.tobytes() == value.tobytes()


def test_reset_peak_restarts_from_bytes_in_use():
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, (4096,))
        y = swap_in(swap_out(x))
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        sess.run(y, {x: np.zeros(4096, np.float32)})
    assert tfmemopt.host_memory_stats(reset_peak=True)["peak_bytes"] >= 4096 * 4
    stats = tfmemopt.host_memory_stats()
    assert stats["peak_bytes"] == stats["bytes_in_use"]


# --- The capped CPU allocator's peak drops -------------------------------------

CAPPED_BFC_PROGRAM = r"""
import hashlib
import json
import numpy as np
import tensorflow as tf
import tfmemopt
from tensorflow.core.protobuf import config_pb2

N = 8 << 20          # float32 elements: 32 MiB per tensor
SWAP_OUT, SWAP_IN = "TfMemSwapOut", "TfMemSwapIn"

def uniform(seed2, after=()):
    with tf.compat.v1.get_default_graph().control_dependencies(list(after)):
        return tf.raw_ops.RandomUniform(shape=[N], dtype=tf.float32, seed=7, seed2=seed2)

def run(swap):
    # `held` is made first and used last; in between, a chain that holds two more
    # tensors of the same size. With swap=True, `held` waits in the host pool.
    with tf.Graph().as_default() as graph:
        held = uniform(1)
        after = []
        if swap:
            stash = graph._create_op_internal(SWAP_OUT, [held], dtypes=[tf.float32]).outputs[0]
            after = [stash.op]
        a = uniform(2, after)
        b = uniform(3, [a.op])
        gap_end = tf.reduce_sum(a * b)
        if swap:
            with graph.control_dependencies([gap_end.op]):
                held = graph._create_op_internal(SWAP_IN, [stash], dtypes=[tf.float32]).outputs[0]
        result = held * 2.0 + gap_end
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        tf.config.experimental.reset_memory_stats("CPU:0")
        tfmemopt.host_memory_stats(reset_peak=True)
        out = sess.run(result)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {"bfc_peak": peak, "host": tfmemopt.host_memory_stats(), "digest": hashlib.sha256(out.tobytes()).hexdigest()}

print(json.dumps({"plain": run(False), "swap": run(True), "tensor_bytes": N * 4}))
"""


def test_swapping_a_held_tensor_lowers_the_capped_bfc_peak():
    result = run_python(CAPPED_BFC_PROGRAM,
                        env=capped_allocator_env(1024, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    plain, swap, tensor_bytes = measured["plain"], measured["swap"], measured["tensor_bytes"]
    assert swap["digest"] == plain["digest"]
    # Without swapping, `held` sits in the allocator through the chain.
    assert plain["bfc_peak"] >= 3 * tensor_bytes
    assert swap["bfc_peak"] <= plain["bfc_peak"] - 0.95 * tensor_bytes
    # ... with it, the host pool held those bytes instead, and let them go.
    assert swap["host"]["peak_bytes"] == tensor_bytes
    assert swap["host"]["bytes_in_use"] == 0
    assert plain["host"]["peak_bytes"] == 0


# --- Grappler keeps the swap nodes ----------------------------------------------

def swap_graph_metagraph():
    """A small training-like graph with swap pairs where TF's optimizers would
    remove, fold or merge ops that are free of side effects."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [64, 256], name="x")
        w = tf.compat.v1.placeholder(tf.float32, [256, 256], name="w")
        act = tf.nn.relu(tf.matmul(x, w), name="act")
        stash = swap_out(act, name="act/swap_out")
        # The "gap": work that must finish before the swap-in.
        gap_end = tf.reduce_sum(tf.nn.relu(tf.matmul(tf.identity(x), w)), name="gap_end")
        back = swap_in(stash, name="act/swap_in", after=[gap_end.op])
        # Two swap-ins of one stash with the same trigger: CSE would merge them.
        back_twin = swap_in(stash, name="act/swap_in_twin", after=[gap_end.op])
        grad = tf.identity(back, name="through_identity") * back_twin + gap_end
        # A swapped tensor whose value is a constant: constant folding would fold
        # the pair; the folded producer and sibling show that constant folding ran.
        const = tf.constant(np.arange(1024, dtype=np.float32), name="const")
        tripled = tf.multiply(const, 3.0, name="tripled")
        const_back = swap_in(swap_out(tripled, name="const/swap_out"), name="const/swap_in")
        doubled = tf.multiply(const, 2.0, name="doubled")
        loss = tf.add(tf.reduce_sum(grad) + tf.reduce_sum(const_back),
                      tf.reduce_sum(doubled), name="loss")
        graph.add_to_collection("train_op", loss.op)
        return tf.compat.v1.train.export_meta_graph(graph=graph)


def wiring(node):
    data = [i for i in node.input if not i.startswith("^")]
    control = sorted(i for i in node.input if i.startswith("^"))
    return node.op, data, control, node.attr["T"].type


def test_swap_nodes_survive_tf_default_grappler_passes_twice():
    metagraph = swap_graph_metagraph()
    original = {n.name: n for n in metagraph.graph_def.node}
    swap_nodes = sorted(n for n, node in original.items() if node.op in (SWAP_OUT, SWAP_IN))
    assert len(swap_nodes) == 5

    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.min_graph_nodes = -1
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.TWO
    cluster = grappler_cluster.Cluster(disable_detailed_stats=True)
    optimized = tf_optimizer.OptimizeGraph(config, metagraph, cluster=cluster)
    after = {n.name: n for n in optimized.node}

    # TF's passes did run: the Identity went, and constant folding folded both
    # multiplications of the constant, up to the swap-out.
    assert "through_identity" not in after
    assert after["tripled"].op == "Const"
    assert "doubled" not in after or after["doubled"].op == "Const"
    # Every swap node is still there, wired exactly as before.
    for name in swap_nodes:
        assert name in after, f"{name} was removed"
        assert wiring(after[name]) == wiring(original[name]), name
    # And their outputs are still used.
    consumed = {i.lstrip("^").split(":")[0] for n in optimized.node for i in n.input
                if not i.startswith("^")}
    assert set(swap_nodes) <= consumed
