"""Random training graphs, and the checks every one of them must pass under tfmemopt.

A case is a plain JSON-able dict (a *spec*): the model's blocks, its losses, its
shapes, and the pass's configuration (policy, budget as a ratio of the predicted
peak, min_tensor_bytes, scopes). `draw_spec(chooser)` makes one from any source of
choices: `hypothesis` (tests/test_generated_graphs.py) or a seeded `random.Random`
(benchmarks/stress.py), so both explore the same space and every failure prints a
spec that replays it exactly.

`run_case(spec)` checks one case:
  * the step trains (2 SGD steps) without tfmemopt: the baseline;
  * through Grappler's own entry point (tf_optimizer.OptimizeGraph) with tfmemopt:
    the output is a valid graph, nothing stateful was cloned, every `TfMemOpt/`
    node's original exists, and a second pass over the output (a fresh pass)
    adds nothing (through the whole meta-optimizer: nothing to an output that
    holds our nodes already); when the report says the plan fits, a fresh
    simulation of the output is within the budget too;
  * the step trains again with tfmemopt.enable() (the graph TF really runs, taken
    from the runtime's post-optimization function graphs, is checked the same way),
    and its losses, gradients and updated weights are bitwise equal to the baseline
    (where the pass split work along the batch, the first losses are, and the rest
    as accurate as the baseline against a float64 run: see SPLIT_ERROR_FACTOR).

Bitwise comparisons need TF itself to be deterministic: the worker process sets one
inter-op thread before TensorFlow starts (`python tests/generated_graphs.py --worker`),
which is where cases run. `Worker` drives one such process; a case that kills it is
reported as a crash.
"""

import json
import os
import random
import select
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------
# Specs

ACTIVATIONS = ["relu", "tanh", "sigmoid", "none", "softplus"]
DENSE_BLOCKS = ["dense", "dense", "residual", "branch", "concat_prev", "skip_prev",
                "reduce", "dropout", "stateless_dropout", "shared_dense", "batch_center"]
IMAGE_BLOCKS = ["conv", "conv", "pool", "conv_branch", "skip_prev", "dropout",
                "channel_center", "flatten", "global_pool"]
REDUCTIONS = ["center", "softmax", "max_norm", "logsumexp", "layer_norm", "sum_gate"]
LOSSES = ["mse", "softmax_xent", "sigmoid_xent", "l2", "abs_mean"]
POLICIES = ["AUTO", "AUTO", "AUTO", "SQRT", "MANUAL"]
# Budget as a fraction of the predicted peak; 0 means 1 byte (never feasible).
BUDGET_RATIOS = [0.0, 0.2, 0.4, 0.6, 0.75, 0.85, 0.95, 1.0, 1.5]
MIN_TENSOR_BYTES = [0, 1, 256, 4096, 65536]


class RandomChooser:
    """Choices from a seeded random.Random (benchmarks/stress.py)."""

    def __init__(self, seed):
        self._rng = random.Random(seed)

    def integer(self, lo, hi):
        return self._rng.randint(lo, hi)

    def choice(self, options):
        return options[self._rng.randrange(len(options))]

    def boolean(self):
        return self._rng.random() < 0.5


class HypothesisChooser:
    """Choices drawn from hypothesis strategies (so hypothesis can shrink them)."""

    def __init__(self, draw):
        from hypothesis import strategies as st

        self._draw, self._st = draw, st

    def integer(self, lo, hi):
        return self._draw(self._st.integers(lo, hi))

    def choice(self, options):
        return self._draw(self._st.sampled_from(options))

    def boolean(self):
        return self._draw(self._st.booleans())


def _dense_block(c, kind):
    block = {"type": kind}
    if kind in ("dense", "shared_dense"):
        block.update(units=c.integer(1, 96), act=c.choice(ACTIVATIONS), bias=c.boolean())
    elif kind == "residual":
        block.update(act=c.choice(ACTIVATIONS))
    elif kind == "branch":
        block.update(units=[c.integer(1, 64), c.integer(1, 64)], act=c.choice(ACTIVATIONS),
                     combine=c.choice(["add", "concat", "mul"]))
    elif kind in ("concat_prev", "skip_prev"):
        block.update(back=c.integer(1, 4))
    elif kind == "reduce":
        block.update(how=c.choice(REDUCTIONS))
    elif kind in ("dropout", "stateless_dropout"):
        block.update(rate=c.choice([0.1, 0.3, 0.5]))
    return block


def _image_block(c, kind):
    block = {"type": kind}
    if kind == "conv":
        block.update(filters=c.integer(1, 12), kernel=c.choice([1, 3]), stride=c.choice([1, 2]),
                     padding=c.choice(["SAME", "VALID"]), act=c.choice(ACTIVATIONS),
                     share=c.boolean())
        if block["kernel"] == 1 and block["stride"] == 2:
            # TF 2.21's oneDNN kernels corrupt the heap or segfault on the backward
            # pass of a 1x1 stride-2 convolution, without tfmemopt too (stress cases
            # 268 and 917, seed 0; 268 also in a process that never loads tfmemopt):
            # such a case tests TF, not the pass. Drawn, then changed, so that every
            # other case stays what it was.
            block["stride"] = 1
    elif kind == "pool":
        block.update(how=c.choice(["max", "avg"]))
    elif kind == "conv_branch":
        block.update(filters=c.integer(1, 8), combine=c.choice(["add", "concat"]),
                     act=c.choice(ACTIVATIONS))
    elif kind == "skip_prev":
        block.update(back=c.integer(1, 3))
    elif kind == "dropout":
        block.update(rate=c.choice([0.1, 0.3, 0.5]))
    return block


