// Analyze: how long each node takes to run, as Grappler's OpLevelCostEstimator
// predicts it from the node's op, attributes, input shapes and device.
//
// The planner compares these figures with each other (the compute a recompute adds,
// against the forward pass it repeats) and with copy times (bytes / bandwidth), so
// they need to be consistent rather than exact.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_OP_COSTS_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_OP_COSTS_H_

#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/grappler/costs/graph_properties.h"

namespace tfmemopt {

// Fills NodeInfo::compute_seconds for every node of `table`. Nodes whose inputs
// have no inferred properties get the estimator's figure for unknown shapes.
void EstimateComputeSeconds(const tensorflow::grappler::GraphProperties& properties,
                            TensorTable* table);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_OP_COSTS_H_
