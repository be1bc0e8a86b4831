"""benchmarks/peers.py: the peers a user could pick instead of tfmemopt, side by side.

The quick run (one model, plain TF, one Grappler level, one RematScope mode that raises
under graph mode, tfmemopt) runs once in a subprocess; its JSON, the last line of
stdout, is checked for its shape and its figures. The mechanisms peers.py applies
(cutting a model into blocks for tf.recompute_grad, grouping Grappler levels by their
graphs, reading Keras' errors) are checked in this process on small models.
"""

import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from conftest import BENCHMARKS

sys.path.insert(0, BENCHMARKS)

import peers  # noqa: E402

ROW_KEYS = {"peer", "status", "max_batch", "step_s", "loss_equal", "note"}


@pytest.fixture(scope="module")
def quick():
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "peers.py"), "--quick",
                           "--json"], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_quick_json_has_a_row_per_model_and_configuration(quick):
    stdout, data = quick
    assert list(data["models"]) == peers.QUICK["models"]
    assert list(data["configs"]) == peers.QUICK["peers"]
    for model, rows in data["models"].items():
        assert list(rows) == peers.QUICK["peers"]
        for name, row in rows.items():
            assert ROW_KEYS <= set(row), (name, row)
            assert row["status"] in ("ok", "error", "not_applicable", "same_graph_as")
        run = data["runs"][model]
        assert run["cap_mb"] == peers.QUICK["cap_mb"]
        assert run["timed_batch"] % run["batch_step"] == 0
        assert run["loss_batch"] % run["batch_step"] == 0
        assert run["lo"] <= run["loss_batch"] <= run["timed_batch"]
        assert len(run["reference_losses"]) == peers.LOSS_STEPS
        # The table is printed before the JSON line.
        assert "plain TF" in stdout and "tfmemopt" in stdout


def test_each_search_brackets_the_limit(quick):
    _, data = quick
    for rows in data["models"].values():
        for name in ("plain_tf", "tfmemopt"):
            trials = rows[name]["trials"]
            ok = [t["batch"] for t in trials if t["status"] == "ok"]
            oom = [t["batch"] for t in trials if t["status"] == "oom"]
            assert len(ok) + len(oom) == len(trials)
            assert rows[name]["max_batch"] == max(ok)
            assert not oom or (max(ok) < min(oom) and rows[name]["min_failing_batch"] == min(oom))


def test_plain_tf_losses_equal_a_second_plain_tf_process(quick):
    _, data = quick
    for model, rows in data["models"].items():
        plain = rows["plain_tf"]
        assert plain["loss_equal"] is True
        losses = data["runs"][model]["reference_losses"]
        assert plain["losses"] == losses and all(isinstance(v, float) for v in losses)
        assert plain["step_ratio"] == 1.0 and plain["step_s"] > 0


def test_tfmemopt_trains_and_its_losses_equal_plain_tfs(quick):
    # Not who trains the larger batch: on the quick run's MLP the limit of both moves
    # by a batch step from run to run (the full run's table says who wins).
    _, data = quick
    for rows in data["models"].values():
        plain, mine = rows["plain_tf"], rows["tfmemopt"]
        assert isinstance(plain["max_batch"], int) and isinstance(mine["max_batch"], int)
        assert mine["loss_equal"] is True and mine["step_s"] > 0
        if mine["max_batch"] > plain["max_batch"]:
            # Where plain TF runs out of memory under the cap, tfmemopt rewrites the graph
            # and its losses still equal plain TF's (without a cap) bit for bit.
            assert mine["graph_changed_at_max_batch"] is True
            assert mine["loss_equal_at_max_batch"] is True
            assert len(mine["losses_at_max_batch"]) == peers.LOSS_STEPS
        else:
            assert "loss_equal_at_max_batch" not in mine
        assert mine["grappler_check"]["passed"] and "TfMemOpt ran" in mine["grappler_check"]["seen"]


def test_a_remat_mode_that_raises_is_recorded_with_its_error(quick):
    _, data = quick
    for rows in data["models"].values():
        full = rows["keras_remat_full"]
        assert full["status"] == "error"
        assert ("The custom_gradient decorator currently supports keywords arguments only "
                "when eager execution is enabled") in full["error"]
        assert full["note"].startswith("raises: ")
        assert full["max_batch"] is None and full["step_s"] is None and full["loss_equal"] is None


