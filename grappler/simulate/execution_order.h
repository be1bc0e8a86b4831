// Simulate: the order a graph's steps are replayed in.
//
// It is the order Grappler's ComputeTopologicalOrder gives the graph (Kahn's
// algorithm: ready nodes first in node order, then breadth-first over sorted,
// deduplicated fan-outs; a Merge's NextIteration inputs count as ready), computed
// here on a tensor table. The planner simulates each candidate rewrite in it, and
// the verify stage, which sorts the rewritten GraphDef with Grappler's own
// function, gets the same order: planner and report judge a plan on one schedule.
#ifndef TFMEMOPT_GRAPPLER_SIMULATE_EXECUTION_ORDER_H_
#define TFMEMOPT_GRAPPLER_SIMULATE_EXECUTION_ORDER_H_

#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/tensor_table.h"

namespace tfmemopt {

absl::Status GrapplerTopologicalOrder(const TensorTable& table, std::vector<int>* order);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_SIMULATE_EXECUTION_ORDER_H_
