#include "grappler/analyze/control_flow.h"

#include <algorithm>

#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/grappler/utils.h"
#include "tensorflow/core/grappler/utils/frame.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

bool IsLoopMerge(const TensorTable& table, const NodeDef& merge) {
  for (const std::string& input : merge.input()) {
    auto it = table.node_index.find(tensorflow::grappler::NodeName(input));
    if (it != table.node_index.end() &&
        tensorflow::grappler::IsNextIteration(*table.nodes[it->second].def)) {
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status AnalyzeControlFlow(const tensorflow::GraphDef& graph, const TensorTable& table,
                                const std::vector<int>& order, ControlFlowInfo* info) {
  const int n = static_cast<int>(table.nodes.size());
  info->in_loop.assign(n, false);
  info->conditional.assign(n, false);
  info->num_loop_nodes = info->num_conditional_nodes = 0;

  tensorflow::grappler::FrameView frames;
  absl::Status status = frames.InferFromGraph(graph);
  if (!status.ok()) return status;
  for (int i = 0; i < n; ++i) {
    if (frames.IsInFrame(*table.nodes[i].def)) {
      info->in_loop[i] = true;
      ++info->num_loop_nodes;
    }
  }

  // Nesting depth of tf.cond branches, along the order: a Switch opens a branch,
  // the Merge that joins it closes one (a loop's own Merge/Switch/Exit, fed by
  // NextIteration, balance each other instead). Back edges are skipped.
  std::vector<int> position(n, -1);
  for (size_t s = 0; s < order.size(); ++s) position[order[s]] = static_cast<int>(s);
  std::vector<int> depth(n, 0);
  for (int node : order) {
    const NodeDef& def = *table.nodes[node].def;
    int d = 0;
    for (const std::string& input : def.input()) {
      auto it = table.node_index.find(tensorflow::grappler::NodeName(input));
      if (it == table.node_index.end() || position[it->second] >= position[node]) continue;
      int from = depth[it->second];
      if (tensorflow::grappler::IsSwitch(*table.nodes[it->second].def)) ++from;
      d = std::max(d, from);
    }
    if (tensorflow::grappler::IsMerge(def) && !IsLoopMerge(table, def)) d = std::max(0, d - 1);
    if (tensorflow::grappler::IsExit(def)) d = std::max(0, d - 1);
    depth[node] = d;
    if (d > 0) {
      info->conditional[node] = true;
      ++info->num_conditional_nodes;
    }
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
