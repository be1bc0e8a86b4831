// TfMemSwapOut / TfMemSwapIn: the swap mechanism of the CPU test bed.
//
//   stash = TfMemSwapOut(x)      copies x into the host pool (HostMemoryPool),
//                                outside TF's device allocator; x can be freed.
//   y     = TfMemSwapIn(stash)   copies it back into a tensor from the device
//                                allocator; control inputs decide when.
//
// Both ops are stateful, so that the Grappler passes running after TfMemOpt
// (and in the meta-optimizer's second iteration) keep them: constant folding,
// common-subexpression elimination (arithmetic optimizer dedup, and the runtime's
// OptimizeCSE), and the dependency optimizer only touch ops free of side effects.
// Their side effect is real: they move bytes in and out of the process-wide host
// pool, which reports count.
#ifndef TFMEMOPT_GRAPPLER_OPS_SWAP_OPS_H_
#define TFMEMOPT_GRAPPLER_OPS_SWAP_OPS_H_

#include "absl/status/status.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tfmemopt {

inline constexpr char kSwapOutOpName[] = "TfMemSwapOut";
inline constexpr char kSwapInOpName[] = "TfMemSwapIn";

// The types both ops take (their "T" attr in swap_ops.cc): numbers and bool.
inline bool SwapOpsTakeType(tensorflow::DataType dtype) {
  switch (dtype) {
    case tensorflow::DT_BOOL: case tensorflow::DT_INT8: case tensorflow::DT_INT16:
    case tensorflow::DT_INT32: case tensorflow::DT_INT64: case tensorflow::DT_UINT8:
    case tensorflow::DT_UINT16: case tensorflow::DT_UINT32: case tensorflow::DT_UINT64:
    case tensorflow::DT_HALF: case tensorflow::DT_BFLOAT16: case tensorflow::DT_FLOAT:
    case tensorflow::DT_DOUBLE: case tensorflow::DT_COMPLEX64: case tensorflow::DT_COMPLEX128:
      return true;
    default:
      return false;
  }
}

// Registers both ops and their CPU kernels with TensorFlow, once per process.
// Fails (registering nothing) if another library registered an op of the same
// name: registering an op twice aborts TensorFlow.
absl::Status RegisterSwapOpsOnce();

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_OPS_SWAP_OPS_H_
