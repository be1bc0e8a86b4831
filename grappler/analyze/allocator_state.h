// The state of a live BFC pool, read when the pass runs.
//
// Which free chunks a step finds is decided before the step: by the order in which
// the variables, their initial values, Keras' bookkeeping and the caller's inputs
// were allocated, and by what BFC did with them. The allocator model cannot know
// that history and otherwise replays several plausible ones
// (simulate/liveness_simulator.h, ResidentHistory). But Grappler runs in the process
// that will run the step, after the function was traced (its variables exist) and
// before its first step: where the pass can read the allocator the step will use,
// the model starts from that pool as it is (ResidentHistory::kObserved).
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_ALLOCATOR_STATE_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_ALLOCATOR_STATE_H_

#include <vector>

#include "grappler/simulate/bfc_allocator_model.h"

namespace tsl {
class Allocator;  // tensorflow::Allocator is this class
}  // namespace tsl

namespace tfmemopt {

// The chunks of `allocator`'s pool in address order (BFC's RecordMemoryMap), when it
// is the CPU test bed's BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true); empty for any
// other allocator (its layout is not read: a GPU's BFC may be wrapped by a debugging
// allocator of the same name).
std::vector<PoolChunk> ReadBfcPool(tsl::Allocator* allocator);

// ReadBfcPool of the process's CPU allocator (the one TF's CPU devices use).
std::vector<PoolChunk> ReadCpuPool();

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_ALLOCATOR_STATE_H_