def draw_spec(c):
    """One case from the chooser `c` (RandomChooser or HypothesisChooser)."""
    kind = c.choice(["dense", "dense", "image"])
    spec = {"seed": c.integer(0, 2**31 - 1), "batch": c.integer(1, 48), "kind": kind}
    if kind == "dense":
        spec["input_shape"] = [c.integer(1, 128)]
    else:
        spec["input_shape"] = [c.integer(2, 14), c.integer(2, 14), c.integer(1, 4)]
    blocks, image = [], kind == "image"
    for _ in range(c.integer(1, 9)):
        if image:
            block = _image_block(c, c.choice(IMAGE_BLOCKS))
            image = block["type"] not in ("flatten", "global_pool")
        else:
            block = _dense_block(c, c.choice(DENSE_BLOCKS))
        blocks.append(block)
    spec["blocks"] = blocks
    spec["losses"] = [{"type": c.choice(LOSSES), "tap": c.integer(0, 8),
                       "outputs": c.integer(1, 10)} for _ in range(c.integer(1, 3))]
    spec["optimizer"] = c.choice(["sgd", "momentum"])
    policy = c.choice(POLICIES)
    config = {"policy": policy, "min_tensor_bytes": c.choice(MIN_TENSOR_BYTES),
              "budget_ratio": c.choice(BUDGET_RATIOS)}
    if policy == "MANUAL":
        config["scopes"] = sorted({f"block_{c.integer(0, len(blocks) - 1)}"
                                   for _ in range(c.integer(1, 3))})
    spec["config"] = config
    # A recurrent block (issue 19: loops and the lists they fill), drawn last, so
    # that every earlier choice of a seed stays what it was.
    if kind == "dense" and c.integer(0, 3) == 0:
        spec["blocks"].insert(c.integer(0, len(blocks)), {
            "type": "rnn", "form": c.choice(["while", "scan"]), "steps": c.integer(2, 12),
            "units": c.integer(1, 48), "act": c.choice(["tanh", "sigmoid", "relu"]),
            "readout": c.choice(["last", "mean"])})
    return spec


# Split cases: the same specs with batches large enough to cut into slices of
# 64-byte-aligned rows (rank-1 tensors need 16 rows a slice) and budgets low enough
# that keeping, swapping and recomputing do not suffice. Drawn after everything
# draw_spec draws, so a seed's model is the same in both.
SPLIT_BATCHES = [32, 48, 64, 96]
SPLIT_BUDGET_RATIOS = [0.0, 0.2, 0.35, 0.5]
SPLIT_MIN_TENSOR_BYTES = [0, 256, 4096]


def draw_split_spec(c):
    spec = draw_spec(c)
    spec["batch"] = c.choice(SPLIT_BATCHES)
    spec["config"]["budget_ratio"] = c.choice(SPLIT_BUDGET_RATIOS)
    spec["config"]["min_tensor_bytes"] = c.choice(SPLIT_MIN_TENSOR_BYTES)
    return spec


def random_spec(seed):
    return draw_spec(RandomChooser(seed))


def random_split_spec(seed):
    return draw_split_spec(RandomChooser(seed))


def hypothesis_specs():
    """A hypothesis strategy of specs."""
    from hypothesis import strategies as st

    return st.composite(lambda draw: draw_spec(HypothesisChooser(draw)))()


# ---------------------------------------------------------------------------------
# Models (TensorFlow is imported lazily: the worker sets its threads first)

