// Analyze: variables whose initial value a constant of another graph still holds.
//
// A TF1 initializer assigns a resource variable from a Const (zeros_initializer,
// ones_initializer, or a Fill that Grappler's constant folding turned into a Const,
// up to its size limit). AssignVariableOp shares the Const's buffer instead of
// copying it (copy-on-write, resource_variable_ops.cc), and the Const's kernel,
// cached with the Session's executor for the initializer, keeps its reference for
// the Session's lifetime. The first update of the variable (PrepareToUpdateVariable)
// finds the buffer shared and copies it: from then on the device holds the variable
// and its initial value. Measured on benchmarks/models.py's v1_session_cnn: 8.5 MiB
// in use after the initializer, 12.8 MiB after every training step since (the
// Momentum slots and biases, 4.3 MiB, twice).
//
// The Session runs the initializer before the training step, so the pass sees its
// graph first: RecordInitializedVariables notes those variables (by device,
// container and shared name), and the tensor table of a later graph that updates
// one of them gives it a persistent buffer of the initial value's size
// (HeldInitialValueOf), one per Const. Variables created eagerly (TF2, Keras) are initialized
// from tensors nothing keeps, and reach a tf.function's graph as arguments, not as
// VarHandleOps: they are never recorded.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_INITIAL_VALUES_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_INITIAL_VALUES_H_

#include <cstdint>
#include <string>

#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"

namespace tfmemopt {

// Records, process-wide, every VarHandleOp of `graph` that an AssignVariableOp
// assigns (through Identities), and with it the Const it is assigned from, if any.
void RecordInitializedVariables(const tensorflow::GraphDef& graph);

// The Const a recorded variable was initialized from. Variables initialized from one
// Const (Grappler merges identical constants, such as the zeros of an optimizer's two
// slots for one weight) share one buffer, so `id` names the Const, not the variable.
struct HeldInitialValue {
  std::string id;  // the Const, unique in the process
  int64_t bytes = 0;
};

// For a VarHandleOp of the same device, container and shared name as a recorded
// variable, its Const; bytes == 0 when none is recorded.
HeldInitialValue HeldInitialValueOf(const tensorflow::NodeDef& var_handle);

// Whether a graph the pass saw assigned the variable of this VarHandleOp: a Session's
// initializer made it, in that graph's order, before the step (simulate's
// ResidentHistory: the allocator's history before the step is then known).
bool InitializedByRecordedGraph(const tensorflow::NodeDef& var_handle);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_INITIAL_VALUES_H_
