"""tfmemopt for Keras: a callback that runs the pass on the graphs `fit` builds.

    model.fit(x, y, batch_size=256,
              callbacks=[tfmemopt.keras.MemoryOptimizer(budget="6GiB")])

Keras 3 on TensorFlow traces its train step (one `multi_step_on_iterator` graph; the
callback replays each step's batches, read beforehand for a retry, through an iterator
of the data's element spec, so that graph is the one that runs; `one_step_on_data`
only when a plan needs a static batch size to split) on the first batch of `fit`, after
`on_train_begin`, and TF instantiates it, running
Grappler and with it TfMemOpt, once per config_proto it is called with. So the pass
enabled in `on_train_begin` applies to this fit's step. The callback also makes Keras
build a new train function (`make_train_function(force=True)`): a step traced by an
earlier fit under the same config would reuse that instantiation and produce no
report. When `fit` ends or a step fails, the tfmemopt state from before is restored;
later calls get the instantiation of that config.
"""

import inspect

import keras
import tensorflow as tf

import tfmemopt
from tfmemopt import _eager_context, _keras_hook, feedback
from tfmemopt.config import _is_repeated

# The train step's graph: Keras's own (the iterator read in the graph; the callback
# replays batches read beforehand through an iterator of the same spec), or the
# one-batch step on the batches' own shapes, when a plan needs a static batch size.
# tf_keras (Keras 2) traces one `train_function` graph.
_TRAIN_GRAPHS = ("multi_step_on_iterator", "one_step_on_data", "__inference_train_function_")


def _logger():
    return tf.get_logger()


def _dataset_batch_size(dataset):
    """The batch size of the last `.batch(n)` a tf.data pipeline applies, or None.

    Read from the pipeline's Python objects (tf.data's private `_batch_size` and
    `_input_dataset`), never by iterating it: an extra iteration would advance a
    reshuffling dataset's seed and change what training sees.
    """
    for _ in range(64):  # pipelines are short chains; this bounds a cycle
        if dataset is None:
            return None
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            try:
                value = int(tf.get_static_value(size))
            except (TypeError, ValueError):
                return None
            return value if value > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def _adapter_batch_size(local):
    """The batch size of the data adapter in a `fit` frame's locals: Keras 3's epoch
    iterator, or tf_keras's (Keras 2's) data handler; (found, size)."""
    if "epoch_iterator" in local:  # Keras 3
        adapter = getattr(local["epoch_iterator"], "data_adapter", None)
        if adapter is None:
            return True, None
        size = adapter.batch_size
        if size is None:
            size = _dataset_batch_size(getattr(adapter, "_dataset", None))
        return True, size
    if "data_handler" in local:  # tf_keras: its adapters' batch sizes are methods
        adapter = getattr(local["data_handler"], "_adapter", None)
        if adapter is None:
            return True, None
        size = adapter.batch_size()
        if size is None:
            size = _dataset_batch_size(adapter.get_dataset())
        # A generator gives none: tf_keras types its batches by rank only, so every
        # dimension of the step is unknown, not only the batch's.
        return True, size
    return False, None


