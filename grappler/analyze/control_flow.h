// Analyze: which nodes run under control flow, where the planner must not act.
//
// A node inside a while-loop frame runs once per iteration, and a node in a branch
// of a lowered tf.cond may receive dead tensors. Cloning either outside its context
// would change what it computes, so both are left alone (and reported as such).
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_CONTROL_FLOW_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_CONTROL_FLOW_H_

#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

struct ControlFlowInfo {
  std::vector<bool> in_loop;      // per table node: inside a while-loop frame
  std::vector<bool> conditional;  // per table node: inside a tf.cond branch
  int num_loop_nodes = 0;
  int num_conditional_nodes = 0;

  // Nodes the pass added (past the analyzed graph) are never under control flow.
  bool Under(int node) const {
    return node < static_cast<int>(in_loop.size()) && (in_loop[node] || conditional[node]);
  }
};

// `order` is a topological order of the table's nodes (loop back edges aside).
absl::Status AnalyzeControlFlow(const tensorflow::GraphDef& graph, const TensorTable& table,
                                const std::vector<int>& order, ControlFlowInfo* info);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_CONTROL_FLOW_H_
