"""The largest batch (or depth, or any size) that trains under a memory cap.

`find_max_batch(make_step, lo, hi, cap_mb=...)` searches the largest size in
[lo, hi] for which `make_step(size)` trains, one fresh interpreter per trial:
TF reads its allocator settings (TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB)
once at start-up, and a trial that ran out of memory leaves nothing behind.

A trial ends in one of four ways: "ok" (every step ran), "oom" (TF raised
ResourceExhaustedError, or the interpreter died right after TF's allocator logged that
it ran out of memory: see _died), "error" (any other exception, or any other death of
the interpreter) or "timeout". Only "oom" counts as "too big": anything else stops the
search with a TrialError, since it says nothing about memory.

`time_interleaved(...)` times the steps of several configurations at one size in the
same run, alternating between them, so that a change in machine load hits them all.

make_step(size, **step_kwargs) returns (step, args): `step(*args)` runs one training
step (typically a tf.function). It must be importable in a fresh interpreter: a
module-level function, or "path/to/script.py:function".

This module imports nothing from TensorFlow at module level: the parent process that
runs a search needs none, and trials import it only after their environment is set.
"""

import ast
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tfmemopt.config import MEMORY_OPTIMIZATION_LEVELS

STRATEGIES = ("bisect", "grow")
# tfmemopt.enable()'s own keywords, which a trial's fields may hold beside the config's.
ENABLE_KEYWORDS = ("fit_retries", "function_retries", "reserve_memory")
DEFAULT_TIMEOUT = 900.0

_RESULT_MARK = "TFMEMOPT_TRIAL "
_TIMES_MARK = "TFMEMOPT_TIMES "
_CHILD = "from tfmemopt.maxbatch import _child_main; _child_main()"
_STDERR_TAIL = 1500


class TrialError(RuntimeError):
    """A trial failed for a reason other than running out of memory.

    `trial` is that Trial, `result` the MaxBatchResult of the search so far.
    """

    def __init__(self, message, trial, result=None):
        super().__init__(message)
        self.trial = trial
        self.result = result


@dataclasses.dataclass
class Trial:
    """One training run at one size, in its own interpreter.

    status: "ok", "oom", "error" or "timeout". peak_bytes: the BFC allocator's peak
    over the whole trial (model, data and every step; None without a BFC allocator).
    step_seconds: the median of the steps after the first (None with one step).
    report: the tfmemopt report of the largest graph the pass saw (without its
    timeline), when tfmemopt was enabled. graphs: every graph the pass reported
    ({graph_id, num_nodes, graph_changed}; empty without tfmemopt). grappler: the
    Grappler optimizers that ran on each graph with their results, from TF's
    meta-optimizer log (only with grappler_log=True). rewrite_options: what the
    trial's tf.function calls hand to Grappler ({memory_optimization,
    custom_optimizers}), read back from the eager context after the steps.
    """

    size: int
    status: str
    seconds: float = 0.0
    peak_bytes: int = None
    step_seconds: float = None
    step_times: list = dataclasses.field(default_factory=list)
    # Each step's outputs, when they are scalars (e.g. the loss), as floats.
    outputs: list = dataclasses.field(default_factory=list)
    error: str = ""
    report: dict = None
    graphs: list = None
    config: dict = None
    rewrite_options: dict = None
    grappler: dict = None

    @property
    def ok(self):
        return self.status == "ok"

    def to_dict(self):
        return dataclasses.asdict(self)

    def brief(self):
        """The trial without its report: size, status, peak, step time, seconds, error;
        with tfmemopt, the report's graph, node count, whether the graph changed and
        the predicted peaks."""
        out = {k: getattr(self, k) for k in
               ("size", "status", "peak_bytes", "step_seconds", "seconds", "error")}
        if self.report:
            devices = self.report.get("devices", [])
            out["report"] = {
                "graph_id": self.report["graph_id"],
                "num_nodes": self.report["num_nodes"],
                "graph_changed": self.report["graph_changed"],
                "predicted_peak_before_bytes": {d["device"]: d["peak_before_bytes"] for d in devices},
                "predicted_peak_after_bytes": {d["device"]: d["peak_after_bytes"] for d in devices},
            }
        return out

    def summary(self):
        if self.status == "ok":
            peak = f"peak {self.peak_bytes / 2**20:.1f} MiB" if self.peak_bytes else "peak n/a"
            step = f", {self.step_seconds:.3f} s/step" if self.step_seconds is not None else ""
            return f"ok ({peak}{step})"
        if self.status == "oom":
            return "OOM"
        return f"{self.status.upper()}: {self.error.splitlines()[0] if self.error else ''}"