def fit_batch_size(model):
    """The batch size of the `fit` call running `model`, or None if unknown.

    Called from a callback hook inside `fit`. Keras 3 passes callbacks no batch size
    (`Callback.params` holds only verbose, epochs and steps) and no batches before
    the step is traced, so this reads the data adapter of the epoch iterator that
    `fit` made (a local of Keras's `TensorFlowTrainer.fit`): for arrays, the
    `batch_size` argument (default 32); for a tf.data.Dataset, its static batch
    dimension, else the size of its last `.batch()`. Generators and PyDatasets give
    None. tf_keras's `fit` (Keras 2, TF_USE_LEGACY_KERAS=1) holds a data handler
    instead, read the same way. Under a distribution strategy the result is per
    replica, as in the graph.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            local = frame.f_locals
            if local.get("self") is model:
                found, size = _adapter_batch_size(local)
                if found:
                    if not size:
                        return None
                    replicas = model.distribute_strategy.num_replicas_in_sync
                    return max(1, int(size) // replicas)
            frame = frame.f_back
        return None
    finally:
        del frame


def is_tf_keras(model):
    """Whether `model` is a tf_keras (Keras 2) model rather than a Keras 3 one."""
    return any(cls.__module__.startswith("tf_keras.") for cls in type(model).__mro__)


class MemoryOptimizer(keras.callbacks.Callback):
    """Runs TfMemOpt on the train step of `fit` (TensorFlow backend).

    budget: bytes (int), a size string ('6GiB', '512MB') or a fraction of device
      memory in (0, 1]; None means budget_fraction=0.9 (see tfmemopt.enable).
    plot_to: a .png path; after training, the train step's memory timeline is
      saved there (needs matplotlib: pip install 'tfmemopt[plot]').
    print_report: log the train step's report at INFO (tf.get_logger()).
    retries: how many times a train step that runs out of memory is re-planned under a
      lower budget and retried with the same batch (0: never; see tfmemopt.feedback).
      The callback then reads each step's batches before the step (so that it can
      retry them) and replays them through an iterator of the data's element spec,
      so that Keras's own step runs them (docs/usage.md#keras); a lowered budget is kept
      for the rest of the fit and for later fits with this callback. When the
      re-plans are used up, or no lower budget can change the plan, the step is run
      once more as TF built it, and keeps running so where that trains (`original`).
    guard_steps: how many steps after each (re)plan are measured (measured_peak_bytes
      in the report) and guarded by a host snapshot of the model's, the optimizer's
      and the metrics' variables, which a failed attempt may have updated. A guarded
      step that measures over the budget its plan met on paper has the next batches
      re-planned under a budget lowered by the error (at most `retries` times;
      `calibrator.done` lists them; see tfmemopt.feedback.Calibrator).
    **fields: other fields of tfmemopt.MemoryOptimizerConfig. `assume_batch_size`
      defaults to the batch size `fit` uses (see fit_batch_size()), since Keras
      traces the step with an unknown batch dimension when the data has a partial
      last batch.

    Invalid arguments raise ValueError/TypeError here, as tfmemopt.enable does.
    After `fit`: `report` is the train step's tfmemopt.Report (None if the pass did
    not run, e.g. under XLA), `reports` every train step graph's report of this fit.

    While `fit` runs the pass is enabled process-wide, as with tfmemopt.enable();
    afterwards (also when a train step fails) the previous state is restored.
    XLA (`jit_compile=True`, which Keras's default "auto" turns on for GPUs) and
    `run_eagerly=True` bypass Grappler: the callback then warns once and does nothing.

    tf_keras (Keras 2) models are planned, retried and measured the same way, except
    under a distribution strategy, where their steps are not retried: docs/usage.md.
    """

    def __init__(self, budget=None, plot_to=None, print_report=True, retries=3,
                 guard_steps=feedback.DEFAULT_GUARD_STEPS, **fields):
        super().__init__()
        tfmemopt.make_config(budget, **fields)  # the errors of tfmemopt.enable, now
        # A fit that stops with an exception never calls on_train_end: the fit wrapper
        # puts the state back then (_tfmemopt_after_fit).
        _keras_hook.wrap_fit()
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"MemoryOptimizer: retries={retries!r}; allowed: an int >= 0")
        if not isinstance(guard_steps, int) or guard_steps < 1:
            raise ValueError(
                f"MemoryOptimizer: guard_steps={guard_steps!r}; allowed: an int >= 1")
        self.retries = retries
        self.guard_steps = guard_steps
        self.budget_bytes = None  # lowered after a retry; kept for later steps and fits
        # The train step runs as TF built it (the pass in ANALYZE_ONLY) after its plans
        # ran out of memory; kept for later steps and fits, like budget_bytes.
        self.original = False
        self.retries_done = []
        # Re-plans of steps that measured over their budget without running out of memory.
        self.calibrator = feedback.Calibrator(retries)
        self._steps_since_plan = 0
        # The train graph that ran batches of each shape in this fit (None: not known yet).
        self._graph_of_shapes = {}
        # Guarded steps run the graph Keras traced for the fit's iterator (_replay)
        # until its plan needs a split, which needs a static batch size.
        self._static_batch = False
        self._replayer = None  # _Replay of the fit iterator's element spec
        self._budget = budget
        self._fields = fields
        self.plot_to = plot_to
        self.print_report = print_report
        self.report = None
        self.reports = []
        self._warned = False
        self._legacy = False  # a tf_keras model
        self._unguarded = False  # ... under a distribution strategy: no guarded steps
        self._warned_legacy = False
        self._active = False
        self._previous = None
        self._before = set()
        self._test_graphs = set()
        self._test_begin = set()
        self._step = self._wrapper = None
        # The train function and graphs of the last fit, kept by a callback that
        # enable() gives a model's fits (enabled_fit_callbacks) for the next one.
        self._kept_step = None
        self._kept_graphs = set()

    # --- fit hooks ---

    # tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1) asks its callbacks whether they have
    # batch hooks; this one has none.
    def _implements_train_batch_hooks(self):
        return False

    def _implements_test_batch_hooks(self):
        return False

    def _implements_predict_batch_hooks(self):
        return False

    def on_train_begin(self, logs=None):
        self.report, self.reports = None, []
        _keras_hook.wrap_fit()  # tf_keras imported after this callback was made
        self._legacy = is_tf_keras(self.model)
        # tf_keras's step reads its batches from an iterator in the graph: a retry
        # feeds it the batches read beforehand through an iterator of their own,
        # which a distribution strategy's per-replica batches cannot go through.
        self._unguarded = self._legacy and tf.distribute.has_strategy()
        if (self._unguarded and self.retries and not self._warned_legacy
                and not getattr(self, "_added_by_enable", False)):
            _logger().info(
                "tfmemopt: tf_keras (Keras 2) model under a distribution strategy: the "
                "train step is planned and reported, but a step that runs out of memory "
                "is not retried (retries need Keras 3's fit there).")
            self._warned_legacy = True
        bypass = self._grappler_bypass()
        if bypass:
            # Added by enable(): tfmemopt.explanation already tells the user about XLA
            # and run_eagerly for every graph, once.
            if not self._warned and not getattr(self, "_added_by_enable", False):
                _logger().warning(
                    "tfmemopt: %s bypasses Grappler, so tfmemopt cannot act on this "
                    "model's train step; compile(..., %s) to use it.", *bypass)
                self._warned = True
            return
        fields = dict(self._fields)
        if "assume_batch_size" not in fields:
            batch = fit_batch_size(self.model)
            if batch:
                fields["assume_batch_size"] = batch
                _logger().info("tfmemopt: assume_batch_size=%d, the batch size of this fit", batch)
            else:
                where = ("tfmemopt.enable(..., assume_batch_size=N)"
                         if getattr(self, "_added_by_enable", False)
                         else "MemoryOptimizer(assume_batch_size=N)")
                _logger().warning(
                    "tfmemopt: the batch size of this fit is unknown (a generator or "
                    "PyDataset); unknown batch dimensions count as 1. Pass %s.", where)
        self._previous = tfmemopt.enabled_config()
        self._before = {r.graph_id for r in tfmemopt.reports()}
        self._test_graphs = set()
        self._fit_fields = fields
        # This fit traces its own train step: a new plan, whose first steps are guarded.
        self._steps_since_plan, self._graph_of_shapes = 0, {}
        self.calibrator.replanned()
        self._enable()
        self._active = True
        self._build_optimizer()
        if self._kept_step is not None and self.model.train_function is self._kept_step:
            # The callback enable() gave the model's last fit, and that fit's train
            # function under the same config (enabled_fit_callbacks): TF runs the graph
            # it planned then, with no new trace, plan or report, so its reports count
            # as this fit's. A fit per epoch re-plans nothing.
            self._before -= self._kept_graphs
        else:
            # A fresh trace, so that this fit's step gets optimized and reported even
            # if an earlier fit instantiated it under the same config.
            self.model.make_train_function(force=True)
        # Wrapped only to restore the state when a step fails: fit has no hook for that.
        self._step = self.model.train_function

        def train_function(iterator):
            try:
                with _eager_context.retrying_calls():  # its own log lines, not the hint
                    if self.retries == 0 or self._unguarded:
                        return self._step(iterator)
                    return self._guarded_step(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                raise  # the end of an epoch
            except BaseException:
                self._restore()
                raise

        self.model.train_function = self._wrapper = train_function

    def on_test_begin(self, logs=None):
        # Validation traces a graph of the same name; what appears from here to
        # on_test_end is not the train step.
        self._test_begin = {r.graph_id for r in tfmemopt.reports()}

    def on_test_end(self, logs=None):
        self._test_graphs |= {r.graph_id for r in tfmemopt.reports()} - self._test_begin

    def on_train_end(self, logs=None):
        if not self._active:
            return
        self._restore()
        self.reports = self._my_reports()
        self.report = self.reports[-1] if self.reports else None
        if self.report is None:
            # Under enable() alone, tfmemopt.explanation tells why a graph was not
            # planned (once, as it happens).
            if not getattr(self, "_added_by_enable", False):
                _logger().warning("tfmemopt: no report for the train step of this fit")
            return
        if self.print_report:
            _logger().info("%s", self.report.to_text())
        if self.plot_to:
            self.report.plot(self.plot_to, title="Keras train step")
            _logger().info("tfmemopt: memory timeline saved to %s", self.plot_to)

    # --- the feedback loop (tfmemopt.feedback) ---

    def _enable(self):
        fields = dict(self._fit_fields)
        budget = self._budget
        if self.budget_bytes is not None:
            budget = self.budget_bytes
            for name in ("budget_bytes", "budget_fraction"):
                fields.pop(name, None)
        if self.original:
            fields["mode"] = "ANALYZE_ONLY"
        # enable()'s retry keywords as they are: this callback is the fit's loop.
        tfmemopt.enable(budget, **tfmemopt._retry_keywords(), **fields)

    def _guarded_step(self, iterator):
        """Runs one train step on batches read beforehand, so that a step that runs
        out of memory can be re-planned and retried with the same batches."""
        replay_spec = _replay_spec(iterator)
        if (replay_spec is not None and not self._static_batch
                and self._steps_since_plan >= self.guard_steps):
            # Past the guarded steps a step is not retried, so its batches need not be
            # read beforehand: Keras's own step reads the fit's iterator, as without
            # tfmemopt (the graph a replay runs too, at no cost per step).
            try:
                return self._step(iterator)
            except tf.errors.ResourceExhaustedError as error:
                report = self._report_for(None)
                if report is not None:
                    # The lower budget is for the next plan; variables may be partly
                    # updated, so the step is not retried.
                    self._lower_budget(report, error, {}, retrying=False)
                raise
        batches = []
        for _ in range(self._steps_per_execution()):
            try:
                batches.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                break
        if not batches:
            raise StopIteration
        shapes = tuple(tuple(t.shape) for t in tf.nest.flatten(batches) if hasattr(t, "shape"))
        if shapes not in self._graph_of_shapes:
            # Batches of a shape this fit has not run yet (the first ones, a partial
            # last batch) may have Keras trace the step anew (for the partial batch,
            # with an unknown batch dimension): a new plan, guarded and measured as
            # after a re-plan.
            self._graph_of_shapes[shapes] = None
            self._steps_since_plan = 0
            if self._legacy:
                self._trace_legacy_step(batches, None if self._static_batch else replay_spec)
        while True:
            spec = None if self._static_batch else replay_spec
            guarded = self._steps_since_plan < self.guard_steps
            snapshot = devices = None
            if guarded:
                self._build_compiled_state(batches[0])
                snapshot = feedback.VariableSnapshot(self._step_variables())
                devices = feedback.memory_devices(None)
                feedback.reset_peaks(devices)
                in_use_before = feedback.read_in_use(devices)
                reports_before = feedback.report_count()
            try:
                logs = self._step(self._replay(batches, spec))
            except tf.errors.ResourceExhaustedError as error:
                report = self._report_for(shapes)
                if report is None:
                    raise
                if snapshot is None:
                    # Past the guarded steps, variables may be partly updated: the
                    # lower budget is for the next plan; this step is not retried.
                    self._lower_budget(report, error, {}, retrying=False)
                    raise
                snapshot.restore()  # the failed attempt's updates never survive
                if spec is not None and self._take_static_batch(report):
                    continue  # the same batches, traced on their own shapes
                created = snapshot.not_covered(self._step_variables())
                if created:
                    _logger().warning(
                        "tfmemopt: %d variables (e.g. %s) were created by the failed "
                        "attempt and are not put back; the retried batch may differ "
                        "from a run that never ran out of memory.", len(created),
                        getattr(created[0], "path", created[0].name))
                if self.original:
                    feedback.log_original_failed("the batch", report, error)
                    raise
                action, budget = feedback.after_failed_attempt(
                    "the batch", report, error, feedback.read_peaks(devices),
                    self.retries_done, self.retries)
                if action == "original":
                    self.original = True
                else:
                    self.budget_bytes = budget
                self.calibrator.replanned()
                self._steps_since_plan = 0
                self._enable()
                continue
            self._steps_since_plan += 1
            if devices:
                planned = feedback.report_count() > reports_before
                mine = self._my_reports()
                if planned and mine:  # this step traced (or re-instantiated) its graph
                    self._graph_of_shapes[shapes] = mine[-1].graph_id
                report = self._report_for(shapes, mine)
                if report is not None and not self.original:
                    peaks = feedback.read_peaks(devices)
                    feedback.record_measured_peak(report, peaks)
                    replan = self.calibrator.after_step(
                        "the next batches", report, peaks, in_use_before, key=shapes,
                        planned=planned)
                    if replan:
                        self.budget_bytes = replan["budget_bytes"]
                        self._steps_since_plan = 0
                        self._enable()
                        if replan["retrace"]:
                            self._retrace()
                if spec is not None and report is not None:
                    self._take_static_batch(report)
            return logs

    def _replay(self, batches, spec):
        """What the train function is called with to run `batches`, read beforehand
        from the fit's iterator (_Replay; without a spec, _replay_unshaped)."""
        if spec is None:
            return _replay_unshaped(batches, self._legacy)
        if self._replayer is None or self._replayer.spec != spec:
            self._replayer = _Replay(spec)
        return self._replayer.iterator(batches)

    def _take_static_batch(self, report):
        """Whether the guarded steps now run the batches on their own shapes: the plan
        of the graph Keras traced for the fit's iterator misses its budget, and the
        split it would need is not possible there, since that graph's batch size is
        not static (a tf.data pipeline's batch dimension is unknown) or the step runs in
        Keras's loop of steps_per_execution steps. The step traced
        on the batches' shapes can be split; it is another graph than fit without
        tfmemopt runs, so its losses may differ in the last bits (as a split's do)."""
        split = report.split
        if (self._static_batch or self.original or report.fits is not False
                or not split.get("planned") or split.get("batch", 0) >= 2
                or self._fit_fields.get("assume_batch_size", 0) < 2):
            return False
        self._static_batch = True
        self._steps_since_plan = 0
        # A fresh train function: Keras's (reduce_retracing) would otherwise run the
        # batches through the trace it has, of an unknown batch size.
        self._retrace()
        # A warning, as a split's is: the user learns that the last bits may change.
        steps = self._steps_per_execution()
        reason = (
            f"Keras runs it steps_per_execution={steps} times in a loop, whose ops "
            "tfmemopt neither swaps, recomputes nor splits" if steps > 1 else
            "splitting it along the batch needs a static batch size, which the step "
            "Keras traced for the data does not have")
        _logger().warning(
            "tfmemopt: the plan of this fit's train step misses its budget and %s: the "
            "next steps run one batch at a time, on the batches' own shapes (a graph of "
            "its own; its losses may differ from fit without tfmemopt in the last bits).",
            reason)
        return True

    def _retrace(self):
        """A fresh train function under the current config, behind the wrapper."""
        self.model.make_train_function(force=True)
        self._step = self.model.train_function
        self.model.train_function = self._wrapper
        self._graph_of_shapes = {}  # the new function's graphs are traced anew

    def _build_optimizer(self):
        """Creates the optimizer's variables now if Keras would create them in the
        first step: the snapshot that guards that step must hold them, or a failed
        first attempt's updates of them (Adam's moments, its iteration count) would
        survive into the retry."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not hasattr(optimizer, "build") or getattr(
                optimizer, "built", True):
            return
        # A model Keras has not built yet (a Sequential without an Input) has no
        # variables before its first step: an optimizer built now would know none of
        # them and refuse the step's gradients. Keras builds both in that step; a
        # failed first attempt then warns about the variables it created.
        variables = self.model.trainable_variables
        if not getattr(self.model, "built", True) or not variables:
            return
        optimizer.build(variables)

    def _build_compiled_state(self, batch):
        """Creates the compiled metrics' and loss's variables now, from `batch`'s
        shapes, where Keras would create them in the first step: the snapshot that
        guards that step must hold them, or a failed first attempt's updates would
        count in the epoch's metrics (an accuracy over one batch more). Keras's own
        `_symbolic_build` (what fit does under a distribution strategy) builds them
        from symbolic shapes; only for a built model, so that nothing that draws
        random numbers is built earlier than without the callback."""
        model = self.model
        metrics = getattr(model, "_compile_metrics", None)
        loss = getattr(model, "_compile_loss", None)
        if not ((metrics is not None and not metrics.built)
                or (loss is not None and not loss.built)):
            return
        try:
            if not getattr(model, "built", False) or not all(
                    layer.built for layer in model._flatten_layers()):
                return
            with model.distribute_strategy.scope():
                model._symbolic_build(data_batch=batch)
        except Exception:  # noqa: BLE001 - Keras builds them in the step, as before
            pass

    def _steps_per_execution(self):
        steps = self.model.steps_per_execution
        if self._legacy:  # tf_keras: a variable (its fit lowers it for an epoch's end)
            steps = steps.numpy()
        return int(steps)

    def _trace_legacy_step(self, batches, spec):
        """Traces tf_keras's train function for batches of a shape it has not run
        yet, before the step runs: the variables its first step creates (the compiled
        metrics', the optimizer's) then exist when the snapshot that guards the step
        is taken. Tracing runs nothing; the calls that follow reuse the trace."""
        concrete = getattr(self._step, "get_concrete_function", None)
        if concrete is None:
            return
        try:
            concrete(self._replay(batches, spec))
        except Exception:  # noqa: BLE001 - the step traces itself, as without us
            pass

    def _step_variables(self):
        model = self.model
        variables = list(model.variables) + list(getattr(model, "metrics_variables", []))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        if self._legacy:
            # tf_keras: the metrics' variables, the optimizer's step count and the
            # model's step counter, which its train function updates too.
            variables += [v for m in model.metrics for v in m.variables]
            # (Repeats are fine: the snapshot holds each variable once.)
            for extra in (getattr(optimizer, "iterations", None),
                          getattr(model, "_train_counter", None)):
                if isinstance(extra, tf.Variable):
                    variables.append(extra)
        return variables

    def _my_reports(self):
        """This fit's train step reports (not validation's, not earlier fits'), oldest
        first."""
        return [r for r in tfmemopt.reports()
                if any(g in r.graph_id for g in _TRAIN_GRAPHS)
                and r.graph_id not in self._before and r.graph_id not in self._test_graphs]

    def _report_for(self, shapes, mine=None):
        """The report of the graph that runs batches of `shapes` (of `mine`, this fit's
        reports), else the latest. Keras keeps a graph per input signature it traced:
        after a partial last batch has traced one with an unknown batch dimension, the
        full batches still run the first, so the latest report is not always the graph
        that ran."""
        mine = self._my_reports() if mine is None else mine
        graph_id = self._graph_of_shapes.get(shapes)
        same = [r for r in mine if r.graph_id == graph_id]
        return (same or mine or [None])[-1]

    def _lower_budget(self, report, error, peaks, retrying=True):
        self.budget_bytes = feedback.replan("the batch", report, error, peaks,
                                            self.retries_done, self.retries, retrying)
        self.calibrator.replanned()
        self._steps_since_plan = 0
        self._enable()

    # --- helpers ---

    def _grappler_bypass(self):
        """(what, what to pass instead) if the train step would not run as a graph
        that Grappler optimizes, else None."""
        model = self.model
        if getattr(model, "run_eagerly", False):
            return "run_eagerly=True (no graph is built)", "run_eagerly=False"
        if getattr(model, "jit_compile", False):
            return ("jit_compile=True (XLA compiles the train step)",
                    "jit_compile=False")
        return None

    def _tfmemopt_after_fit(self):
        """Called when the fit ends, however it ends (tfmemopt._keras_hook): a fit that
        a callback, the data or the user stopped with an exception skips on_train_end,
        and must not leave this fit's config enabled nor its train function wrapped."""
        self._restore()

    def _restore(self):
        """Puts back the tfmemopt state from before this fit, once."""
        if not self._active:
            return
        self._active = False
        if self.model.train_function is self._wrapper:
            self.model.train_function = self._step
        if getattr(self, "_added_by_enable", False):
            self._kept_step = self._step
            self._kept_graphs = {r.graph_id for r in self._my_reports()}
        self._step = self._wrapper = None
        if self._previous is None:
            tfmemopt.disable()
        else:
            tfmemopt.enable(**tfmemopt._retry_keywords(), **_fields_of(self._previous))


def _replay_spec(iterator):
    """The element spec of the fit's iterator, when the guarded step can replay its
    batches through an iterator of that spec: a tf.data iterator of plain tensors (a
    distribution strategy's iterator, ragged or sparse elements: None)."""
    if not isinstance(iterator, tf.data.Iterator):
        return None
    spec = iterator.element_spec
    leaves = tf.nest.flatten(spec)
    if not leaves or not all(type(leaf) is tf.TensorSpec for leaf in leaves):
        return None
    return spec


class _Replay:
    """Batches read beforehand, run through an iterator of the fit iterator's element
    spec: TF then runs the train function Keras traced for the fit's own iterator,
    with the same static shapes (a dataset's batch dimension is unknown), so the step
    computes what it computes without tfmemopt. A trace on the batches' concrete
    shapes would be another graph: TF picks some kernels by static shapes (oneDNN's
    bfloat16 convolutions), and its losses can differ in the last bits. One dataset
    serves every step (a dataset per step would trace its functions each time); each
    iterator made from it yields the batches of its step."""

    def __init__(self, spec):
        self.spec = spec
        self._batches = []
        self._dataset = tf.data.Dataset.from_generator(lambda: iter(self._batches),
                                                       output_signature=spec)

    def iterator(self, batches):
        self._batches = list(batches)
        return iter(self._dataset)


def _replay_unshaped(batches, legacy):
    """Without the fit iterator's spec (_replay_spec): Keras 3's step takes the list of
    batches (traced on their shapes); tf_keras's, which reads an iterator inside the
    graph, an iterator of the batches' own shapes."""
    if not legacy:
        return batches
    dataset = tf.data.Dataset.from_tensors(batches[0])
    for batch in batches[1:]:
        dataset = dataset.concatenate(tf.data.Dataset.from_tensors(batch))
    return iter(dataset)


def _fields_of(config):
    """The fields set in a MemoryOptimizerConfig, as keywords of tfmemopt.enable."""
    return {field.name: list(value) if _is_repeated(field) else value
            for field, value in config.ListFields()}


def enabled_fit_callbacks(model, callbacks, retries):
    """The callbacks a Keras `fit` gets under tfmemopt.enable(): a MemoryOptimizer with
    enable()'s config and `retries` (tfmemopt.enable's fit_retries), so that the step
    that runs out of memory is re-planned and retried there too; a tf_keras model's
    fit gets it for its batch size even with `retries` 0 (tf_keras traces its step
    with an unknown batch dimension). None when the fit already
    has a MemoryOptimizer (its own settings win) or when Keras's callbacks are given
    as a CallbackList (which this cannot extend without building it)."""
    config = tfmemopt.enabled_config()
    if config is None:
        return None
    # A tf_keras fit gets the callback even without retries (it then only plans):
    # tf_keras traces the step with an unknown batch dimension, which only the fit's
    # batch size (assume_batch_size) sizes right.
    if retries <= 0 and not is_tf_keras(model):
        return None
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return None
    if any(isinstance(c, MemoryOptimizer) for c in callbacks or []):
        return None
    # One callback per model and config, kept for the model's next fits: its lowered
    # budget and calibrations carry over, and so does its plan (the train function it
    # leaves behind is reused when the model still has it).
    # Kept on the model (the callback refers to the model, so a table keyed by models
    # would keep them alive), past Keras's attribute tracking: it is no part of the
    # model's state, and neither saving nor checkpoints see it.
    key = (config.SerializeToString(deterministic=True), retries)
    kept = getattr(model, _KEPT_ATTR, None)
    if kept is not None and kept[0] == key:
        return [kept[1]]
    callback = MemoryOptimizer(print_report=False, retries=retries, **_fields_of(config))
    callback._added_by_enable = True
    try:
        object.__setattr__(model, _KEPT_ATTR, (key, callback))
    except (AttributeError, TypeError):  # a model without an instance dict: one per fit
        pass
    return [callback]


# The attribute of a model that holds (config key, the MemoryOptimizer enable() gave
# its fits).
_KEPT_ATTR = "_tfmemopt_enabled_fit_callback"
