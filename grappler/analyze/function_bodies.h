// Analyze: the bodies of functions that Grappler hands the pass as signatures only.
//
// A function call that Grappler's function optimizer does not inline stays a
// PartitionedCall / StatefulPartitionedCall node. Calls XLA compiles
// (_XlaMustCompile) are such calls, and the meta-optimizer gives custom optimizers
// their functions as stubs: signature and attributes, no nodes (seen on TF 2.21 for
// the forward and backward functions of Keras' grouped Conv2D, both in a
// tf.function and in tfmemopt.analyze). Without the body, shape inference cannot see
// through the call and the kernel-memory model cannot see what XLA will compile.
// The bodies are still in the process's eager context, which Python hands over
// (tfmemopt._eager_context) so they can be looked up by name.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_FUNCTION_BODIES_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_FUNCTION_BODIES_H_

#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

// The eager context (a TFE_Context*) to read function bodies from; null: none.
void SetEagerContext(void* context);

// Whether `graph`'s library holds a stub function (no nodes, some outputs).
bool HasStubFunctions(const tensorflow::GraphDef& graph);

// Fills in the bodies of stub functions (no nodes, some outputs) of `graph`'s
// library from the eager context. Returns whether any was filled.
bool FillFunctionBodies(tensorflow::GraphDef* graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_FUNCTION_BODIES_H_
