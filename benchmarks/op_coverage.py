"""Ops outside the models' usual vocabulary, planned under tight budgets: no crash, and
the same results as without tfmemopt.

Each case is a small training step (a tf.function returning its loss and gradients)
around ops that benchmarks/models.py and the generated graphs of tests/ do not use:
tf.py_function, tf.print with stateful dropout, ragged tensors, a sparse embedding
gradient (IndexedSlices), sparse-dense matmul, complex FFTs, Cholesky and SVD, v2
while/cond, map_fn and scan, vectorized_map, tf.custom_gradient with
tf.recompute_grad, float16 and bfloat16, strings and bincount, image resizing and
depth_to_space, CTC loss, segment sums with scatters, einsum with top_k and sort.

For each case and each --ratios value, in a fresh process: the step runs twice
without tfmemopt (twice, to know whether TF repeats itself), then twice on a fresh trace
with tfmemopt.enable(budget=ratio x the step's predicted peak, min_tensor_bytes=256).
A row is "bitwise" when the outputs are equal bit for bit; where the plan split ops
along the batch (which changes the order of the weight gradients' sums, and is used
only when nothing else meets the budget) the largest difference relative to each
tensor's norm is given instead, against SPLIT_RTOL. A mismatch is a row that is neither
bitwise nor (split and within SPLIT_RTOL) while TF repeats itself; a crash is a step
that raised.

Usage: python benchmarks/op_coverage.py [--cases NAME ...] [--ratios 0.95 0.8 0.5] [--json]
With --json the last line is {"cases", "runs", "crashes", "mismatches", "fallbacks",
"split_runs", "max_split_error", "rows": [...]}.
"""

import argparse
import json
import os
import subprocess
import sys

N = 64
SPLIT_RTOL = 1e-5  # tests/generated_graphs.SPLIT_RTOL
CASES = ["py_function", "print_and_stateful_random", "ragged", "sparse_embedding",
         "sparse_matmul", "complex_fft", "linalg", "while_and_cond", "map_fn_scan",
         "vectorized_map", "custom_gradient_recompute_grad", "float16_bfloat16",
         "strings_and_ints", "image_ops", "ctc", "scatter_gather_segment",
         "einsum_topk_sort"]


