"""Loading: the TF version check, and never registering the pass twice."""

import pytest

import tfmemopt
from tfmemopt import _loader
from conftest import run_python


@pytest.mark.parametrize("version", ["2.20.1", "2.22.0", "3.0.0", "1.15.5"])
def test_other_tensorflow_versions_are_refused_clearly(version):
    with pytest.raises(ImportError) as info:
        _loader.check_tensorflow_version(version)
    message = str(info.value)
    assert f"TensorFlow {version} is installed" in message
    assert "pip install tensorflow-cpu==2.21.0" in message


def test_supported_versions_pass():
    for version in ("2.21.0", "2.21.3", "2.21.0rc1"):
        _loader.check_tensorflow_version(version)
    assert tfmemopt._ext.BUILT_AGAINST_TF_VERSION.startswith("2.21.")


def test_a_second_copy_of_the_pass_from_another_path_is_refused_not_aborted():
    # A second shared object registering "TfMemOpt" (e.g. a copy, or a Bazel build)
    # would abort TensorFlow; the extension checks the registry first instead.
    code = r'''
import importlib.util, os, shutil, tempfile
import tfmemopt
src = tfmemopt._ext.__file__
copy = os.path.join(tempfile.mkdtemp(), os.path.basename(src))
shutil.copy(src, copy)
spec = importlib.util.spec_from_file_location("tfmemopt_copy._ext", copy)
try:
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print("LOADED TWICE")
except ImportError as err:
    print("REFUSED:", err)
import tfmemopt as again
assert again._ext is tfmemopt._ext
print("STILL ALIVE")
'''
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED: tfmemopt: a Grappler pass named 'TfMemOpt' is already registered" in result.stdout
    assert "STILL ALIVE" in result.stdout
