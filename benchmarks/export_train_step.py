"""Saves a benchmark model's train step as a SavedModel, for `tfmemopt analyze`.

Usage: python benchmarks/export_train_step.py MODEL DIR
       tfmemopt analyze DIR --plot timeline.png
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

from models import MODELS  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("directory")
    args = parser.parse_args()
    tf.keras.utils.set_random_seed(0)
    step, (x, y) = MODELS[args.model]()
    module = tf.Module()
    module.step = step
    signature = step.get_concrete_function(
        tf.TensorSpec(x.shape, x.dtype, name="x"), tf.TensorSpec(y.shape, y.dtype, name="y"))
    module.train_vars = list(signature.variables)
    tf.saved_model.save(module, args.directory, signatures={"train_step": signature})
    print(f"saved the {args.model} train step (batch {x.shape[0]}) to {args.directory}")


if __name__ == "__main__":
    main()
