"""Result files: what a benchmark measured, with the command, commit and machine.

    python benchmarks/results.py run NAME [ARGS...]

runs `python benchmarks/NAME.py ARGS --json`, shows its output, and writes the JSON
object it prints last to docs/results/NAME.json (a benchmark may also call save()
itself, e.g. under a --save flag). A run whose log is kept (its JSON line last) can be
recorded afterwards, naming the command and the commit it ran:

    python benchmarks/results.py import NAME LOG --command "python benchmarks/..." --commit abc1234

The file:

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


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or platform.processor()'s answer."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine():
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port

    # Which kernels ran matters to memory figures: TF 2.21 turns oneDNN on only on CPUs
    # with AVX-512 VNNI/BF16 or AMX (or with TF_ENABLE_ONEDNN_OPTS=1), and Eigen's
    # convolutions allocate other scratch (docs/allocator.md).
    return {"cpus": os.cpu_count(), "system": platform.system(), "cpu": cpu_model(),
            "onednn": bool(_pywrap_util_port.IsMklEnabled()),
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


def last_json(text):
    """The JSON object on the last line of `text` that holds one, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _path(args):
    return os.path.join(RESULTS, f"{args.file_name}.json") if args.file_name else None


def main():
    import argparse

    parser = argparse.ArgumentParser(description="Record a benchmark's result file.")
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="run benchmarks/NAME.py ARGS --json and record it")
    run.add_argument("--as", dest="file_name", metavar="FILE_NAME",
                     help="record docs/results/FILE_NAME.json instead of NAME.json (one "
                          "benchmark, several settings)")
    run.add_argument("name")
    run.add_argument("args", nargs=argparse.REMAINDER)
    imp = sub.add_parser("import", help="record the last JSON line of a kept log")
    imp.add_argument("name")
    imp.add_argument("log")
    imp.add_argument("--command", required=True)
    imp.add_argument("--commit", required=True)
    imp.add_argument("--as", dest="file_name", metavar="FILE_NAME",
                     help="record docs/results/FILE_NAME.json instead of NAME.json")
    args = parser.parse_args()
    if args.verb == "run":
        argv = list(args.args)
        if "--json" not in argv:
            argv.append("--json")
        script = os.path.join(ROOT, "benchmarks", f"{args.name}.py")
        if not os.path.exists(script):
            parser.error(f"no benchmark {script}")
        proc = subprocess.run([sys.executable, script, *argv], stdout=subprocess.PIPE, text=True)
        sys.stdout.write(proc.stdout)
        result = last_json(proc.stdout)
        if proc.returncode != 0 or result is None:
            print(f"results: {args.name} exited {proc.returncode} without a JSON result; "
                  "nothing recorded", file=sys.stderr)
            return 1
        print("results: wrote", save(args.name, result, argv, path=_path(args)))
        return 0
    with open(args.log) as f:
        result = last_json(f.read())
    if result is None:
        print(f"results: {args.log} has no JSON line", file=sys.stderr)
        return 1
    path = save(args.name, result, path=_path(args))
    with open(path) as f:
        record = json.load(f)
    record["command"], record["commit"] = args.command, args.commit
    record["imported_from_log"] = os.path.basename(args.log)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    print("results: wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
