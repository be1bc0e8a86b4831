"""`tfmemopt.function`: tf.function, with the runtime feedback loop of feedback.py.

    tfmemopt.enable(budget="6GiB")

    @tfmemopt.function          # or tfmemopt.function(train_step, jit_compile=False, ...)
    def train_step(x, y):
        ...

It takes tf.function's keywords and behaves as tf.function. Its calls are planned by the
pass with the config of tfmemopt.enable(); in addition:

* the first `guard_steps` calls after each (re)plan are measured where the allocator
  tells its peak, and the measured peak goes into the graph's report
  (`Report.measured_peak_bytes`);
* when one of those calls runs out of memory, the variables it may have updated are put
  back, the budget is lowered by the allocation that failed (feedback.lowered_budget),
  the function is re-planned under it, and the call is retried with the same inputs,
  up to `retries` times; each retry is logged and listed in `retries_done`. The lowered
  budget applies to this function only and is kept for its later calls;
* when the re-plans are used up, or no lower budget can change the plan, a graph the
  pass changed is run once more as TF built it (feedback.after_failed_attempt), and
  keeps running so where that trains (`original` is then True): a step that trains
  without tfmemopt trains with it;
* when one of those calls succeeds but its own measured peak exceeds the budget its
  plan met on paper, the function is re-planned for the next calls under the budget
  less the measured error (feedback.Calibrator: at most `retries` times, undone on a
  fresh trace if the next call measures less than half of what the new plan predicted
  to save; listed in `calibrator.done`).
"""

import functools
import weakref

import tensorflow as tf

import tfmemopt
from tfmemopt import _eager_context, feedback
from tfmemopt.config import custom_optimizer_entry, make_config, with_entry

_BUDGET_FIELDS = ("budget_bytes", "budget_fraction")


def _fields_of(config):
    from tfmemopt.config import _is_repeated

    return {field.name: list(value) if _is_repeated(field) else value
            for field, value in config.ListFields()}


