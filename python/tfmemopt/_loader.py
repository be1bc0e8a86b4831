"""Loads the native extension once, after checking the TensorFlow it runs against.

Two registrations of the same Grappler pass from two different shared objects abort
the process, so the extension is only ever imported from here, and the extension
itself refuses to register over another library's TfMemOpt.
"""

import functools
import importlib

SUPPORTED_TF = "2.21"


def check_tensorflow_version(version):
    """Raises ImportError unless `version` is a TensorFlow 2.21.x release."""
    parts = version.split(".")
    if ".".join(parts[:2]) != SUPPORTED_TF:
        raise ImportError(
            f"tfmemopt requires TensorFlow {SUPPORTED_TF}.x (its C++ pass is compiled "
            f"against that ABI), but TensorFlow {version} is installed. "
            f"Install it with: pip install tensorflow-cpu=={SUPPORTED_TF}.0"
        )


@functools.lru_cache(maxsize=None)
def load_extension():
    """Imports tfmemopt._ext once per process (cached)."""
    import tensorflow as tf  # loads libtensorflow_framework before our .so

    check_tensorflow_version(tf.__version__)
    try:
        ext = importlib.import_module("tfmemopt._ext")
    except ImportError as err:
        if "undefined symbol" in str(err):
            raise ImportError(
                f"tfmemopt's native extension does not match the installed TensorFlow "
                f"{tf.__version__} ({err}). Reinstall tfmemopt against it: "
                f"pip install --force-reinstall --no-cache-dir tfmemopt"
            ) from err
        raise
    built = ext.BUILT_AGAINST_TF_VERSION
    if built.split(".")[:2] != tf.__version__.split(".")[:2]:
        raise ImportError(
            f"tfmemopt was built against TensorFlow {built} but TensorFlow "
            f"{tf.__version__} is installed; rebuild tfmemopt against it."
        )
    return ext