def test_a_grappler_level_reaches_the_graph_or_shares_plain_tfs(quick):
    _, data = quick
    for rows in data["models"].values():
        row = rows["grappler_SWAPPING_HEURISTICS"]
        assert row["grappler_check"]["passed"], row["grappler_check"]
        if row["status"] == "same_graph_as":
            same = rows[row["same_graph_as"]]
            assert (row["max_batch"], row["step_s"]) == (same["max_batch"], same["step_s"])
        else:
            assert row["status"] == "ok" and isinstance(row["max_batch"], int)


# ---------------------------------------------------------------------------------
# The mechanisms, in this process


def _residual_model():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, name="stem")(inputs)
    r = keras.layers.Dense(8, activation="relu", name="a")(h)
    r = keras.layers.Dense(8, name="b")(r)
    h = keras.layers.Add(name="add")([h, r])
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.Dense(8, name="c")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))


def test_blocks_are_cut_where_no_tensor_skips_over_and_never_split_a_residual_block():
    _, pieces, head = peers.blocks(_residual_model())
    assert [[layer.name for layer in layers] for layers, _ in pieces] == [
        ["stem"], ["a", "b", "add", "relu"], ["c"]]
    assert [layer.name for layer in head] == ["out"]


def test_recompute_blocks_keeps_the_layers_and_their_weights_and_the_results():
    model = _residual_model()
    recomputed, names = peers.recompute_blocks(model)
    assert names == [["stem"], ["a", "b", "add", "relu"], ["c"]]
    assert {id(v) for v in recomputed.trainable_variables} == {
        id(v) for v in model.trainable_variables}
    x = tf.random.stateless_normal((4, 8), seed=(1, 2))

    def grads(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x, training=True) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    loss, expected = tf.function(lambda: grads(model))()
    loss_r, got = tf.function(lambda: grads(recomputed))()
    assert float(loss) == float(loss_r)
    assert all((a.numpy() == b.numpy()).all() for a, b in zip(expected, got))


def test_each_residual_block_of_the_cifar_resnet_is_one_recomputed_block():
    _, _, model = peers._build("cifar_resnet10", 4)
    _, pieces, head = peers.blocks(model)
    # The stem, then 10 residual blocks (the last with the global pooling); the output
    # layer is the head.
    assert len(pieces) == 11
    assert all(sum(isinstance(layer, keras.layers.Add) for layer in layers) == 1
               for layers, _ in pieces[1:])
    assert [type(layer).__name__ for layer in head] == ["Dense"]


def test_levels_share_a_row_only_when_their_graphs_match_at_every_batch_compared():
    groups = {"batches": {"16": {"digest": "p16"}, "512": {"digest": "p512"}},
              "levels": {"NO_MEM_OPT": {"16": {"digest": "n16"}, "512": {"digest": "n512"}},
                         "SWAPPING_HEURISTICS": {"16": {"digest": "p16"},
                                                 "512": {"digest": "s512"}},
                         "RECOMPUTATION_HEURISTICS": {"16": {"digest": "p16"},
                                                      "512": {"digest": "s512"}},
                         "HEURISTICS": {"16": {"digest": "p16"}, "512": {"digest": "p512"}}}}
    assert peers.level_groups(groups, list(groups["levels"])) == {
        "grappler_RECOMPUTATION_HEURISTICS": "grappler_SWAPPING_HEURISTICS",
        "grappler_HEURISTICS": "plain_tf"}


def test_keras_errors_are_reduced_to_their_message_and_layer():
    text = ("in user code:\n\n    File \"x.py\", line 3, in train_step\n        loss = f()\n\n"
            "    ValueError: Exception encountered when calling Dense.call().\n\n"
            "    \x1b[1mThe custom_gradient decorator currently supports keywords arguments "
            "only when eager execution is enabled.\x1b[0m\n\n"
            "    Arguments received by Dense.call():\n      • training=True\n")
    assert peers._keras_error(ValueError(text)) == (
        "The custom_gradient decorator currently supports keywords arguments only when "
        "eager execution is enabled. (in Dense.call())")