@dataclasses.dataclass
class MaxBatchResult:
    """The outcome of find_max_batch.

    max_batch: the largest size that trained (None: not even lo).
    min_failing_batch: the smallest size that ran out of memory (None: hi trained, so
    the limit is above hi). trials: every trial, in the order run.
    """

    max_batch: int
    min_failing_batch: int
    trials: list
    lo: int
    hi: int
    cap_mb: int
    config: dict
    seconds: float

    def trial(self, size):
        """The trial at `size`, or None."""
        return next((t for t in self.trials if t.size == size), None)

    def to_dict(self):
        data = dataclasses.asdict(self)
        data["trials"] = [t.to_dict() for t in self.trials]
        return data

    def brief(self):
        """to_dict() with each trial's brief() instead of its whole report."""
        data = self.to_dict()
        data["trials"] = [t.brief() for t in self.trials]
        return data


# ---------------------------------------------------------------------------
# Argument checks (in the parent, before anything runs)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tfmemopt: {name}={value!r} has type {type(value).__name__}; "
                        f"allowed: an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"tfmemopt: {name}={value}; allowed: an int >= {minimum}")


def _check_script(path, function):
    """A script and the top-level function it must define, checked without running it."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "no such file"
        raise ValueError(f"tfmemopt: make_step script {path}: {what}; allowed: a Python "
                         f"script that defines {function}(batch)")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError) as err:
        line = getattr(err, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ValueError(f"tfmemopt: make_step script {path} is not valid Python{where}: "
                         f"{getattr(err, 'msg', err)}") from None
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if function not in names:
        raise ValueError(f"tfmemopt: make_step script {path} defines no top-level "
                         f"{function!r}; allowed: a script with def {function}(batch): "
                         f"... returning (step, args)")


def step_reference(make_step):
    """How a fresh interpreter finds `make_step`: {"module", "qualname", "file"}.

    Accepts a module-level function (its module is imported by name, else loaded from
    its file: scripts run as __main__ are loaded from their path) or a string
    "path/to/script.py:function" (":make_step" is the default function).
    """
    if isinstance(make_step, str):
        path, _, function = make_step.rpartition(":")
        if not path or (not function.isidentifier() and os.path.isfile(make_step)):
            path, function = make_step, "make_step"
        if not function.isidentifier():
            raise ValueError(f"tfmemopt: make_step={make_step!r}: {function!r} is not a "
                             f"function name; allowed: 'path/to/script.py:function'")
        path = os.path.abspath(path)
        _check_script(path, function)
        return {"module": None, "qualname": function, "file": path}
    if not callable(make_step):
        raise TypeError(f"tfmemopt: make_step={make_step!r} has type "
                        f"{type(make_step).__name__}; allowed: a module-level function or "
                        f"'path/to/script.py:function'")
    module = getattr(make_step, "__module__", None)
    qualname = getattr(make_step, "__qualname__", None)
    if (not module or not qualname or "<" in qualname
            or getattr(make_step, "__self__", None) is not None):
        raise TypeError(f"tfmemopt: make_step={make_step!r} cannot be imported by a fresh "
                        f"interpreter (a lambda, nested function, bound method or "
                        f"partial); allowed: a module-level function or "
                        f"'path/to/script.py:function'")
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if module == "__main__" and not path:
        raise TypeError(f"tfmemopt: make_step={qualname} is defined in an interactive "
                        f"session; allowed: a function in a module or script file")
    return {"module": None if module == "__main__" else module, "qualname": qualname,
            "file": os.path.abspath(path) if path else None}


def _check_config(use_tfmemopt, fields, memory_optimization):
    """The trial config as JSON: {"fields": dict or None, "memory_optimization"}."""
    if not isinstance(use_tfmemopt, bool):
        raise TypeError(f"tfmemopt: use_tfmemopt={use_tfmemopt!r}; allowed: True or False")
    if not use_tfmemopt and fields:
        raise ValueError(f"tfmemopt: use_tfmemopt=False with fields "
                         f"{', '.join(sorted(fields))}; allowed: fields only with "
                         f"use_tfmemopt=True")
    if memory_optimization is not None and memory_optimization not in MEMORY_OPTIMIZATION_LEVELS:
        raise ValueError(f"tfmemopt: memory_optimization={memory_optimization!r}; allowed: "
                         f"None or one of {', '.join(MEMORY_OPTIMIZATION_LEVELS)}")
    if use_tfmemopt:
        from tfmemopt import make_config  # validates names and values, naming them

        for name in ("fit_retries", "function_retries"):
            value = fields.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tfmemopt: {name}={value!r}; allowed: an int >= 0")
        if not isinstance(fields.get("reserve_memory", False), bool):
            raise ValueError(f"tfmemopt: reserve_memory={fields['reserve_memory']!r}; "
                             f"allowed: True or False")
        make_config(**{k: v for k, v in fields.items() if k not in ENABLE_KEYWORDS})
        try:
            json.dumps(fields)
        except TypeError:
            raise TypeError(f"tfmemopt: fields {fields!r} must be JSON values (bool, int, "
                            f"float, str, lists) to reach the trial") from None
    return {"fields": dict(fields) if use_tfmemopt else None,
            "memory_optimization": memory_optimization}


def _check_common(cap_mb, steps, timeout, step_kwargs):
    if cap_mb is not None:
        _check_int("cap_mb", cap_mb, 1)
    _check_int("steps", steps, 1)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"tfmemopt: timeout={timeout!r}; allowed: seconds > 0, or None")
    step_kwargs = {} if step_kwargs is None else step_kwargs
    if not isinstance(step_kwargs, dict) or not all(isinstance(k, str) for k in step_kwargs):
        raise TypeError(f"tfmemopt: step_kwargs={step_kwargs!r}; allowed: a dict of "
                        f"keyword arguments for make_step")
    try:
        json.dumps(step_kwargs)
    except TypeError:
        raise TypeError(f"tfmemopt: step_kwargs={step_kwargs!r} must be JSON values "
                        f"to reach the trial") from None
    return step_kwargs


# ---------------------------------------------------------------------------
# Running trials


def _trial_env(cap_mb, grappler_log):
    env = dict(os.environ)
    if cap_mb is not None:
        env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(cap_mb))
    # TF's allocator warnings (level 1) tell an out-of-memory crash from another one.
    if env.get("TF_CPP_MIN_LOG_LEVEL") not in ("0", "1"):
        env["TF_CPP_MIN_LOG_LEVEL"] = "1"
    if grappler_log:
        # The meta-optimizer logs every optimizer it runs on every graph at VLOG 1.
        env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="meta_optimizer=1")
    return env


def _grappler_runs(stderr):
    """{graph id: ["optimizer: result", ...] in the order they ran}, from TF's
    meta-optimizer log, e.g. "memory_optimizer: Graph size after: 306 nodes (0), ..."."""
    runs, current = {}, None
    for line in stderr.splitlines():
        if "meta_optimizer.cc" not in line:
            continue
        text = line.split("] ", 1)[-1]
        if text.startswith("Starting optimization for grappler item: "):
            current = runs.setdefault(text.split(": ", 1)[1].strip(), [])
        elif current is not None and (": Graph size after:" in text
                                      or " did nothing." in text):
            name, _, detail = text.partition(": ")
            current.append(f"{name.split('{', 1)[0]}: {detail.strip()}")
    return runs


def _tail(text):
    text = text.strip()
    return text if len(text) <= _STDERR_TAIL else "..." + text[-_STDERR_TAIL:]


def _parse_result(stdout):
    for line in reversed(stdout.splitlines()):
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK):])
    return None


def _died(size, seconds, config, returncode, stderr):
    """The Trial of an interpreter that exited without a result.

    Seen with TF 2.21 under a capped BFC allocator: when an allocation fails, TF
    usually raises ResourceExhaustedError, but sometimes the process dies instead
    (SIGSEGV): after a tf.constant of a NumPy array that does not fit, and at times
    after a oneDNN kernel's OOM (OP_REQUIRES ... RESOURCE_EXHAUSTED) in a deep
    network. When TF's allocator logged that it ran out of memory before the
    process died, the trial counts as out of memory; any other death is an error.
    """
    signal = f" (signal {-returncode})" if returncode < 0 else ""
    oom_lines = [line.split("] ", 1)[-1].strip() for line in stderr.splitlines()
                 if "ran out of memory trying to allocate" in line
                 or "RESOURCE_EXHAUSTED" in line]
    if oom_lines:
        return Trial(size, "oom", seconds, config=config,
                     error=f"{oom_lines[-1][:300]} (then the process died with exit code "
                           f"{returncode}{signal} instead of raising ResourceExhaustedError; "
                           f"counted as out of memory)")
    return Trial(size, "error", seconds, config=config,
                 error=f"the trial's interpreter exited with code {returncode}{signal} "
                       f"without a result; stderr: {_tail(stderr)}")


def run_trial(make_step, size, cap_mb=None, steps=2, timeout=DEFAULT_TIMEOUT, *,
              use_tfmemopt=True, memory_optimization=None, step_kwargs=None,
              grappler_log=False, **fields):
    """Trains `steps` steps of make_step(size, **step_kwargs) in a fresh interpreter
    and returns its Trial. Arguments as for find_max_batch."""
    _check_int("size", size, 1)
    step_kwargs = _check_common(cap_mb, steps, timeout, step_kwargs)
    config = _check_config(use_tfmemopt, fields, memory_optimization)
    return _run(step_reference(make_step), size, cap_mb, steps, timeout, config,
                step_kwargs, grappler_log)


def _run(ref, size, cap_mb, steps, timeout, config, step_kwargs, grappler_log):
    spec = {"ref": ref, "size": size, "steps": steps, "config": config,
            "step_kwargs": step_kwargs, "serve": False}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout,
                              env=_trial_env(cap_mb, grappler_log))
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr
        return Trial(size, "timeout", time.perf_counter() - start, config=config,
                     error=f"no result within {timeout:g} s; stderr: {_tail(stderr or '')}")
    seconds = time.perf_counter() - start
    data = _parse_result(proc.stdout)
    if data is None:
        return _died(size, seconds, config, proc.returncode, proc.stderr)
    trial = Trial(size=size, seconds=seconds, config=config, **data)
    if grappler_log:
        trial.grappler = _grappler_runs(proc.stderr)
    return trial


# ---------------------------------------------------------------------------
# The search


class _Progress:
    """A text progress bar on stderr: one line per finished trial; on a terminal, the
    running trial is shown in place until it finishes."""

    def __init__(self, enabled, total, label):
        self.enabled, self.total, self.label = enabled, max(total, 1), label
        self.done = 0
        self.tty = enabled and sys.stderr.isatty()

    def _bar(self):
        width = 20
        filled = min(width, round(width * self.done / self.total))
        return f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"

    def start(self, size):
        if self.tty:
            sys.stderr.write(f"\r{self.label} {self._bar()} size {size}: running...\x1b[K")
            sys.stderr.flush()

    def finish(self, trial):
        if not self.enabled:
            return
        self.done += 1
        self.total = max(self.total, self.done)
        line = (f"{self.label} {self._bar()} size {trial.size}: {trial.summary()} "
                f"[{trial.seconds:.1f} s]")
        sys.stderr.write(("\r" + line + "\x1b[K\n") if self.tty else line + "\n")
        sys.stderr.flush()

    def set_total(self, total):
        self.total = max(total, self.done + 1)


def _bisect_trials(lo, hi):
    """Most trials a bisection of (lo, hi) can take, both ends already known."""
    return math.ceil(math.log2(hi - lo)) if hi - lo > 1 else 0


def find_max_batch(make_step, lo, hi, cap_mb=None, steps=2, timeout=DEFAULT_TIMEOUT,
                   progress=True, *, use_tfmemopt=True, memory_optimization=None,
                   strategy="bisect", step_kwargs=None, grappler_log=False, **fields):
    """The largest size in [lo, hi] at which make_step(size) trains, under a cap.

    make_step: a module-level function make_step(size, **step_kwargs) -> (step, args),
      or "path/to/script.py:function"; step(*args) is one training step.
    lo, hi: the range searched (1 <= lo <= hi).
    cap_mb: the CPU allocator cap in MiB, set in each trial as
      TF_CPU_ALLOCATOR_USE_BFC=true and TF_CPU_BFC_MEM_LIMIT_IN_MB=cap_mb; None keeps
      this environment's settings (no cap unless they set one).
    steps: training steps per trial (step time is the median after the first).
    timeout: seconds per trial (a timeout stops the search, like any non-OOM error).
    progress: a progress bar on stderr.
    use_tfmemopt: False runs the trials without tfmemopt (then no fields are allowed);
      True calls tfmemopt.enable(**fields) in each trial ({} = its defaults).
    memory_optimization: TF's built-in Grappler memory optimizer level for the trials
      (e.g. "NO_MEM_OPT", "HEURISTICS"); None leaves TF's default.
    strategy: "bisect" tries lo, then hi, then bisects; "grow" tries lo, 2*lo, 4*lo,
      ... (at most hi) until one fails, then bisects. Both assume that a size fails
      whenever a smaller one does.
    step_kwargs: extra keyword arguments for make_step (JSON values).
    grappler_log: record which Grappler optimizers ran on each graph (Trial.grappler).
    fields: tfmemopt config fields, passed to tfmemopt.enable() unchanged.

    Returns a MaxBatchResult. Raises TrialError when a trial fails for another
    reason than memory (its exception, a crash or a timeout), and ValueError or
    TypeError for bad arguments, naming the argument, its value and what is allowed.
    """
    ref = step_reference(make_step)
    _check_int("lo", lo, 1)
    _check_int("hi", hi, 1)
    if hi < lo:
        raise ValueError(f"tfmemopt: hi={hi} is below lo={lo}; allowed: 1 <= lo <= hi")
    if strategy not in STRATEGIES:
        raise ValueError(f"tfmemopt: strategy={strategy!r}; allowed: "
                         f"{', '.join(map(repr, STRATEGIES))}")
    if not isinstance(progress, bool):
        raise TypeError(f"tfmemopt: progress={progress!r}; allowed: True or False")
    step_kwargs = _check_common(cap_mb, steps, timeout, step_kwargs)
    config = _check_config(use_tfmemopt, fields, memory_optimization)

    label = "with tfmemopt" if use_tfmemopt else "without tfmemopt"
    if memory_optimization:
        label += f", {memory_optimization}"
    start = time.perf_counter()
    trials = []
    result = MaxBatchResult(None, None, trials, lo, hi, cap_mb, config, 0.0)
    grow_steps = math.ceil(math.log2(hi / lo)) if hi > lo else 0
    bar = _Progress(progress, 1 + (grow_steps if strategy == "grow" else 1)
                    + _bisect_trials(lo, hi), f"maxbatch ({label})")

    def attempt(size):
        bar.start(size)
        trial = _run(ref, size, cap_mb, steps, timeout, config, step_kwargs, grappler_log)
        trials.append(trial)
        bar.finish(trial)
        if trial.status in ("ok", "oom"):
            return trial.ok
        result.seconds = time.perf_counter() - start
        raise TrialError(f"tfmemopt: the trial at size {size} ({label}) failed with "
                         f"{trial.status}, not out of memory; search stopped: "
                         f"{trial.error}", trial, result)

    good, bad = None, None
    if not attempt(lo):
        bad = lo
    elif lo == hi:
        good = lo
    elif strategy == "bisect":
        good = lo
        if attempt(hi):
            good = hi
        else:
            bad = hi
    else:  # grow
        good, size = lo, lo
        while bad is None and size < hi:
            size = min(2 * size, hi)
            if attempt(size):
                good = size
            else:
                bad = size
        bar.set_total(len(trials) + (_bisect_trials(good, bad) if bad else 0))
    while good is not None and bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if attempt(mid):
            good = mid
        else:
            bad = mid
    result.max_batch, result.min_failing_batch = good, bad
    result.seconds = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------
# Interleaved timing


@dataclasses.dataclass
class Timing:
    """Step times of one configuration at one size, from time_interleaved."""

    name: str
    status: str
    step_times: list
    median_seconds: float = None
    peak_bytes: int = None
    error: str = ""
    report: dict = None
    graphs: list = None
    config: dict = None

    def to_dict(self):
        return dataclasses.asdict(self)

    def brief(self):
        """to_dict() without the report."""
        return {k: v for k, v in self.to_dict().items() if k != "report"}


class _Worker:
    """A trial interpreter that stays up after its first steps and runs more on request."""

    def __init__(self, name, ref, size, cap_mb, warmup, config, step_kwargs):
        self.name, self.config = name, config
        spec = {"ref": ref, "size": size, "steps": warmup, "config": config,
                "step_kwargs": step_kwargs, "serve": True}
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1,
                                     env=_trial_env(cap_mb, False))
        self.first = None
        self.times = []
        self.error = ""

    def _read(self, mark):
        for line in self.proc.stdout:
            if line.startswith(mark):
                return json.loads(line[len(mark):])
        return None

    def _died(self):
        """Status and error of a worker that died, classified as for trials."""
        self.proc.wait()
        self.stderr.seek(0)
        trial = _died(0, 0.0, self.config, self.proc.returncode, self.stderr.read())
        return trial.status, trial.error

    def ready(self):
        self.first = self._read(_RESULT_MARK)
        if self.first is None:
            status, error = self._died()
            self.first = {"status": status, "error": error}
        return self.first["status"] == "ok"

    def run(self, steps):
        try:
            self.proc.stdin.write(f"steps {steps}\n")
            self.proc.stdin.flush()
            reply = self._read(_TIMES_MARK)
        except OSError:  # the worker is gone (broken pipe)
            reply = None
        if reply is None:
            self.first["status"], self.error = self._died()
            return False
        self.times.extend(reply["times"])
        if reply["status"] != "ok":
            self.first["status"], self.error = reply["status"], reply["error"]
            return False
        return True

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()

    def timing(self):
        status = self.first["status"]
        return Timing(self.name, status, list(self.times),
                      statistics.median(self.times) if self.times and status == "ok" else None,
                      self.first.get("peak_bytes"),
                      self.error or self.first.get("error", ""), self.first.get("report"),
                      self.first.get("graphs"), self.config)


def time_interleaved(make_step, size, configs, cap_mb=None, rounds=5, steps_per_round=1,
                     warmup=2, step_kwargs=None, progress=True):
    """Step times of several configurations at one size, measured in the same run.

    configs: {name: {"fields": dict or None, "memory_optimization": str or None}};
      fields None runs without tfmemopt, {} with its defaults. Each configuration gets
      its own interpreter (as find_max_batch's trials, under the same cap), which runs
      `warmup` steps first (tracing, Grappler and first-step allocations), then
      `rounds` rounds in which every configuration in turn runs `steps_per_round`
      steps. Returns {name: Timing}; a Timing's median_seconds is the median of its
      timed steps (None if it failed: see status and error).
    """
    _check_int("size", size, 1)
    _check_int("rounds", rounds, 1)
    _check_int("steps_per_round", steps_per_round, 1)
    _check_int("warmup", warmup, 1)
    step_kwargs = _check_common(cap_mb, 1, None, step_kwargs)
    ref = step_reference(make_step)
    if not isinstance(configs, dict) or not configs:
        raise TypeError(f"tfmemopt: configs={configs!r}; allowed: a non-empty dict "
                        f"{{name: {{'fields': dict or None, 'memory_optimization': str or None}}}}")
    checked = {}
    for name, config in configs.items():
        if not isinstance(config, dict) or set(config) - {"fields", "memory_optimization"}:
            raise ValueError(f"tfmemopt: configs[{name!r}]={config!r}; allowed keys: "
                             f"'fields' (dict or None), 'memory_optimization' (str or None)")
        fields = config.get("fields")
        if fields is not None and not isinstance(fields, dict):
            raise TypeError(f"tfmemopt: configs[{name!r}]['fields']={fields!r}; allowed: "
                            f"a dict of tfmemopt fields, or None (without tfmemopt)")
        checked[name] = _check_config(fields is not None, fields or {},
                                      config.get("memory_optimization"))
    workers = []
    try:
        # One at a time: two interpreters tracing at once would slow each other down,
        # and only steps are timed.
        for name, config in checked.items():
            worker = _Worker(name, ref, size, cap_mb, warmup, config, step_kwargs)
            workers.append(worker)
            worker.ready()
            if progress:
                sys.stderr.write(f"timing size {size}: {name} ready "
                                 f"({worker.first['status']})\n")
        live = [w for w in workers if w.first["status"] == "ok"]
        for round_index in range(rounds):
            for worker in list(live):
                if not worker.run(steps_per_round):
                    live.remove(worker)
            if progress and live:
                sys.stderr.write(f"timing size {size}: round {round_index + 1}/{rounds} "
                                 + ", ".join(f"{w.name} {w.times[-1]:.3f} s" for w in live)
                                 + "\n")
        return {w.name: w.timing() for w in workers}
    finally:
        for worker in workers:
            worker.close()


# ---------------------------------------------------------------------------
# Searches and timing of several configurations, and their table


@dataclasses.dataclass
class Comparison:
    """What compare() found: a search per configuration, the timing of each at `size`
    (the baseline's largest, or a smaller one (timing_sizes) if that ran out of memory
    when timed; notes say so), and overhead[name] = t_name / t_baseline - 1 (medians; None where a
    timing failed). error: the TrialError that stopped the searches."""

    searches: dict
    baseline: str
    size: int = None
    timing: dict = dataclasses.field(default_factory=dict)
    overhead: dict = dataclasses.field(default_factory=dict)
    error: str = None
    notes: list = dataclasses.field(default_factory=list)

    def timing_text(self, size_label="batch"):
        """The timing as lines of text ("" if nothing was timed)."""
        if not self.timing:
            return ""
        rounds = max(len(t.step_times) for t in self.timing.values())
        largest = self.searches[self.baseline].max_batch
        where = (f"{self.baseline}'s largest {size_label} ({self.size})" if self.size == largest
                 else f"{size_label} {self.size}, below {self.baseline}'s largest "
                      f"({largest}), which ran out of memory when timed")
        lines = [f"  note: {note}" for note in self.notes]
        lines.insert(0, f"step time at {where}, interleaved, median of {rounds} steps each:")
        for name, t in self.timing.items():
            seconds = f"{t.median_seconds:.3f} s" if t.median_seconds is not None else "n/a"
            over = self.overhead.get(name)
            over = f" ({over * 100:+.1f} %)" if over is not None else ""
            error = f": {t.error}" if t.error else ""
            lines.append(f"  {name:<25} {seconds}{over}  {t.status}{error}")
        return "\n".join(lines)

    def max_sizes(self):
        return {name: result.max_batch for name, result in self.searches.items()}

    def brief(self):
        return {"max": self.max_sizes(), "timed_size": self.size, "overhead": self.overhead,
                "notes": self.notes,
                "searches": {n: r.brief() for n, r in self.searches.items()},
                "timing": {n: t.brief() for n, t in self.timing.items()},
                "error": self.error}


def timing_sizes(search, attempts=4):
    """The sizes to time at, in turn, until one runs without running out of memory,
    nearest the limit first: the search's largest, the next below it that trained in
    the search, and 5 %, 10 %, ... below the largest; at most `attempts`."""
    trained = sorted((t.size for t in search.trials if t.ok), reverse=True)
    if not trained:
        return []
    largest = trained[0]
    candidates = set(trained[:2]) | {int(largest * (1 - 0.05 * k)) for k in range(1, attempts)}
    return sorted((size for size in candidates if size >= 1), reverse=True)[:attempts]


def compare(make_step, lo, hi, configs, baseline, cap_mb=None, steps=2, strategy="bisect",
            step_kwargs=None, rounds=5, grappler_log=False, progress=True, timed=None,
            timing_attempts=8):
    """Searches the largest size of each configuration, then times them at the
    baseline configuration's largest size, interleaved (time_interleaved).

    configs: {name: {"fields": dict or None, "memory_optimization": str or None}} as
    for time_interleaved; baseline: one of its names; timed: the names timed against
    it (default: all). Searches stop at the first TrialError (Comparison.error says
    which); then nothing is timed. timing_attempts: how many sizes the timing tries
    (timing_sizes; 8 goes down to 0.65x the baseline's largest, since near the cap plain
    TF can train two steps of a batch and not ten of one 10 % smaller).
    """
    if baseline not in configs:
        raise ValueError(f"tfmemopt: baseline={baseline!r}; allowed: one of "
                         f"{', '.join(map(repr, configs))}")
    timed = list(configs) if timed is None else list(timed)
    unknown = [name for name in timed if name not in configs]
    if unknown:
        raise ValueError(f"tfmemopt: timed={unknown!r}; allowed: names of configs "
                         f"({', '.join(map(repr, configs))})")
    out = Comparison({}, baseline)
    for name, config in configs.items():
        fields = config.get("fields")
        try:
            out.searches[name] = find_max_batch(
                make_step, lo, hi, cap_mb=cap_mb, steps=steps, progress=progress,
                use_tfmemopt=fields is not None,
                memory_optimization=config.get("memory_optimization"), strategy=strategy,
                step_kwargs=step_kwargs, grappler_log=grappler_log, **(fields or {}))
        except TrialError as err:
            out.searches[name], out.error = err.result, f"{name}: {err}"
            return out
    timed = [baseline] + [name for name in timed if name != baseline]
    # Near the limit the peak moves with the executor's order (a search trial runs two
    # steps, a timing a dozen), so the baseline's largest size may run out of memory
    # when timed; then smaller sizes are timed instead (timing_sizes; Comparison.size
    # says which, notes say why).
    sizes = timing_sizes(out.searches[baseline], attempts=timing_attempts)
    if not sizes or len(timed) < 2:
        return out
    for size in sizes:
        out.size = size
        out.timing = time_interleaved(make_step, size, {n: configs[n] for n in timed},
                                      cap_mb=cap_mb, rounds=rounds, step_kwargs=step_kwargs,
                                      progress=progress)
        oom = [n for n, t in out.timing.items() if t.status == "oom"]
        if not oom:
            break
        out.notes.append(f"timing at size {size}: {', '.join(oom)} ran out of memory")
    base = out.timing[baseline].median_seconds
    for name, timing in out.timing.items():
        if name != baseline:
            out.overhead[name] = (timing.median_seconds / base - 1
                                  if base and timing.median_seconds is not None else None)
    return out


def table(searches, size_label="batch"):
    """Every size tried, one row each: per search, status, measured peak and s/step."""
    sizes = sorted({t.size for r in searches.values() for t in r.trials})
    width = max([24] + [len(name) for name in searches])
    lines = [f"{'':>7} | " + " | ".join(f"{name:^{width}}" for name in searches),
             f"{size_label:>7} | " + " | ".join(
                 f"{'status':>6} {'peak MiB':>9} {'s/step':>{width - 17}}" for _ in searches)]
    lines.append("-" * len(lines[-1]))
    for size in sizes:
        cells = []
        for result in searches.values():
            trial = result.trial(size)
            if trial is None:
                cells.append(" " * width)
                continue
            peak = f"{trial.peak_bytes / 2**20:.1f}" if trial.peak_bytes else "n/a"
            step = f"{trial.step_seconds:.3f}" if trial.step_seconds is not None else "n/a"
            cells.append(f"{trial.status:>6} {peak:>9} {step:>{width - 17}}")
        lines.append(f"{size:>7} | " + " | ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The trial interpreter


def _load_make_step(ref):
    import importlib
    import importlib.util

    path, module = ref["file"], ref["module"]
    if module is None:
        # A script: load it under its own name (not __main__, so that its
        # `if __name__ == "__main__"` block does not run), with its directory on the
        # path as when it is run.
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location("_tfmemopt_make_step_script", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        found = importlib.util.find_spec(module.split(".")[0])
        if path and (found is None or not path.startswith(
                os.path.dirname(os.path.abspath(found.origin or "")))):
            # The parent found the module through a sys.path entry added at run time
            # (e.g. a benchmark's own directory): put its package root first here too.
            root = os.path.dirname(path)
            for _ in range(module.count(".") + (os.path.basename(path) == "__init__.py")):
                root = os.path.dirname(root)
            sys.path.insert(0, root)
        mod = importlib.import_module(module)
    target = mod
    for part in ref["qualname"].split("."):
        target = getattr(target, part)
    return target


def _run_steps(step, args, count, times, outputs=None):
    import tensorflow as tf

    for _ in range(count):
        begin = time.perf_counter()
        out = step(*args)
        # Wait for the values, not just the dispatch.
        values = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
        times.append(time.perf_counter() - begin)
        flat = tf.nest.flatten(values)
        if outputs is not None and all(getattr(v, "shape", None) == () for v in flat):
            outputs.append([float(v) for v in flat])


def _failure(err):
    import traceback

    import tensorflow as tf

    if isinstance(err, tf.errors.ResourceExhaustedError):
        # TF's first line is often just "Graph execution error:"; the line that names
        # the tensor and the allocator is the useful one.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        useful = [line for line in lines if "OOM when allocating" in line]
        return "oom", (useful or lines or ["ResourceExhaustedError"])[0][:300]
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    return "error", f"{type(err).__name__}: {str(err).strip()[:500]}\n" + _tail("".join(lines))


def _child_main():
    """Runs in the trial's interpreter: python -c _CHILD SPEC_JSON."""
    spec = json.loads(sys.argv[1])
    config = spec["config"]
    result = {"status": "ok"}
    times, outputs = [], []
    step = args = None
    try:
        if config["memory_optimization"] is not None or config["fields"] is not None:
            import tfmemopt

            tfmemopt.set_tf_memory_optimization(config["memory_optimization"])
            if config["fields"] is not None:
                tfmemopt.enable(**config["fields"])
        make_step = _load_make_step(spec["ref"])
        made = make_step(spec["size"], **spec["step_kwargs"])
        if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])
                and isinstance(made[1], (tuple, list))):
            raise TypeError(f"make_step({spec['size']}) returned {type(made).__name__}; "
                            f"allowed: a tuple (step, args) with step(*args) one training step")
        step, args = made
        _run_steps(step, args, spec["steps"], times, outputs)
    except Exception as err:  # every failure is reported; only OOM counts as "too big"
        result["status"], result["error"] = _failure(err)
    result["step_times"] = times
    result["outputs"] = outputs
    result["step_seconds"] = statistics.median(times[1:]) if len(times) > 1 else None
    result.update(_peak_and_reports(config))
    print(_RESULT_MARK + json.dumps(result), flush=True)
    if not spec["serve"] or result["status"] != "ok":
        return
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] != "steps":
            break
        times, reply = [], {"status": "ok", "error": ""}
        try:
            _run_steps(step, args, int(command[1]), times)
        except Exception as err:
            reply["status"], reply["error"] = _failure(err)
        reply["times"] = times
        print(_TIMES_MARK + json.dumps(reply), flush=True)


def _peak_and_reports(config):
    out = {"peak_bytes": None}
    try:
        import tensorflow as tf

        out["peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except Exception:  # no BFC allocator: TF cannot tell the peak
        pass
    import tfmemopt
    from tensorflow.core.protobuf import rewriter_config_pb2

    from tfmemopt import _eager_context

    rewrite = _eager_context.current_rewrite_options()
    out["rewrite_options"] = {
        "memory_optimization": rewriter_config_pb2.RewriterConfig.MemOptType.Name(
            rewrite.memory_optimization),
        "custom_optimizers": [c.name for c in rewrite.custom_optimizers],
    }
    # Without tfmemopt this stays empty: the pass is registered (this module is part of
    # the package) but runs only where a config lists it.
    reports = [r.to_dict() for r in tfmemopt.reports()]
    out["graphs"] = [{"graph_id": r["graph_id"], "num_nodes": r["num_nodes"],
                      "graph_changed": r["graph_changed"]} for r in reports]
    if config["fields"] is not None:
        if reports:
            # The newest of the largest: after a retry, the plan that ran.
            largest = max(reversed(reports), key=lambda r: r["num_nodes"])
            largest.pop("timeline", None)
            out["report"] = largest
    return out
