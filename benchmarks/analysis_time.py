"""How long the TfMemOpt pass takes on deep training graphs, from its own report.

Builds an n-layer MLP train step (GradientTape + Adam) per depth, traces it with the
pass enabled in ANALYZE_ONLY mode, and reads the pass's wall time and the graph's
size from the report. Usage: python benchmarks/analysis_time.py [--depths 10 100 400] [--json]
"""

import argparse
import json

import tensorflow as tf

import tfmemopt


def deep_mlp_step(depth, width=64, batch=32):
    tf.keras.utils.set_random_seed(0)
    layers = [tf.keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    model = tf.keras.Sequential([tf.keras.Input((width,))] + layers + [tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.Adam()

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step, tf.ones([batch, width])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[10, 100, 400])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tfmemopt.enable(mode="ANALYZE_ONLY", log_level=0)
    rows = []
    for depth in args.depths:
        tfmemopt.clear_reports()
        step, x = deep_mlp_step(depth)
        step(x)
        report = [r for r in tfmemopt.reports() if r.graph_id.startswith("__inference_train_step")][-1]
        rows.append({"depth": depth, "nodes": report.num_nodes,
                     "pass_seconds": report.total_seconds,
                     "predicted_peak_bytes": report.predicted_peak_bytes["before"]["CPU:0"]})
    print(f"{'depth':>6} | {'nodes':>7} | {'pass ms':>8} | predicted peak")
    for row in rows:
        print(f"{row['depth']:>6} | {row['nodes']:>7} | {row['pass_seconds'] * 1000:>8.1f} | "
              f"{row['predicted_peak_bytes'] / 2**20:.1f} MiB")
    if args.json:
        print(json.dumps({"runs": rows}))


if __name__ == "__main__":
    main()
