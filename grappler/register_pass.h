// Registers everything tfmemopt adds to TensorFlow: the TfMemOpt Grappler pass and
// the swap ops it inserts. One code path for both ways tfmemopt is loaded: the
// Python extension (`import tfmemopt`) and the Bazel-built libtfmemopt.so
// (`tf.load_library`).
#ifndef TFMEMOPT_GRAPPLER_REGISTER_PASS_H_
#define TFMEMOPT_GRAPPLER_REGISTER_PASS_H_

#include "absl/status/status.h"

namespace tfmemopt {

// Registers the pass, then the swap ops, once per process (later calls from the same
// copy of tfmemopt return OK). Fails with a message for users if another library,
// e.g. a second copy of tfmemopt, registered the pass or the ops first: registering
// a name twice aborts TensorFlow, so nothing is registered then.
absl::Status RegisterTfMemOpt();

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REGISTER_PASS_H_
