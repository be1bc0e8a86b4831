"""Result files: what a benchmark measured, with the command, commit and machine.

A benchmark run with `--save` writes docs/results/NAME.json:

    {"benchmark": NAME, "command": "python benchmarks/NAME.py ARGS",
     "commit": "abc1234" (+ "-dirty" when the tree had uncommitted changes),
     "date": "2026-11-24", "machine": {...}, "result": <the benchmark's JSON>}

tools/gen_docs.py renders the tables of docs/benchmarks.md and the README from these
files, and tests/test_docs.py fails when a table and its file disagree: no figure in
the docs is typed by hand.
"""

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit():
    """The checkout's commit (short), with '-dirty' if tracked files are modified."""
    head = _git("rev-parse", "--short=7", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


def machine():
    import tensorflow as tf

    return {"cpus": os.cpu_count(), "system": platform.system(),
            "python": platform.python_version(), "tensorflow": tf.__version__,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def save(name, result, argv=None, path=None):
    """Writes `result` (a benchmark's JSON object) to docs/results/NAME.json (or `path`)
    with its command line (`argv`, default sys.argv[1:] without --save), commit, date and
    machine. Returns the path."""
    if argv is None:
        argv = [a for a in sys.argv[1:] if a != "--save" and not a.startswith("--save=")]
    record = {
        "benchmark": name,
        "command": " ".join(["python", f"benchmarks/{name}.py", *map(shlex.quote, argv)]),
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "result": result,
    }
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def load(name):
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)
