#include "grappler/register_pass.h"

#include "absl/strings/str_cat.h"
#include "grappler/ops/swap_ops.h"
#include "grappler/tfmemopt_optimizer.h"

namespace tfmemopt {

absl::Status RegisterTfMemOpt() {
  if (!RegisterTfMemOptOnce()) {
    return absl::AlreadyExistsError(
        "a Grappler pass named 'TfMemOpt' is already registered by another library "
        "(the tfmemopt Python package, or a Bazel-built libtfmemopt.so loaded with "
        "tf.load_library). Load only one of them: registering twice aborts TensorFlow.");
  }
  // A second copy of tfmemopt is refused by the check above; this one catches
  // another library that took the ops' names.
  if (absl::Status status = RegisterSwapOpsOnce(); !status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot register the swap ops: ", status.message(),
                                     ". Load only one copy of tfmemopt per process."));
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
