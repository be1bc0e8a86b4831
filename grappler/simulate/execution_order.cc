#include "grappler/simulate/execution_order.h"

#include <algorithm>

#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {

absl::Status GrapplerTopologicalOrder(const TensorTable& table, std::vector<int>* order) {
  const int n = static_cast<int>(table.nodes.size());
  // Fan-ins (data and control producers), sorted and deduplicated, as flat lists.
  std::vector<int> fanin_start(n + 1, 0), fanins;
  fanins.reserve(table.tensors.size() + n);
  std::vector<int> scratch;
  for (int i = 0; i < n; ++i) {
    const NodeInfo& node = table.nodes[i];
    scratch.clear();
    for (int t : node.inputs) scratch.push_back(table.tensors[t].node);
    scratch.insert(scratch.end(), node.control_inputs.begin(), node.control_inputs.end());
    std::sort(scratch.begin(), scratch.end());
    scratch.erase(std::unique(scratch.begin(), scratch.end()), scratch.end());
    fanins.insert(fanins.end(), scratch.begin(), scratch.end());
    fanin_start[i + 1] = static_cast<int>(fanins.size());
  }
  // Fan-outs, in increasing node order (built by visiting consumers in order).
  std::vector<int> fanout_start(n + 1, 0), fanouts(fanins.size());
  for (int f : fanins) ++fanout_start[f + 1];
  for (int i = 0; i < n; ++i) fanout_start[i + 1] += fanout_start[i];
  std::vector<int> fill(fanout_start.begin(), fanout_start.end() - 1);
  for (int i = 0; i < n; ++i) {
    for (int k = fanin_start[i]; k < fanin_start[i + 1]; ++k) fanouts[fill[fanins[k]]++] = i;
  }

  std::vector<int> ready_inputs(n, 0);
  order->clear();
  order->reserve(n);
  for (int i = 0; i < n; ++i) {
    if (fanin_start[i] == fanin_start[i + 1]) order->push_back(i);
    if (tensorflow::grappler::IsMerge(*table.nodes[i].def)) {
      for (int k = fanin_start[i]; k < fanin_start[i + 1]; ++k) {
        if (tensorflow::grappler::IsNextIteration(*table.nodes[fanins[k]].def)) ++ready_inputs[i];
      }
    }
  }
  for (size_t front = 0; front < order->size(); ++front) {
    const int node = (*order)[front];
    for (int k = fanout_start[node]; k < fanout_start[node + 1]; ++k) {
      const int next = fanouts[k];
      if (++ready_inputs[next] == fanin_start[next + 1] - fanin_start[next]) {
        order->push_back(next);
      }
    }
  }
  if (static_cast<int>(order->size()) != n) {
    return absl::InvalidArgumentError("the graph cannot be sorted topologically (a cycle)");
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
