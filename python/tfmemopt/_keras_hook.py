"""The one place that touches Keras' private trainer: telling when a Keras model will
run its steps eagerly, and giving `fit` the callbacks tfmemopt.enable() asks for.

`model.compile(run_eagerly=True)` makes Keras run `train_step` (and test and predict)
as plain Python: no tf.function, so no graph, so Grappler and tfmemopt never see the
step. TF is never asked for a graph function, so nothing in `_eager_context` hears of
it. Keras decides in `TensorFlowTrainer._make_function`, which reads
`self.run_eagerly` before it wraps the step in a tf.function; that method is observed
here (only read: its arguments and result pass through unchanged, and an observer
that fails is ignored).

`import tensorflow` (2.21) imports that module with Keras, before tfmemopt can be
imported, so it is patched at `watch()`; without Keras there is nothing to watch.
"""

import functools
import inspect
import sys

TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"

_observer = None  # observer(model), when a model makes a step function that runs eagerly


def _make_function_observed(original):
    @functools.wraps(original)
    def _make_function(self, *args, **kwargs):
        observer = _observer
        if observer is not None:
            try:
                if getattr(self, "run_eagerly", False):
                    observer(self)
            except Exception:  # noqa: BLE001 - telling the user must not break Keras
                pass
        return original(self, *args, **kwargs)

    return _make_function


# tf_keras (Keras 2: `import tf_keras`, or tf.keras under TF_USE_LEGACY_KERAS=1): its
# Model.fit takes callbacks as Keras 3's does; only fit is observed there.
TF_KERAS_TRAINING_MODULE = "tf_keras.src.engine.training"


def _wrap_method(module_name, class_name, name, wrap):
    """Replaces module.class.<name> by wrap(original), once, if the module is loaded."""
    module = sys.modules.get(module_name)
    owner = getattr(module, class_name, None) if module is not None else None
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_tfmemopt_observed", False):
        return
    wrapped = wrap(original)
    wrapped._tfmemopt_observed = True
    setattr(owner, name, wrapped)


def _wrap_trainer_method(name, wrap):
    """Replaces TensorFlowTrainer.<name> by wrap(original), once (the wrapper reads
    the module's current observer or provider, so a second watch only swaps that)."""
    _wrap_method(TRAINER_MODULE, "TensorFlowTrainer", name, wrap)


def watch(observer):
    """Calls observer(model) whenever a Keras model makes a step function that runs
    eagerly (None stops)."""
    global _observer
    _observer = observer
    _wrap_trainer_method("_make_function", _make_function_observed)


# fit_callbacks(model, callbacks) -> callbacks to add to this fit, or None: set by
# tfmemopt.enable() (tfmemopt.keras.enabled_fit_callbacks), so that a `fit` under
# enable() gets the runtime feedback loop of tfmemopt.keras.MemoryOptimizer.
_fit_callbacks = None


# A callback with this method has it called when its fit ends, returned or raised:
# Keras calls on_train_end only when training ends normally, not when a callback, the
# data or the user (KeyboardInterrupt) stops it with an exception.
AFTER_FIT = "_tfmemopt_after_fit"


def _callbacks_of(callbacks):
    """The callbacks of a fit's `callbacks` argument (a list, or Keras's CallbackList)."""
    if callbacks is None:
        return []
    return list(getattr(callbacks, "callbacks", callbacks))


def _after_fit(callbacks):
    for callback in _callbacks_of(callbacks):
        after = getattr(callback, AFTER_FIT, None)
        if after is not None:
            try:
                after()
            except Exception:  # noqa: BLE001 - the fit's own outcome is what the user sees
                pass


def _fit_observed(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        provider = _fit_callbacks
        callbacks = None
        try:
            bound = signature.bind(self, *args, **kwargs)
            callbacks = bound.arguments.get("callbacks")
            extra = provider(self, callbacks) if provider is not None else None
            if extra:
                callbacks = bound.arguments["callbacks"] = list(callbacks or []) + list(extra)
                args, kwargs = bound.args[1:], bound.kwargs
        except Exception:  # noqa: BLE001 - fit runs as the user wrote it
            pass
        try:
            return original(self, *args, **kwargs)
        finally:
            _after_fit(callbacks)

    return fit


def watch_fit(provider):
    """Calls provider(model, callbacks) at the start of every Keras `fit` (TensorFlow
    backend) and adds the callbacks it returns to that fit (None stops). Every fit,
    with or without a provider, calls its callbacks' AFTER_FIT method when it ends."""
    global _fit_callbacks
    _fit_callbacks = provider
    wrap_fit()


def wrap_fit():
    """Makes every fit call its callbacks' AFTER_FIT method when it ends, whatever the
    provider (a MemoryOptimizer given to fit without enable()): Keras 3's, and
    tf_keras's once tf_keras is imported (called again from a fit's callbacks, it
    covers the fits after a late import)."""
    _wrap_trainer_method("fit", _fit_observed)
    _wrap_method(TF_KERAS_TRAINING_MODULE, "Model", "fit", _fit_observed)