class Function:
    """A tf.function that re-plans and retries a step that runs out of memory."""

    def __init__(self, python_function, retries=3,
                 guard_steps=feedback.DEFAULT_GUARD_STEPS, *, _binding=None,
                 **tf_function_kwargs):
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"tfmemopt.function: retries={retries!r}; allowed: an int >= 0")
        if not isinstance(guard_steps, int) or guard_steps < 1:
            raise ValueError(
                f"tfmemopt.function: guard_steps={guard_steps!r}; allowed: an int >= 1")
        self._tf_function_kwargs = tf_function_kwargs
        self._python_function = python_function
        # As a method: the instance it is bound to (a weak reference, as tf.function
        # keeps it) and the class, given by __get__ as _binding; and, on the unbound
        # wrapper, one bound wrapper per instance, each with its own retry state (as
        # tf.function traces per instance).
        self._instance, self._owner = _binding if _binding is not None else (None, None)
        self._function = self._new_tf_function()
        functools.update_wrapper(self, python_function)
        self._bound = weakref.WeakKeyDictionary()
        self.retries = retries
        self.guard_steps = guard_steps
        self.budget_bytes = None  # this function's own budget, after a retry
        # Runs as TF built it (the pass in ANALYZE_ONLY) after its plans ran out of memory.
        self.original = False
        self.retries_done = []    # one dict per retry: graph_id, device, budgets, missing
        # Re-plans of calls that measured over their budget without running out of memory.
        self.calibrator = feedback.Calibrator(retries)
        self._calls_since_plan = 0
        self._warned = False

    @property
    def python_function(self):
        return self._function.python_function

    def get_concrete_function(self, *args, **kwargs):
        return self._function.get_concrete_function(*args, **kwargs)

    def __get__(self, instance, owner):
        # As a method: bind through tf.function's own descriptor, which leaves `self`
        # out of input_signature and holds the instance weakly.
        if instance is None or self._instance is not None:
            return self
        try:
            bound = self._bound.get(instance)
        except TypeError:  # an unhashable instance: bind afresh on every access
            bound = None
        if bound is None:
            bound = Function(self._python_function, retries=self.retries,
                             guard_steps=self.guard_steps,
                             _binding=(weakref.ref(instance), owner),
                             **self._tf_function_kwargs)
            try:
                self._bound[instance] = bound
            except TypeError:
                pass
        return bound

    def _new_tf_function(self):
        function = tf.function(self._python_function, **self._tf_function_kwargs)
        if self._instance is not None:
            function = function.__get__(self._instance(), self._owner)
        return function

    def __call__(self, *args, **kwargs):
        config = tfmemopt.enabled_config()
        if config is None:
            if not self._warned:
                tf.get_logger().warning(
                    "tfmemopt.function: tfmemopt.enable() is not in force, so %s runs as a "
                    "plain tf.function", getattr(self, "__name__", "the function"))
                self._warned = True
            return self._function(*args, **kwargs)
        while True:
            guarded = self._calls_since_plan < self.guard_steps
            snapshot = devices = None
            if guarded:
                concrete = self._function.get_concrete_function(*args, **kwargs)
                snapshot = feedback.VariableSnapshot(concrete.variables)
                devices = feedback.memory_devices(self._devices(concrete))
                feedback.reset_peaks(devices)
                in_use_before = feedback.read_in_use(devices)
                reports_before = feedback.report_count()
            try:
                with self._own_budget(config), _eager_context.retrying_calls():
                    result = self._function(*args, **kwargs)
            except tf.errors.ResourceExhaustedError as error:
                report = self._report(args, kwargs)
                if report is None:
                    raise  # not planned by the pass: nothing to re-plan
                if snapshot is None:
                    # Past the guarded steps, variables may be partly updated: the
                    # lower budget is for the next plan; this step is not retried.
                    self._lower_budget(report, error, {}, retrying=False)
                    raise
                snapshot.restore()  # the failed attempt's updates never survive
                if self.original:
                    feedback.log_original_failed("the step", report, error)
                    raise
                action, budget = feedback.after_failed_attempt(
                    "the step", report, error,
                    feedback.read_peaks(devices) if devices else {}, self.retries_done,
                    self.retries)
                if action == "original":
                    self.original = True
                else:
                    self.budget_bytes = budget
                self.calibrator.replanned()
                self._calls_since_plan = 0
                continue
            self._calls_since_plan += 1
            if devices:
                report = self._report(args, kwargs)
                if report is not None and not self.original:
                    peaks = feedback.read_peaks(devices)
                    feedback.record_measured_peak(report, peaks)
                    shapes = tuple(tuple(t.shape) for t in tf.nest.flatten((args, kwargs))
                                   if isinstance(t, tf.Tensor))
                    replan = self.calibrator.after_step(
                        "the next calls", report, peaks, in_use_before,
                        key=(self._graph_name(concrete), shapes),
                        planned=feedback.report_count() > reports_before)
                    if replan:
                        self.budget_bytes = replan["budget_bytes"]
                        self._calls_since_plan = 0
                        if replan["retrace"]:
                            self._function = self._new_tf_function()
            return result

    # --- helpers ---

    def _own_budget(self, config):
        if self.original:
            return budget_edit(config, self.budget_bytes, original=True)
        if self.budget_bytes is None:
            return _NullContext()
        return budget_edit(config, self.budget_bytes)

    @staticmethod
    def _graph_name(concrete):
        name = concrete.name
        return name.decode() if isinstance(name, bytes) else name

    def _report(self, args, kwargs):
        name = self._graph_name(self._function.get_concrete_function(*args, **kwargs))
        mine = [r for r in tfmemopt.reports() if r.graph_id == name]
        return mine[-1] if mine else None

    @staticmethod
    def _devices(concrete):
        devices = set()
        for op in concrete.graph.get_operations():
            spec = tf.DeviceSpec.from_string(op.device or "")
            if spec.device_type:
                devices.add(f"{spec.device_type}:{spec.device_index or 0}")
        return sorted(devices) or ["CPU:0"]

    def _lower_budget(self, report, error, peaks, retrying=True):
        self.budget_bytes = feedback.replan("the step", report, error, peaks,
                                            self.retries_done, self.retries, retrying)
        self.calibrator.replanned()
        self._calls_since_plan = 0


def budget_edit(config, budget_bytes, original=False):
    """A context in which the calling thread's graph functions are built with `config`
    under `budget_bytes` instead of its budget (None: its own). `original`: with the
    pass in ANALYZE_ONLY, so that they run as TF built them (and are still reported)."""
    fields = _fields_of(config)
    if budget_bytes is not None:
        fields = {k: v for k, v in fields.items() if k not in _BUDGET_FIELDS}
    if original:
        fields["mode"] = "ANALYZE_ONLY"
    entry = custom_optimizer_entry(make_config(budget_bytes, **fields))
    return _eager_context.thread_config_edit(
        lambda proto: with_entry(proto.graph_options.rewrite_options, entry))


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def function(func=None, *, retries=3, guard_steps=feedback.DEFAULT_GUARD_STEPS,
             **tf_function_kwargs):
    """tf.function with tfmemopt's feedback loop (see the module docstring).

    Use as @tfmemopt.function, @tfmemopt.function(retries=2, input_signature=...), or
    tfmemopt.function(fn, ...). `retries`: how many times a step that runs out of memory
    is re-planned and retried (0: never). `guard_steps`: how many calls after each
    (re)plan are measured and guarded by a host snapshot of the variables they may
    update. Other keywords go to tf.function.
    """
    if func is None:
        return lambda f: Function(f, retries=retries, guard_steps=guard_steps,
                                  **tf_function_kwargs)
    return Function(func, retries=retries, guard_steps=guard_steps, **tf_function_kwargs)