def make(case):
    """(step function (python), args) ; step returns a nest of tensors."""
    import numpy as np
    import tensorflow as tf

    g = tf.random.Generator.from_seed(1)
    x = g.normal([N, 96])
    w = tf.Variable(g.normal([96, 96]) * 0.1, name="w")
    w2 = tf.Variable(g.normal([96, 96]) * 0.1, name="w2")

    def grads(loss_fn):
        def step(x):
            with tf.GradientTape() as tape:
                loss = loss_fn(x)
            return loss, tape.gradient(loss, [w, w2])
        return step

    if case == "py_function":
        def f(x):
            h = tf.tanh(x @ w)
            h2 = tf.py_function(lambda a: a * 2.0, [h], tf.float32)
            h2.set_shape(h.shape)
            return tf.reduce_sum(tf.tanh(h2 @ w2) * h)
        return grads(f), [x]
    if case == "print_and_stateful_random":
        def f(x):
            h = tf.tanh(x @ w)
            tf.print("mean", tf.reduce_mean(h), output_stream=sys.stderr)
            d = tf.nn.dropout(h, 0.3, seed=5)
            return tf.reduce_sum(tf.tanh(d @ w2) * h)
        return grads(f), [x]
    if case == "ragged":
        rows = tf.constant([0, 3, 5, 5, 9] + list(range(10, 10 + N - 4)), tf.int64)
        def f(x):
            h = tf.tanh(x @ w)
            flat = tf.reshape(h, [-1])[: N * 4]
            rt = tf.RaggedTensor.from_row_splits(flat, tf.concat([rows[:N - 5] * 4 // 4, [N * 4]], 0))
            return tf.reduce_sum(tf.reduce_sum(rt, axis=1) ** 2) + tf.reduce_sum(tf.tanh(h @ w2))
        return grads(f), [x]
    if case == "sparse_embedding":
        emb = tf.Variable(g.normal([1000, 96]) * 0.1, name="emb")
        ids = tf.constant(np.random.default_rng(0).integers(0, 1000, size=(N, 20)), tf.int64)
        def step(x):
            with tf.GradientTape() as tape:
                e = tf.nn.embedding_lookup(emb, ids)
                h = tf.tanh(tf.reduce_mean(e, 1) @ w + x)
                loss = tf.reduce_sum(tf.tanh(h @ w2))
            ge, gw, gw2 = tape.gradient(loss, [emb, w, w2])
            return loss, tf.convert_to_tensor(ge), gw, gw2
        return step, [x]
    if case == "sparse_matmul":
        idx = np.stack([np.arange(N) % N, (np.arange(N) * 7) % 96], 1)
        def f(x):
            sp = tf.sparse.SparseTensor(idx, tf.reduce_sum(x, 1), [N, 96])
            h = tf.tanh(tf.sparse.sparse_dense_matmul(sp, w) + x @ w)
            return tf.reduce_sum(tf.tanh(h @ w2))
        return grads(f), [x]
    if case == "complex_fft":
        def f(x):
            h = tf.tanh(x @ w)
            c = tf.signal.rfft(h)
            h2 = tf.signal.irfft(c * tf.cast(tf.abs(c) > 0.1, c.dtype), [96])
            return tf.reduce_sum(tf.tanh(h2 @ w2) * h)
        return grads(f), [x]
    if case == "linalg":
        def f(x):
            h = tf.tanh(x @ w)
            a = tf.matmul(h, h, transpose_a=True) / N + tf.eye(96)
            ch = tf.linalg.cholesky(a)
            s = tf.linalg.svd(h @ w2, compute_uv=False)
            return tf.reduce_sum(tf.linalg.diag_part(ch)) + tf.reduce_sum(s)
        return grads(f), [x]
    if case == "while_and_cond":
        def f(x):
            h = tf.tanh(x @ w)
            def body(i, a):
                a = tf.cond(i % 2 == 0, lambda: tf.tanh(a @ w2), lambda: tf.sin(a @ w2))
                return i + 1, a
            _, h = tf.while_loop(lambda i, a: i < 5, body, [0, h])
            return tf.reduce_sum(h ** 2)
        return grads(f), [x]
    if case == "map_fn_scan":
        def f(x):
            h = tf.tanh(x @ w)
            m = tf.map_fn(lambda r: tf.tanh(tf.tensordot(r, w2, 1)), h)
            s = tf.scan(lambda a, r: a * 0.5 + r, m)
            return tf.reduce_sum(s ** 2)
        return grads(f), [x]
    if case == "vectorized_map":
        def f(x):
            h = tf.tanh(x @ w)
            m = tf.vectorized_map(lambda r: tf.tanh(tf.linalg.matvec(w2, r)), h)
            return tf.reduce_sum(m ** 2)
        return grads(f), [x]
    if case == "custom_gradient_recompute_grad":
        @tf.recompute_grad
        def block(h):
            return tf.tanh(h @ w2)
        @tf.custom_gradient
        def clip(h):
            return tf.identity(h), lambda dy: tf.clip_by_value(dy, -0.01, 0.01)
        def f(x):
            h = tf.tanh(x @ w)
            return tf.reduce_sum(clip(block(h)) ** 2)
        return grads(f), [x]
    if case == "float16_bfloat16":
        def f(x):
            h = tf.cast(tf.tanh(x @ w), tf.float16)
            h = tf.tanh(h @ tf.cast(w2, tf.float16))
            b = tf.cast(h, tf.bfloat16)
            b = tf.nn.relu(b @ tf.cast(w2, tf.bfloat16))
            return tf.reduce_sum(tf.cast(b, tf.float32) ** 2)
        return grads(f), [x]
    if case == "strings_and_ints":
        words = tf.constant(["a b", "c d e", "f"] * (N // 3) + ["g"] * (N % 3))
        def f(x):
            n = tf.strings.length(tf.strings.regex_replace(words, " ", ""))
            k = tf.cast(tf.math.bincount(tf.cast(n, tf.int32), minlength=8), tf.float32)
            h = tf.tanh(x @ w) * tf.cast(n, tf.float32)[:, None]
            return tf.reduce_sum(tf.tanh(h @ w2)) + tf.reduce_sum(k)
        return grads(f), [x]
    if case == "image_ops":
        img = g.uniform([N // 4, 32, 32, 3])
        k1 = tf.Variable(g.normal([3, 3, 3, 16]) * 0.1)
        def step(x):
            with tf.GradientTape() as tape:
                a = tf.nn.conv2d(img, k1, 1, "SAME")
                a = tf.image.resize(a, [48, 48], method="bilinear")
                a = tf.nn.max_pool2d(tf.nn.relu(a), 3, 2, "SAME")
                a = tf.nn.depth_to_space(a, 2)
                a = tf.image.crop_to_bounding_box(a, 2, 2, 40, 40)
                loss = tf.reduce_sum(a ** 2)
            return loss, tape.gradient(loss, [k1])
        return step, [x]
    if case == "ctc":
        T, C = 30, 12
        labels = tf.constant(np.random.default_rng(1).integers(1, C, size=(N, 8)), tf.int32)
        wc = tf.Variable(g.normal([96, T * C]) * 0.1)
        def step(x):
            with tf.GradientTape() as tape:
                logits = tf.reshape(tf.tanh(x @ w) @ wc, [N, T, C])
                loss = tf.reduce_mean(tf.nn.ctc_loss(labels, logits, tf.fill([N], 8),
                                                     tf.fill([N], T), logits_time_major=False,
                                                     blank_index=0))
            return loss, tape.gradient(loss, [w, wc])
        return step, [x]
    if case == "scatter_gather_segment":
        seg = tf.constant(np.arange(N) // 4, tf.int32)
        def f(x):
            h = tf.tanh(x @ w)
            s = tf.math.segment_sum(h, seg)
            g2 = tf.gather(s, seg)
            sc = tf.tensor_scatter_nd_add(h, tf.constant([[0], [3]]), g2[:2])
            return tf.reduce_sum(tf.tanh(sc @ w2) * g2)
        return grads(f), [x]
    if case == "einsum_topk_sort":
        def f(x):
            h = tf.tanh(tf.einsum("bi,ij->bj", x, w))
            v, i = tf.math.top_k(h, 8)
            srt = tf.sort(h, axis=1)
            return tf.reduce_sum(v ** 2) + tf.reduce_sum(tf.tanh(srt @ w2))
        return grads(f), [x]
    raise SystemExit(f"unknown case {case}")


def child(case, ratio):
    import numpy as np
    import tensorflow as tf
    import tfmemopt

    def run(budget=None):
        step_fn, args = make(case)
        fn = tf.function(step_fn)
        if budget is not None:
            tfmemopt.enable(budget=budget, min_tensor_bytes=256, log_level=0)
        try:
            out = [fn(*args) for _ in range(2)]
        finally:
            tfmemopt.disable()
        return [np.asarray(t) for t in tf.nest.flatten(out)], fn, args

    def same(p, q):
        return len(p) == len(q) and all(a.dtype == b.dtype and a.shape == b.shape
                                        and a.tobytes() == b.tobytes() for a, b in zip(p, q))

    row = {"case": case, "ratio": ratio}
    plain, fn, args = run()
    row["tf_repeats"] = same(plain, run()[0])
    report = tfmemopt.analyze(fn, *args, min_tensor_bytes=256, log_level=0)
    peak = max(report.predicted_peak_bytes["before"].values())
    row["budget"] = max(1, int(ratio * peak))
    try:
        mine = run(row["budget"])[0]
    except Exception as error:  # noqa: BLE001 - a crash is what this tool counts
        row["crash"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        return row
    reports = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_step")]
    last = reports[-1]
    row.update(status=last.status, changed=last.graph_changed, fits=last.fits,
               split=bool(last.split_ops), bitwise=same(plain, mine))
    if not row["bitwise"]:
        worst = 0.0
        for a, b in zip(plain, mine):
            if a.dtype.kind == "f" or a.dtype.kind == "c":
                a64, b64 = a.astype(np.complex128), b.astype(np.complex128)
                worst = max(worst, float(np.linalg.norm(a64 - b64) /
                                         max(np.linalg.norm(a64), 1e-30)))
            elif a.tobytes() != b.tobytes():
                worst = float("inf")
        row["relative_error"] = worst
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.95, 0.8, 0.65, 0.5])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "RATIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("ROW " + json.dumps(child(args.child[0], float(args.child[1]))))
        return
    rows = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    for ratio in args.ratios:
        for case in args.cases:
            proc = subprocess.run([sys.executable, __file__, "--child", case, str(ratio)],
                                  capture_output=True, text=True, env=env, timeout=900)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("ROW ")]
            if lines:
                row = json.loads(lines[-1][4:])
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                row = {"case": case, "ratio": ratio, "crash": f"exit {proc.returncode}: {tail[:300]}"}
            rows.append(row)
            verdict = ("CRASH " + row["crash"] if "crash" in row else
                       "bitwise" if row["bitwise"] else
                       f"split, relative error {row['relative_error']:.2g}" if row["split"] else
                       f"DIFFERS (relative error {row['relative_error']:.2g})")
            print(f"{case:32s} {ratio:5.2f}  {row.get('status', '-'):8s} "
                  f"{'fits' if row.get('fits') else 'over':5s} "
                  f"{'changed' if row.get('changed') else 'same':8s} "
                  f"TF repeats: {row.get('tf_repeats')!s:5s}  {verdict}", flush=True)
    crashes = [r for r in rows if "crash" in r]
    mismatches = [r for r in rows if "crash" not in r and not r["bitwise"] and r["tf_repeats"]
                  and not (r["split"] and r["relative_error"] <= SPLIT_RTOL)]
    split_runs = [r for r in rows if r.get("split")]
    summary = {"cases": len(args.cases), "runs": len(rows), "crashes": len(crashes),
               "mismatches": len(mismatches),
               "fallbacks": sum(r.get("status") == "fallback" for r in rows),
               "split_runs": len(split_runs),
               "max_split_error": max([r.get("relative_error", 0.0) for r in split_runs] or [0.0]),
               "failing": [{k: r.get(k) for k in ("case", "ratio", "crash", "relative_error")}
                           for r in crashes + mismatches],
               "rows": rows}
    print(f"\n{summary['runs']} runs of {summary['cases']} cases: {summary['crashes']} crashes, "
          f"{summary['mismatches']} mismatches, {summary['fallbacks']} fall-backs, "
          f"{summary['split_runs']} split (largest relative error "
          f"{summary['max_split_error']:.2g}, allowed {SPLIT_RTOL:g})")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
