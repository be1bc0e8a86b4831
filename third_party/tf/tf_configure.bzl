"""A repository for the TensorFlow that `python` imports (as tensorflow/custom-op's
tf_configure does): its headers, shared libraries and flags, from tf.sysconfig.

The Python interpreter is $PYTHON_BIN_PATH, else `python3` on PATH. The repository
is cached in Bazel's output base (re-digesting TF's 11,000 headers costs tens of
seconds); after installing another TF at the same path, refresh it with
`bazel sync --configure`. Changing PYTHON_BIN_PATH refreshes it by itself.
"""

_SYSCONFIG = """
import tensorflow as tf
print(tf.__version__)
print(tf.sysconfig.get_include())
print(tf.sysconfig.get_lib())
print(" ".join(tf.sysconfig.get_compile_flags()))
print(" ".join(tf.sysconfig.get_link_flags()))
"""

# tf.sysconfig's link flags name only the framework library; the pass also links the
# C++ API library, as the CMake build does.
_EXTRA_LIBS = ["libtensorflow_cc.so.2"]

_BUILD = """\
package(default_visibility = ["//visibility:public"])

# TensorFlow {version} from {lib_dir}
cc_library(
    name = "tensorflow",
    srcs = {libs},
    hdrs = glob(["include/**"], exclude = ["include/LICENSE"]),
    defines = {defines},
    includes = ["include"],
    linkopts = ["-Wl,-rpath,{lib_dir}"],
)

"""

# Compile flags that dependents need besides the defines (cc_library's copts apply
# only to the library's own sources).
_BUILD_DEFS = """\
# TensorFlow {version}: the compile flags of tf.sysconfig.get_compile_flags() other
# than -I and -D (which the :tensorflow target carries).
TF_COPTS = {copts}
"""

def _python(repository_ctx):
    python = repository_ctx.os.environ.get("PYTHON_BIN_PATH", "")
    if python:
        return python
    found = repository_ctx.which("python3")
    if not found:
        fail("tf_configure: no python3 on PATH; set PYTHON_BIN_PATH to the Python that has tensorflow")
    return str(found)

def _tf_configure_impl(repository_ctx):
    python = _python(repository_ctx)
    result = repository_ctx.execute(
        [python, "-c", _SYSCONFIG],
        environment = {"TF_CPP_MIN_LOG_LEVEL": "3"},
        quiet = True,
    )
    if result.return_code != 0:
        fail("tf_configure: `{} -c 'import tensorflow'` failed; install tensorflow-cpu==2.21.0 there or set PYTHON_BIN_PATH:\n{}".format(python, result.stderr))
    lines = result.stdout.strip().split("\n")[-5:]
    version, include_dir, lib_dir, compile_flags, link_flags = lines
    if not version.startswith("2.21."):
        fail("tf_configure: tfmemopt builds against TensorFlow 2.21.x, {} has {}".format(python, version))

    copts, defines = [], []
    for flag in compile_flags.split(" "):
        if flag.startswith("-D"):
            defines.append(flag[2:])
        elif not flag.startswith("-I"):  # the include dir is linked in below
            copts.append(flag)
    libs = []
    for flag in link_flags.split(" "):
        if flag.startswith("-l:"):
            libs.append(flag[3:])
        elif flag.startswith("-l"):
            libs.append("lib{}.so".format(flag[2:]))
    libs += [lib for lib in _EXTRA_LIBS if lib not in libs]

    repository_ctx.symlink(include_dir, "include")
    for lib in libs:
        repository_ctx.symlink(lib_dir + "/" + lib, lib)
    repository_ctx.file("build_defs.bzl", _BUILD_DEFS.format(version = version, copts = repr(copts)))
    repository_ctx.file("BUILD", _BUILD.format(
        version = version,
        lib_dir = lib_dir,
        libs = repr(libs),
        defines = repr(defines),
    ))

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH"],
    configure = True,
)
