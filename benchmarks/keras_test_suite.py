"""Keras's own test suite with tfmemopt on: does the pass change any test's outcome?

Runs tests of the installed Keras package (its wheel ships them under keras/src)
twice, in fresh pytest processes on the TensorFlow backend: plain, and with
`-p tfmemopt.pytest_plugin`, which calls tfmemopt.enable() before the suite starts,
so every graph a test builds (tf.function, fit, evaluate, predict, saved models,
tf.distribute) is planned and rewritten as in a user's script. With the default
budget of one byte no graph fits, so the planner takes off the device everything its
mechanisms can (swap, recompute, split, at any tensor size) and every rewrite the
suite's graphs allow is made. Per test, the two outcomes are compared (from
pytest's JUnit XML). A test that passes plain and fails with tfmemopt is run again
alone, both ways, to tell a failure tfmemopt causes from a flaky test.

A test module that cannot be imported here (it needs JAX, PyTorch, Grain, ...) fails
the same way in both runs and is counted in failed_both.

Usage: python benchmarks/keras_test_suite.py [--paths DIR ...] [--budget 1]
           [--field NAME=VALUE ...] [--workers 2] [--json]
--paths are relative to the installed keras/src (default: DEFAULT_PATHS).
With --json the last line is {"tests": N, "passed_plain": N, "passed_tfmemopt": N,
"failed_both": N, "broken_by_tfmemopt": [...], "flaky": [...], "fixed_by_tfmemopt": [...],
"graphs": N, "changed": N, "swapped_tensors": N, "recomputed_ops": N,
"split_graphs": N, "fallbacks": N, "fallback_messages": [...], ...}.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

DEFAULT_PATHS = [
    "models", "trainers", "callbacks", "optimizers", "losses", "metrics", "saving",
    "export", "backend/tensorflow", "layers/core", "layers/convolutional",
    "layers/pooling", "layers/normalization", "layers/attention", "layers/rnn",
    "layers/merging", "layers/regularization", "distillation", "applications",
]
RERUN_LIMIT = 20


def keras_root():
    """site-packages (pytest's rootdir) and the installed keras/src."""
    import keras

    src = os.path.join(os.path.dirname(os.path.abspath(keras.__file__)), "src")
    return os.path.dirname(os.path.dirname(src)), src


def outcomes(junit_path):
    """{test id: 'passed' | 'failed' | 'skipped'} from pytest's JUnit XML."""
    result = {}
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            result[test] = "failed"
        elif "skipped" in kinds:
            result[test] = result.get(test, "skipped")
        else:
            result[test] = "passed"
    return result


def run_pytest(targets, plugin_args, workers, workdir, tag):
    """One pytest process over `targets`; returns (outcomes, seconds, summary or None)."""
    root, _ = keras_root()
    junit = os.path.join(workdir, f"{tag}.xml")
    summary = os.path.join(workdir, f"{tag}.summary")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if workers > 1:
        command += ["-n", str(workers)]
    if plugin_args is not None:
        command += ["-p", "tfmemopt.pytest_plugin", f"--tfmemopt-summary={summary}",
                    *plugin_args]
    command += targets
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - start
    tail = proc.stdout.strip().splitlines()[-3:]
    print(f"  {tag}: exit {proc.returncode} in {seconds:.0f} s: {' | '.join(tail)}", flush=True)
    if not os.path.exists(junit):
        raise RuntimeError(f"pytest wrote no JUnit XML ({tag}):\n{proc.stdout[-3000:]}")
    total = None
    if plugin_args is not None and os.path.exists(summary):
        with open(summary) as f:
            records = [json.loads(line) for line in f if line.strip()]
        total = next((r for r in records if r["process"] != "worker"), None)
    return outcomes(junit), seconds, total


def node_id(test):
    """JUnit's 'keras.src.x.y_test.Class::name' as a pytest node id."""
    module_and_class, name = test.split("::")
    parts = module_and_class.split(".")
    for cut in range(len(parts), 0, -1):
        path = os.path.join(*parts[:cut]) + ".py"
        if os.path.exists(os.path.join(keras_root()[0], path)):
            return "::".join([path, *parts[cut:], name])
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=DEFAULT_PATHS,
                        help="test directories or files, relative to keras/src")
    parser.add_argument("--budget", default="1",
                        help="enable()'s budget (default: 1 byte, which no graph meets)")
    parser.add_argument("--field", action="append", default=[], metavar="NAME=VALUE",
                        help="a MemoryOptimizerConfig field for the tfmemopt run")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import keras

    _, src = keras_root()
    targets = [os.path.relpath(os.path.join(src, p), keras_root()[0]) for p in args.paths]
    missing = [t for t in targets if not os.path.exists(os.path.join(keras_root()[0], t))]
    if missing:
        parser.error(f"not in the installed Keras {keras.__version__}: {missing}")
    plugin_args = [f"--tfmemopt-budget={args.budget}"] + [
        f"--tfmemopt-field={field}" for field in args.field]
    print(f"keras_test_suite: Keras {keras.__version__}, {len(targets)} paths, budget "
          f"{args.budget}, fields {args.field or 'none'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="keras_suite_") as workdir:
        plain, plain_seconds, _ = run_pytest(targets, None, args.workers, workdir, "plain")
        planned, planned_seconds, summary = run_pytest(
            targets, plugin_args, args.workers, workdir, "tfmemopt")
        tests = sorted(set(plain) | set(planned))
        broken = [t for t in tests if plain.get(t) == "passed" and planned.get(t) == "failed"]
        fixed = [t for t in tests if plain.get(t) == "failed" and planned.get(t) == "passed"]
        # A test tfmemopt seems to break is run alone, both ways: a failure that
        # repeats only with tfmemopt is tfmemopt's.
        confirmed, flaky = [], []
        for i, test in enumerate(broken[:RERUN_LIMIT]):
            node = node_id(test)
            if node is None:
                confirmed.append(test)
                continue
            again_plain, _, _ = run_pytest([node], None, 1, workdir, f"plain_rerun{i}")
            again, _, _ = run_pytest([node], plugin_args, 1, workdir, f"tfmemopt_rerun{i}")
            repeats = (set(again_plain.values()) == {"passed"}
                       and "failed" in set(again.values()))
            (confirmed if repeats else flaky).append(test)
        confirmed += broken[RERUN_LIMIT:]

    def count(results, outcome):
        return sum(1 for t in tests if results.get(t) == outcome)

    failed_both = sum(1 for t in tests if plain.get(t) == "failed" and planned.get(t) == "failed")
    summary = summary or {}
    result = {
        "keras": keras.__version__,
        "paths": args.paths,
        "budget": args.budget,
        "fields": args.field,
        "tests": len(tests),
        "passed_plain": count(plain, "passed"),
        "passed_tfmemopt": count(planned, "passed"),
        "skipped_plain": count(plain, "skipped"),
        "failed_both": failed_both,
        "broken_by_tfmemopt": confirmed,
        "flaky": flaky,
        "fixed_by_tfmemopt": fixed,
        "seconds_plain": round(plain_seconds, 1),
        "seconds_tfmemopt": round(planned_seconds, 1),
        **{key: summary.get(key) for key in (
            "graphs", "changed", "swapped_tensors", "recomputed_ops", "split_graphs",
            "fallbacks", "fallback_messages")},
    }
    print(f"\n{result['tests']} tests: {result['passed_plain']} pass plain, "
          f"{result['passed_tfmemopt']} with tfmemopt, {failed_both} fail both ways; "
          f"broken by tfmemopt: {len(confirmed)}, flaky: {len(flaky)}")
    print(f"the pass planned {result['graphs']} graphs, changed {result['changed']} "
          f"({result['swapped_tensors']} tensors swapped, {result['recomputed_ops']} ops "
          f"recomputed, {result['split_graphs']} split), fell back on {result['fallbacks']}")
    for test in confirmed:
        print(f"  BROKEN: {test}")
    for message in result["fallback_messages"] or []:
        print(f"  fall-back: {message}")
    if args.json:
        print(json.dumps(result))
    return 1 if confirmed or result["fallbacks"] else 0


if __name__ == "__main__":
    sys.exit(main())
