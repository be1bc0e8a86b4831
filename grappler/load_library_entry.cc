// The entry point of libtfmemopt.so (the Bazel build): tf.load_library() dlopens it,
// and this initializer registers the pass and its ops. Not part of the Python
// extension, which registers from its module init instead, so that a refusal
// becomes an ImportError there.
#include "grappler/register_pass.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

// A failed registration must not abort the process that loads the library (that
// is what registering twice would do), so it is logged and the library stays inert.
const bool registered = [] {
  absl::Status status = RegisterTfMemOpt();
  if (!status.ok()) LOG(ERROR) << "libtfmemopt.so: " << status.message();
  return status.ok();
}();

}  // namespace
}  // namespace tfmemopt