class Model:
    """Variables (from a numpy RNG seeded by the spec) and a builder of the train
    step. Two Models of one spec start from bitwise-equal weights.

    The weights are made by one eager forward pass on zeros, in call order; the
    traced step asks for them in the same order and gets the same variables.

    dtype="float64" builds the same model in double precision, a reference for
    float32's rounding (split results are measured against it: SPLIT_ERROR_FACTOR):
    the same float32 draws (inputs, targets, weights, dropout masks) widened exactly,
    every op the same, computed in float64. float32, the default, is the model the
    pass is tested on."""

    def __init__(self, spec, dtype="float32"):
        import numpy as np
        import tensorflow as tf

        self.tf, self.np, self.spec = tf, np, spec
        self.dtype = tf.as_dtype(dtype)
        self.rng = np.random.default_rng(spec["seed"])
        batch = spec["batch"]
        self.x = tf.constant(self._widened(self.rng.standard_normal(
            [batch] + spec["input_shape"], dtype=np.float32)))
        self.targets = [tf.constant(self._widened(self.rng.standard_normal(
                            (batch, loss["outputs"]), dtype=np.float32)))
                        for loss in spec["losses"]]
        self.labels = [tf.constant(self.rng.integers(0, loss["outputs"], size=(batch,),
                                                     dtype=np.int32))
                       for loss in spec["losses"]]
        self.variables, self._sequence, self._shared = [], [], {}
        self._recording = True
        self._losses(self._forward(tf.zeros_like(self.x)))
        self._recording = False
        self._slots = []
        if spec["optimizer"] == "momentum":
            self._slots = [tf.Variable(tf.zeros_like(v)) for v in self.variables]

    def _widened(self, value):
        """A float32 numpy draw, in the model's dtype (exactly: float32 -> float64)."""
        return value.astype(self.np.float32).astype(self.dtype.as_numpy_dtype)

    def _weight(self, shape, share_key=None):
        if not self._recording:
            variable = self._sequence[self._next]
            self._next += 1
            return variable
        variable = self._shared.get(share_key) if share_key is not None else None
        if variable is None:
            fan_in = int(self.np.prod(shape[:-1])) or 1
            value = self.rng.standard_normal(shape, dtype=self.np.float32) / self.np.sqrt(fan_in)
            variable = self.tf.Variable(self._widened(value))
            self.variables.append(variable)
            if share_key is not None:
                self._shared[share_key] = variable
        self._sequence.append(variable)
        return variable

    def _act(self, h, name):
        tf = self.tf
        return {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid,
                "softplus": tf.nn.softplus, "none": tf.identity}[name](h)

    def _dense(self, h, units, act="none", bias=False, share=False):
        tf = self.tf
        w = self._weight([h.shape[-1], units], ("dense", h.shape[-1], units) if share else None)
        h = tf.matmul(h, w)
        if bias:
            h = h + self._weight([units])
        return self._act(h, act)

    def _conv(self, h, filters, kernel, stride=1, padding="SAME", act="none", share=False):
        tf = self.tf
        if padding == "VALID" and (h.shape[1] < kernel or h.shape[2] < kernel):
            padding = "SAME"
        key = ("conv", kernel, h.shape[-1], filters) if share else None
        w = self._weight([kernel, kernel, h.shape[-1], filters], key)
        return self._act(tf.nn.conv2d(h, w, stride, padding), act)

    def _forward(self, x):
        """Runs the blocks; returns the flat (rank-2) taps the losses read."""
        tf, spec = self.tf, self.spec
        h, history, taps = x, [x], []
        for i, block in enumerate(spec["blocks"]):
            with tf.name_scope(f"block_{i}"):
                h = self._block(block, h, history, i)
            history.append(h)
            if h.shape.rank == 2:
                taps.append(h)
        if h.shape.rank != 2:
            h = tf.reshape(h, [spec["batch"], -1])
            taps.append(h)
        return taps

    def _block(self, b, h, history, i):
        tf = self.tf
        kind = b["type"]
        if kind in ("dense", "shared_dense"):
            return self._dense(h, b["units"], b["act"], b["bias"], share=kind == "shared_dense")
        if kind == "residual":
            return h + self._dense(h, h.shape[-1], b["act"])
        if kind == "branch":
            u0, u1 = b["units"]
            if b["combine"] in ("add", "mul"):
                u1 = u0
            left, right = self._dense(h, u0, b["act"]), self._dense(h, u1, "tanh")
            return {"add": tf.add, "mul": tf.multiply,
                    "concat": lambda a, c: tf.concat([a, c], 1)}[b["combine"]](left, right)
        if kind == "concat_prev":
            prev = history[max(0, len(history) - 1 - b["back"])]
            if prev.shape.rank != 2:
                prev = tf.reduce_mean(prev, axis=[1, 2])
            return tf.concat([h, prev], axis=1)
        if kind == "skip_prev":
            prev = history[max(0, len(history) - 1 - b["back"])]
            if prev.shape == h.shape:
                return h + prev
            if h.shape.rank == 2 and prev.shape.rank == 2:
                return h + self._dense(prev, h.shape[-1])
            return h * 1.5
        if kind == "reduce":
            how = b["how"]
            if how == "center":
                return h - tf.reduce_mean(h, axis=1, keepdims=True)
            if how == "softmax":
                return tf.nn.softmax(h)
            if how == "max_norm":
                return h / (tf.reduce_max(tf.abs(h), axis=1, keepdims=True) + 1.0)
            if how == "logsumexp":
                return h - tf.reduce_logsumexp(h, axis=1, keepdims=True)
            if how == "layer_norm":
                mean, var = tf.nn.moments(h, axes=[1], keepdims=True)
                return (h - mean) * tf.math.rsqrt(var + 1e-3)
            return h * tf.sigmoid(tf.reduce_sum(h, axis=1, keepdims=True))
        if kind == "dropout":
            if self.dtype != tf.float32:
                # tf.nn.dropout's own steps (nn_ops._dropout), with the float32 draw
                # of the same seeds: the float32 model's mask.
                draw = tf.random.uniform(tf.shape(h), seed=100 + i, dtype=tf.float32)
                return tf.where(draw >= b["rate"], h * (1 / (1 - b["rate"])),
                                tf.zeros_like(h))
            return tf.nn.dropout(h, rate=b["rate"], seed=100 + i)
        if kind == "stateless_dropout":
            mask = tf.random.stateless_uniform(tf.shape(h), seed=[self.spec["seed"] % 997, i])
            return tf.where(mask >= b["rate"], h / (1 - b["rate"]), tf.zeros_like(h))
        if kind == "batch_center":
            return h - tf.reduce_mean(h, axis=0, keepdims=True)
        if kind == "rnn":
            return self._rnn(b, h)
        # Image blocks.
        if kind == "conv":
            return self._conv(h, b["filters"], b["kernel"], b["stride"], b["padding"], b["act"],
                              share=b["share"])
        if kind == "pool":
            if h.shape[1] < 2 or h.shape[2] < 2:
                return tf.nn.relu(h)
            pool = tf.nn.max_pool2d if b["how"] == "max" else tf.nn.avg_pool2d
            return pool(h, 2, 2, "VALID")
        if kind == "conv_branch":
            left = self._conv(h, b["filters"], 3, act=b["act"])
            right = self._conv(h, b["filters"], 1, act="relu")
            return left + right if b["combine"] == "add" else tf.concat([left, right], 3)
        if kind == "channel_center":
            return h - tf.reduce_mean(h, axis=[1, 2], keepdims=True)
        if kind == "flatten":
            return tf.reshape(h, [self.spec["batch"], -1])
        if kind == "global_pool":
            return tf.reduce_mean(h, axis=[1, 2])
        raise ValueError(f"unknown block {kind}")

    def _rnn(self, b, h):
        """A recurrent layer over `steps` scaled copies of h: a tf.while_loop writing a
        TensorArray, or tf.scan; its gradient loop pops what the forward loop pushed."""
        tf = self.tf
        if h.shape.rank != 2:
            h = tf.reshape(h, [self.spec["batch"], -1])
        steps, units = b["steps"], b["units"]
        w = self._weight([h.shape[-1], units])
        u = self._weight([units, units])
        scales = tf.reshape(tf.range(1, steps + 1, dtype=self.dtype) / steps, [steps, 1, 1])
        xs = tf.tile(h[None], [steps, 1, 1]) * scales

        def cell(prev, x):
            return self._act(tf.matmul(x, w) + tf.matmul(prev, u), b["act"])

        init = tf.zeros([self.spec["batch"], units], self.dtype)
        if b["form"] == "scan":
            outputs = tf.scan(cell, xs, initializer=init)
        else:
            array = tf.TensorArray(self.dtype, size=steps)

            def body(t, prev, array):
                state = cell(prev, xs[t])
                return t + 1, state, array.write(t, state)

            _, _, array = tf.while_loop(lambda t, prev, array: t < steps, body,
                                        [tf.constant(0), init, array])
            outputs = array.stack()
        return outputs[-1] if b["readout"] == "last" else tf.reduce_mean(outputs, axis=0)

    def _losses(self, taps):
        tf = self.tf
        losses = []
        for k, loss in enumerate(self.spec["losses"]):
            with tf.name_scope(f"loss_{k}"):
                tap = taps[min(loss["tap"], len(taps) - 1)]
                logits = self._dense(tap, loss["outputs"])
                kind = loss["type"]
                if kind == "mse":
                    value = tf.reduce_mean(tf.square(logits - self.targets[k]))
                elif kind == "softmax_xent":
                    value = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                        labels=self.labels[k], logits=logits))
                elif kind == "sigmoid_xent":
                    value = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                        labels=tf.sigmoid(self.targets[k]), logits=logits))
                elif kind == "l2":
                    value = 1e-3 * tf.add_n([tf.nn.l2_loss(v) for v in self.variables])
                    value += tf.reduce_mean(logits)
                else:
                    value = tf.reduce_mean(tf.abs(logits))
                losses.append(value)
        return losses

    def step_function(self):
        """A fresh tf.function (traced, and optimized, on its first call): one SGD or
        momentum step; returns (losses, gradients)."""
        tf = self.tf

        @tf.function
        def step():
            self._next = 0
            with tf.GradientTape() as tape:
                losses = self._losses(self._forward(self.x))
                total = tf.add_n(losses)
            grads = tape.gradient(total, self.variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            for k, (variable, grad) in enumerate(zip(self.variables, grads)):
                if self._slots:
                    self._slots[k].assign(0.9 * self._slots[k] + grad)
                    variable.assign_sub(0.05 * self._slots[k])
                else:
                    variable.assign_sub(0.05 * grad)
            return losses, grads

        # Random ops take their seeds at trace time (the first call, next).
        tf.random.set_seed(self.spec["seed"] % 100_003)
        return step


def _bits(array):
    return array.tobytes()


def train(model, steps=2):
    """Losses and gradients of each step, and the final weights (numpy)."""
    step = model.step_function()
    out = {"losses": [], "grads": []}
    for _ in range(steps):
        losses, grads = step()
        out["losses"].append([loss.numpy() for loss in losses])
        out["grads"].append([g.numpy() for g in grads])
    out["weights"] = [v.numpy() for v in model.variables]
    return out


# Split cases. When the pass splits work along the batch, a weight gradient is a sum
# over batch slices, added in another order than one kernel adds it, and the second
# step and the weights follow: rounding differs, so these are not compared bit for
# bit (the first step's losses are: same weights, per-sample work only). Nor within a
# tolerance relative to each tensor's own norm: where a sum cancels, zero in exact
# arithmetic (a batch sum of batch-centered activations, split seed 122), rounding
# error is of the order of the summed terms, not of the small result, and two orders
# of one sum differ by far more than that tolerance allows, with no bug anywhere.
# The yardstick is TF's own rounding of the same sums, measured against the same
# model run in float64 without the pass (Model(spec, dtype="float64")): a split
# result's distance to that reference (norm of the difference) may be at most
#     SPLIT_ERROR_FACTOR * (the float32 result's without the pass
#                           + FLOAT32_EPSILON * the reference's norm)
# that is, the split is about as accurate as TF without it. The epsilon term stands
# for a tensor TF happens to round almost exactly (a scalar, mostly): its error is
# counted as at least one float32 epsilon of the result. A real split bug (a slice
# lost, counted twice, scaled) errs by a slice's share of the sum's terms, orders of
# magnitude past this (tests/test_generated_graphs.py). In split cases 0-199 (seed 0),
# the worst split error was 0.16 of what this allows.
SPLIT_ERROR_FACTOR = 8
FLOAT32_EPSILON = 2.0 ** -23


def _norm(a):
    import numpy as np

    return float(np.linalg.norm(np.asarray(a, dtype=np.float64).ravel()))


def split_error(base, mine, reference):
    """(error, allowed): the split result `mine`'s distance to the float64
    `reference`, and what the rule allows it, from the distance of `base` (float32,
    without the pass)."""
    import numpy as np

    reference = np.asarray(reference, dtype=np.float64)
    error = _norm(np.asarray(mine, dtype=np.float64) - reference)
    base_error = _norm(np.asarray(base, dtype=np.float64) - reference)
    return error, SPLIT_ERROR_FACTOR * (base_error + FLOAT32_EPSILON * _norm(reference))


def _results(base, mine, reference=None):
    """(where, key, step, base's, mine, reference's or None) for every result compared."""
    for key in ("losses", "grads"):
        for s, (a_list, b_list) in enumerate(zip(base[key], mine[key])):
            refs = reference[key][s] if reference else [None] * len(a_list)
            for k, (a, b, r) in enumerate(zip(a_list, b_list, refs)):
                yield f"step {s + 1} {key}[{k}]", key, s, a, b, r
    refs = reference["weights"] if reference else [None] * len(base["weights"])
    for k, (a, b, r) in enumerate(zip(base["weights"], mine["weights"], refs)):
        yield f"weights[{k}] after training", "weights", 1, a, b, r


def worst_split_error(base, mine, reference):
    """The largest split error among the results, as a fraction of what the rule
    allows (at most 1 passes): the margin a split case had."""
    worst = 0.0
    for _, _, _, a, b, r in _results(base, mine, reference):
        error, allowed = split_error(a, b, r)
        worst = max(worst, error / allowed if allowed else float("inf") if error else 0.0)
    return round(worst, 4)


def first_difference(base, mine, reference=None):
    """'' if `mine` matches `base`, else where it first differs. Bit for bit; with the
    float64 `reference` (split cases), only the first step's losses are, and the rest
    within the split rule (SPLIT_ERROR_FACTOR)."""
    for where, key, step, a, b, r in _results(base, mine, reference):
        if _bits(a) == _bits(b):
            continue
        if r is None or (key == "losses" and step == 0):
            return f"{where}: {a.ravel()[:3]} vs {b.ravel()[:3]}"
        error, allowed = split_error(a, b, r)
        if not error <= allowed:
            return (f"{where}: {a.ravel()[:3]} vs {b.ravel()[:3]}: {error:.3g} from the "
                    f"float64 reference, more than the {allowed:.3g} allowed (without the "
                    f"pass: {split_error(a, a, r)[0]:.3g})")
    return ""


# When TF does not repeat itself. With one inter-op thread TF usually computes a step
# bit for bit the same way twice, but not always: two plain trainings of
# TF_NOT_REPEATABLE's dense model (tests/test_generated_graphs.py: a logsumexp
# reduction, stateless dropout, momentum) in one process differ in the last bits in
# about one run of four, with oneDNN on or off. A difference between the pass's result
# and the plain one then proves nothing by itself. The case trains again with the pass
# and without (REPEAT_ROUNDS): if a run with the pass equals a run without, it passes;
# if TF's two runs of one graph differ, each result may differ from the other graph's by
# at most
#     REPEAT_ERROR_FACTOR * (TF's own difference + FLOAT32_EPSILON * its norm)
# (norms of the differences): TF's rounding noise, not a wrong tensor, which errs by
# orders of magnitude more. A case where TF repeats itself is still compared bit for bit.
REPEAT_ERROR_FACTOR = 8


def repeat_difference(base, mine, again):
    """'' if `mine` is within REPEAT_ERROR_FACTOR of TF's own spread (`base` vs
    `again`, two runs of one graph) for every result, else where it is not."""
    import numpy as np

    for where, _, _, a, b, r in _results(base, mine, again):
        if _bits(a) == _bits(b):
            continue
        a64 = np.asarray(a, dtype=np.float64)
        error = _norm(np.asarray(b, dtype=np.float64) - a64)
        spread = _norm(np.asarray(r, dtype=np.float64) - a64)
        allowed = REPEAT_ERROR_FACTOR * (spread + FLOAT32_EPSILON * _norm(a64))
        if not error <= allowed:
            return (f"{where}: {a.ravel()[:3]} vs {b.ravel()[:3]}: {error:.3g} from TF's "
                    f"result, more than the {allowed:.3g} allowed (TF's own two runs differ "
                    f"by {spread:.3g})")
    return ""


# Rounds of runs with and without the pass, each stopping as soon as TF shows it does
# not repeat itself. A case TF does not repeat can still give every run without the
# pass one result and every run with it the other, by chance: test_generated_graphs'
# TF_NOT_REPEATABLE gave its second result in 13 of 36 runs without the pass and 16 of
# 36 with it (3 processes), so 3 rounds (4 runs each) left that chance at about 0.8 %
# a case, and 6 rounds leave it under 0.02 %. A pass whose result differs from every
# run without it still fails, however many rounds.
REPEAT_ROUNDS = 6


def _compare_with_tf_repeated(spec, fields, base, mine, difference, details):
    """The difference that stands between `mine` (with the pass) and `base` (without)
    once TF's own repeatability is known: up to REPEAT_ROUNDS more runs with and
    without the pass, until a run with the pass equals one without (no difference)
    or two runs of one graph differ (then REPEAT_ERROR_FACTOR). The difference stands
    when every run of each graph gave the same bits."""
    import tfmemopt

    plain, optimized = [base], [mine]
    for _ in range(REPEAT_ROUNDS):
        _phase("optimized run again")
        tfmemopt.enable(log_level=0, **fields)
        try:
            optimized.append(train(Model(spec)))
        finally:
            tfmemopt.disable()
        _phase("baseline again")
        plain.append(train(Model(spec)))
        if any(not first_difference(p, m) for p in plain for m in optimized):
            details["tf_not_repeatable"] = "a run with the pass equals one without"
            return ""
        for runs, against in ((plain, mine), (optimized, base)):
            spread = next((r for r in runs[1:] if first_difference(runs[0], r)), None)
            if spread is not None:
                details["tf_not_repeatable"] = first_difference(runs[0], spread)
                return repeat_difference(runs[0], against, spread)
    return difference


# ---------------------------------------------------------------------------------
# Structural checks on an optimized GraphDef

PREFIX = "TfMemOpt/"


def original_of(name, names):
    """The node a `TfMemOpt/<Mechanism>/<original>[/...]` node stands for: the
    longest leading part of <original>... that names a node of the graph, or None."""
    parts = name.split("/")[2:]
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end])
        if candidate in names:
            return candidate
    return None


def _kernel_choice_problems(graph_def, where):
    """A rewrite must leave TF's kernel choices alone: with oneDNN (TF's default on x86
    CPUs) a MaxPoolGrad whose pooled input is a swap-in instead of its MaxPool takes
    Eigen's kernel, which adds overlapping windows' gradients in another order."""
    from tensorflow.python.util import _pywrap_util_port

    if not _pywrap_util_port.IsMklEnabled():
        return []
    return [f"{where}: {n.name} (MaxPoolGrad) reads the swap-in {n.input[1]}, so it "
            f"takes Eigen's kernel instead of oneDNN's" for n in graph_def.node
            if n.op == "MaxPoolGrad" and len(n.input) > 1
            and n.input[1].startswith(PREFIX + "SwapIn/")]


def structure_problems(graph_def, where, input_names=()):
    """Invalid-graph problems, and property violations, of an optimized graph:
    (invalid, violations), lists of strings. A clone's original must be a node of
    the output, or of the input (`input_names`) when TF's own passes, running after
    ours, removed or renamed it (e.g. Relu(Relu(x)) -> Relu(x)). Split ops: see
    _split_problems."""
    from tensorflow.python.framework import op_def_registry

    invalid, violations = [], []
    nodes = {n.name: n for n in graph_def.node}
    if len(nodes) != len(graph_def.node):
        counts = {}
        for n in graph_def.node:
            counts[n.name] = counts.get(n.name, 0) + 1
        invalid.append(f"{where}: duplicate node names "
                       f"{sorted(k for k, v in counts.items() if v > 1)[:3]}")
    for n in graph_def.node:
        for i in n.input:
            if i.lstrip("^").split(":")[0] not in nodes:
                invalid.append(f"{where}: {n.name} reads missing input {i}")
    violations += _kernel_choice_problems(graph_def, where)
    # Acyclic (Kahn) over data and control edges, loop back edges aside.
    indegree = {name: 0 for name in nodes}
    readers = {name: [] for name in nodes}
    for n in graph_def.node:
        if n.op in ("Merge", "RefMerge"):
            continue  # a loop's Merge reads NextIteration: a back edge
        for i in n.input:
            src = i.lstrip("^").split(":")[0]
            if src in nodes:
                indegree[n.name] += 1
                readers[src].append(n.name)
    ready = [name for name, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        name = ready.pop()
        seen += 1
        for r in readers[name]:
            indegree[r] -= 1
            if indegree[r] == 0:
                ready.append(r)
    if seen != len(nodes) and not any(n.op == "NextIteration" for n in graph_def.node):
        invalid.append(f"{where}: the graph has a cycle")
    names = set(nodes)
    for n in graph_def.node:
        if not n.name.startswith(PREFIX):
            continue
        if n.name.startswith(PREFIX + "Split/"):
            continue  # checked below, by their own rules
        original = original_of(n.name, names)
        if original is None and original_of(n.name, set(input_names)) is None:
            violations.append(f"{where}: {n.name} has no original in the graph")
        op_def = op_def_registry.get(n.op)
        if n.name.startswith(PREFIX + "Recompute/"):
            if op_def is None or op_def.is_stateful:
                violations.append(f"{where}: stateful op {n.op} cloned as {n.name}")
            # Only the pass's own output is compared op for op: TF's passes that run
            # after it may rewrite an original, or a clone (a mismatch shows if that
            # changes results), and reuse names.
            if not input_names and original is not None and nodes[original].op != n.op:
                violations.append(f"{where}: {n.name} is a {n.op}, its original a "
                                  f"{nodes[original].op}")
    violations += _split_problems(graph_def, where)
    return invalid, violations


def _split_problems(graph_def, where):
    """A split op is replaced by its slices, TfMemOpt/Split/<op>/slice_<i>: the op is
    gone from the graph, and every split op has the same number of slices, each of
    slice_0 .. slice_<k-1>. A cut, TfMemOpt/Split/<producer>/cut_<port>_<i>, reads
    its producer, which stays."""
    import re

    names = {n.name for n in graph_def.node}
    slices, problems = {}, []
    for n in graph_def.node:
        if not n.name.startswith(PREFIX + "Split/"):
            continue
        stem, _, last = n.name[len(PREFIX + "Split/"):].rpartition("/")
        if re.fullmatch(r"slice_\d+", last):
            slices.setdefault(stem, set()).add(int(last[len("slice_"):]))
            if stem in names:
                problems.append(f"{where}: {stem} is split but still in the graph")
        elif re.fullmatch(r"cut_\d+_\d+", last):
            if stem not in names:
                problems.append(f"{where}: {n.name} cuts {stem}, which is not in the graph")
    counts = {len(indices) for indices in slices.values()}
    if len(counts) > 1:
        problems.append(f"{where}: split ops have different numbers of slices {sorted(counts)}")
    for stem, indices in slices.items():
        if indices != set(range(len(indices))):
            problems.append(f"{where}: {stem} has slices {sorted(indices)}")
    return problems


def tfmemopt_nodes(graph_def):
    return sorted(n.name for n in graph_def.node if n.name.startswith(PREFIX))


# ---------------------------------------------------------------------------------
# One case

def _optimize(metagraph, fields, alone=False):
    """Grappler's own entry point with tfmemopt: (GraphDef, the pass's report).
    alone=True runs TfMemOpt alone, once: its output exactly."""
    import tfmemopt
    from tensorflow.core.protobuf import rewriter_config_pb2
    from tensorflow.python.grappler import cluster as grappler_cluster
    from tensorflow.python.grappler import tf_optimizer

    config = tfmemopt.config_proto(log_level=0, **fields)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    if alone:
        config.graph_options.rewrite_options.optimizers.append(tfmemopt.PASS_NAME)
        config.graph_options.rewrite_options.meta_optimizer_iterations = (
            rewriter_config_pb2.RewriterConfig.ONE)
    before = len(tfmemopt.reports())
    graph = tf_optimizer.OptimizeGraph(
        config, metagraph, cluster=grappler_cluster.Cluster(disable_detailed_stats=True))
    mine = [r for r in tfmemopt.reports()[before:] if r.graph_id == "graph_to_optimize"]
    return graph, mine[-1] if mine else None


def config_fields(spec, peak_before):
    """The tfmemopt fields of a case, its budget made from the predicted peak."""
    config = spec["config"]
    ratio = config["budget_ratio"]
    budget = 1 if ratio == 0 else max(1, int(ratio * peak_before))
    fields = {"budget": budget, "min_tensor_bytes": config["min_tensor_bytes"],
              "recompute_policy": config["policy"]}
    if config.get("scopes"):
        fields["recompute_scopes"] = list(config["scopes"])
    return fields


def _budget_problems(report, fields, where, simulated_after=None):
    """A report that says the plan fits must be within the budget, and so must a
    fresh simulation of its output (simulated_after)."""
    problems = []
    if report is None:
        return [f"{where}: no report"]
    if report.status != "ok":
        return []  # counted as a fall-back
    budget = fields["budget"]
    says_fits = report.recompute.get("planned") and report.recompute.get("feasible")
    if says_fits or report.fits:
        for device, after in report.predicted_peak_bytes["after"].items():
            if after > budget:
                problems.append(f"{where}: report says it fits but the peak on {device} "
                                f"is {after} > budget {budget}")
        for device, peak in (simulated_after or {}).items():
            if peak > budget:
                problems.append(f"{where}: report says it fits but a fresh simulation of "
                                f"the output peaks at {peak} > budget {budget} on {device}")
    return problems


def _phase(name):
    """Tells the Worker what runs now, so that a crash can be placed: 'baseline'
    (training without the pass), 'optimize' or 'optimized run'."""
    if os.environ.get("TFMEMOPT_STRESS_WORKER"):
        print(f"PHASE {name}", flush=True)


def run_case(spec):
    """Checks one spec. Returns {"outcome": "ok"|"mismatch"|"invalid_graph"|
    "violation"|"fallback"|"generator_error", "problems": [...], "rewritten": bool}."""
    import tensorflow as tf
    import tfmemopt
    from tensorflow.python.eager import context
    from tfmemopt.analysis import metagraph_of

    result = {"outcome": "ok", "problems": [], "rewritten": False, "details": {}}
    tfmemopt.disable()
    tfmemopt.clear_reports()
    _phase("baseline")
    try:
        base = train(Model(spec))
    except Exception:  # the generator built something TF rejects: our bug, not the pass's
        result.update(outcome="generator_error", problems=[traceback.format_exc(limit=3)])
        return result

    _phase("optimize")
    # The budget, from the pass's own prediction for this step.
    probe = Model(spec)
    concrete = probe.step_function().get_concrete_function()
    metagraph = metagraph_of(concrete)
    peak = tfmemopt.analyze_metagraph(metagraph, mode="ANALYZE_ONLY")
    peak_before = max(peak.predicted_peak_bytes["before"].values() or [0])
    fields = config_fields(spec, peak_before)
    result["details"].update(peak_before=peak_before, fields=fields)

    invalid, violations, fallbacks = [], [], []
    input_names = {n.name for n in metagraph.graph_def.node}
    clones = []
    # Structure, through Grappler's entry point: the pass alone (its own output),
    # then as TF runs it (TF's passes first, two iterations).
    for alone in (True, False):
        where = "TfMemOpt alone" if alone else "OptimizeGraph"
        graph, report = _optimize(metagraph, fields, alone=alone)
        bad, viol = structure_problems(graph, where, () if alone else input_names)
        if report is not None and report.split_ops:
            result["details"]["split"] = report.split.get("slices")
        invalid += bad
        violations += viol
        if report is None or report.status != "ok":
            fallbacks.append(f"{where}: fallback in stage "
                             f"{report.failed_stage if report else '?'}: "
                             f"{report.message if report else 'no report'}")
        added_here = tfmemopt_nodes(graph)
        clones += added_here
        # A second, fresh pass over the output adds nothing; its simulation of the
        # output is an independent check of the budget claim.
        again_meta = tf.compat.v1.MetaGraphDef()
        again_meta.CopyFrom(metagraph)
        again_meta.graph_def.CopyFrom(graph)
        again, report2 = _optimize(again_meta, fields, alone=alone)
        # Through the whole meta-optimizer, TF's own passes rewrite the output again
        # before ours sees it (they are not idempotent: seed 82's peak drops from
        # 231,036 to 207,940 bytes), so a graph the first trip left alone is a new
        # graph there and may be planned. What must hold is that nothing is added
        # twice: a graph holding our nodes gets no more, and keeps them.
        must_stay = alone or bool(added_here)
        again_nodes = tfmemopt_nodes(again)
        if must_stay and again_nodes != added_here:
            added = sorted(set(again_nodes) - set(added_here))
            removed = sorted(set(added_here) - set(again_nodes))
            violations.append(f"{where}: a second pass changed the TfMemOpt nodes: added "
                              f"{added[:5]} ({len(added)}), removed {removed[:5]} "
                              f"({len(removed)})")
        if must_stay and report2 is not None and report2.graph_changed:
            violations.append(f"{where}: a second pass reports graph_changed")
        # The independent check of the budget claim analyzes this output as it is:
        # the pass alone, analysis only. (The second pass above, through the whole
        # meta-optimizer, sees the output after TF's passes have rewritten it again,
        # which is not the graph the claim is about.)
        simulated = None
        if added_here:
            _, fresh = _optimize(again_meta, {**fields, "mode": "ANALYZE_ONLY"}, alone=True)
            simulated = fresh.predicted_peak_bytes["before"] if fresh is not None else None
        violations += _budget_problems(report, fields, where, simulated)
    result["details"]["clones"] = len(clones)

    # Training with tfmemopt enabled: the graph TF really runs.
    _phase("optimized run")
    tfmemopt.enable(log_level=0, **fields)
    ctx = context.context()
    ctx.enable_graph_collection()
    try:
        mine = train(Model(spec))
    except Exception as err:
        invalid.append(f"the optimized step failed to run: {type(err).__name__}: "
                       f"{str(err)[:500]}")
        mine = None
    finally:
        metadata = ctx.export_run_metadata()
        ctx.disable_graph_collection()
        tfmemopt.disable()
    runtime = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")]
    split = any(r.split_ops for r in runtime)
    result["split"] = split
    # Split through batch statistics (a mean over the batch whose gradient is spread
    # back over it: batch_center blocks, the loss's mean), used only when no other
    # split fits.
    result["split_through_batch_statistics"] = any(
        r.split_ops and r.split.get("through_batch_statistics") for r in runtime)
    for r in runtime:
        if r.status != "ok":
            fallbacks.append(f"runtime: fallback in stage {r.failed_stage}: {r.message}")
        violations += _budget_problems(r, fields, "runtime")
    ran = 0
    for function in (metadata.function_graphs if metadata else []):
        post = function.post_optimization_graph
        if not any(n.name.startswith("gradient_tape/") for n in post.node):
            continue  # an eager op's own small function, not the train step
        ran += len(tfmemopt_nodes(post))
        pre = {n.name for n in function.pre_optimization_graph.node}
        bad, viol = structure_problems(post, "runtime", pre)
        invalid += bad
        violations += viol
    result["details"]["runtime_tfmemopt_nodes"] = ran
    result["rewritten"] = bool(clones) or ran > 0
    if mine is not None:
        difference = first_difference(base, mine)
        if difference and split:
            # The yardstick for a split's rounding: the same model in float64,
            # without the pass (SPLIT_ERROR_FACTOR).
            _phase("reference")
            try:
                reference = train(Model(spec, dtype="float64"))
            except Exception:  # the generator's float64 model: our bug, not the pass's
                result.update(outcome="generator_error", problems=[
                    "the float64 reference failed: " + traceback.format_exc(limit=3)])
                reference, difference = None, ""
            if reference is not None:
                difference = first_difference(base, mine, reference)
                result["details"]["split_error"] = worst_split_error(base, mine, reference)
        if difference and not split:
            difference = _compare_with_tf_repeated(spec, fields, base, mine, difference,
                                                   result["details"])
        if difference:
            result["problems"].append(f"results differ: {difference}")
            result["outcome"] = "mismatch"
    if invalid:
        result["problems"] += invalid
        result["outcome"] = "invalid_graph"
    elif violations and result["outcome"] == "ok":
        result["outcome"] = "violation"
    result["problems"] += violations
    if fallbacks:
        result["problems"] += fallbacks
        if result["outcome"] == "ok":
            result["outcome"] = "fallback"
    tfmemopt.clear_reports()
    return result


# ---------------------------------------------------------------------------------
# Worker processes

def worker_main():
    """Reads one JSON spec per line from stdin, writes one 'RESULT <json>' line each."""
    import tensorflow as tf

    # TF itself is nondeterministic run to run with several inter-op threads; the
    # bitwise comparisons need one.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        if spec.get("abort_worker"):  # lets tests check that a dead worker is counted
            os.abort()
        start = time.time()
        try:
            result = run_case(spec)
        except Exception:
            result = {"outcome": "error", "problems": [traceback.format_exc(limit=6)],
                      "rewritten": False, "details": {}}
        result["seconds"] = round(time.time() - start, 3)
        print("RESULT " + json.dumps(result, default=str), flush=True)


class WorkerDied(Exception):
    """The worker died on a case; `phase` is where ('baseline': TF crashed while the
    pass had not run)."""

    def __init__(self, message, phase="start"):
        super().__init__(message)
        self.phase = phase


class Worker:
    """One worker process (`python generated_graphs.py --worker`), restarted after a
    crash or every `recycle` cases (memory)."""

    def __init__(self, recycle=60, env=None):
        self.recycle, self.env, self.proc, self.done = recycle, env, None, 0
        self.phase = "start"
        self.stderr_path = None

    def _start(self):
        import tempfile

        full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFMEMOPT_STRESS_WORKER="1")
        full_env.update(self.env or {})
        self.stderr_file = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr_file, text=True, env=full_env,
            cwd=HERE)
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            raise WorkerDied(f"worker failed to start: {line!r} {self._stderr_tail()}")
        self.done = 0

    def _stderr_tail(self):
        try:
            self.stderr_file.seek(0)
            return self.stderr_file.read()[-2000:]
        except Exception:
            return ""

    def run(self, spec, timeout=600):
        """The case's result dict; raises WorkerDied if the process died on it."""
        if self.proc is None or self.proc.poll() is not None or self.done >= self.recycle:
            self.close()
            self._start()
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        deadline = time.time() + timeout
        self.phase = "start"
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0, deadline - time.time()))
            if not ready:
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                raise WorkerDied(f"worker hung on this case for {timeout} s in phase "
                                 f"{self.phase} (killed)", self.phase)
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                tail = self._stderr_tail()
                self.proc = None
                raise WorkerDied(f"worker exited with {code} on this case in phase {self.phase}"
                                 f"; stderr tail:\n{tail}", self.phase)
            if line.startswith("PHASE "):
                self.phase = line[len("PHASE "):].strip()
            if line.startswith("RESULT "):
                self.done += 1
                return json.loads(line[len("RESULT "):])

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
    elif len(sys.argv) == 3 and sys.argv[1] == "--replay":
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(1)
        print(json.dumps(run_case(json.loads(sys.argv[2])), indent=1, default=str))
    else:
        sys.exit("usage: generated_graphs.py --worker | --replay SPEC_JSON")
