#include "grappler/plan/pin_order.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "grappler/rewrite/loop_swap.h"
#include "grappler/simulate/liveness_simulator.h"
#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {
namespace {

// Whether `ancestor` is `node` or runs before it by some path of data or control
// edges (back edges of loops included: they only add paths). An edge from `node`
// to `ancestor` would then close a cycle.
bool Reaches(const TensorTable& table, int ancestor, int node) {
  std::vector<bool> seen(table.nodes.size(), false);
  std::vector<int> stack = {node};
  seen[node] = true;
  while (!stack.empty()) {
    const int n = stack.back();
    stack.pop_back();
    if (n == ancestor) return true;
    auto visit = [&](int m) {
      if (m >= 0 && !seen[m]) {
        seen[m] = true;
        stack.push_back(m);
      }
    };
    for (int t : table.nodes[n].inputs) visit(table.tensors[t].node);
    for (int c : table.nodes[n].control_inputs) visit(c);
  }
  return false;
}

// The first step where `emulated` leaves `target`, untimed nodes skipped in both:
// (index in emulated, index in target), or both at their ends.
std::pair<size_t, size_t> FirstDifference(const TensorTable& table,
                                          const std::vector<int>& emulated,
                                          const std::vector<int>& target) {
  size_t i = 0, j = 0;
  while (true) {
    while (i < emulated.size() && IsUntimed(*table.nodes[emulated[i]].def)) ++i;
    while (j < target.size() && IsUntimed(*table.nodes[target[j]].def)) ++j;
    if (i == emulated.size() || j == target.size() || emulated[i] != target[j]) return {i, j};
    ++i;
    ++j;
  }
}

}  // namespace

bool IsUntimed(const tensorflow::NodeDef& def) {
  return tensorflow::grappler::IsConstant(def);
}

bool MayWait(const TensorTable& table, const ControlFlowInfo& flow, int n) {
  const tensorflow::NodeDef& def = *table.nodes[n].def;
  if (flow.Under(n) || tensorflow::grappler::IsControlFlow(def) || IsLoopSwapNode(def)) {
    return false;
  }
  const std::string& op = def.op();
  return op != "_Arg" && op != "Placeholder" && op != "PlaceholderWithDefault" &&
         !IsUntimed(def);
}

bool MayBeWaitedFor(const TensorTable& table, const ControlFlowInfo& flow, int n) {
  const tensorflow::NodeDef& def = *table.nodes[n].def;
  // A function's return values are no nodes of its body once TF makes the function:
  // it rejects an edge out of one ("The source of control edge ... is not in the
  // body").
  return !flow.Under(n) && !tensorflow::grappler::IsControlFlow(def) && !IsLoopSwapNode(def) &&
         !IsUntimed(def) && !IsReturnValue(def);
}

absl::Status PinOrder(TensorTable* table, const ControlFlowInfo& flow,
                      const std::vector<int>& target, int max_edges, TableEdit* edit,
                      PinnedOrder* pinned, std::vector<int>* order,
                      const std::vector<InlineChoice>& choices) {
  pinned->edges.clear();
  pinned->complete = false;
  if (target.size() != table->nodes.size()) {
    return absl::InvalidArgumentError("pin order: the target does not cover the graph");
  }
  if (choices.empty()) return absl::InvalidArgumentError("pin order: no inline choice");
  std::vector<int> other;
  while (true) {
    // The first choice whose order leaves the target, and where.
    std::pair<size_t, size_t> at;
    const std::vector<int>* differs = nullptr;
    for (size_t c = 0; c < choices.size() && differs == nullptr; ++c) {
      std::vector<int>* emulated = c == 0 ? order : &other;
      absl::Status status = ExecutorOrder(*table, emulated, choices[c]);
      if (!status.ok()) return status;
      at = FirstDifference(*table, *emulated, target);
      if (at.first < emulated->size() || at.second < target.size()) differs = emulated;
    }
    if (differs == nullptr) {
      pinned->complete = true;
      return absl::OkStatus();
    }
    if (static_cast<int>(pinned->edges.size()) >= max_edges) return absl::OkStatus();
    // Both orders hold every node, so neither runs out before the other.
    if (at.first >= differs->size() || at.second >= target.size()) {
      return absl::InternalError("pin order: the orders hold different nodes");
    }
    const int early = (*differs)[at.first], due = target[at.second];
    if (!MayWait(*table, flow, early) || !MayBeWaitedFor(*table, flow, due) ||
        Reaches(*table, early, due)) {
      return absl::OkStatus();
    }
    if (edit != nullptr) edit->SaveControlInputs(*table, early);
    table->nodes[early].control_inputs.push_back(due);
    pinned->edges.push_back({due, early});
  }
}

std::vector<std::pair<std::string, std::string>> PinnedEdgeNames(const TensorTable& table,
                                                                 const PinnedOrder& pinned) {
  std::vector<std::pair<std::string, std::string>> names;
  for (const auto& [from, to] : pinned.edges) {
    names.push_back({table.nodes[from].def->name(), table.nodes[to].def->name()});
  }
  return names;
}

absl::Status ApplyPinnedEdges(const std::vector<std::pair<std::string, std::string>>& edges,
                              tensorflow::GraphDef* graph) {
  if (edges.empty()) return absl::OkStatus();
  absl::flat_hash_map<std::string, int> index;
  for (int i = 0; i < graph->node_size(); ++i) index[graph->node(i).name()] = i;
  for (const auto& [from, to] : edges) {
    auto f = index.find(from);
    auto t = index.find(to);
    if (f == index.end() || t == index.end()) {
      return absl::InternalError(absl::StrCat("pin order: no node ", f == index.end() ? from : to));
    }
    graph->mutable_node(t->second)->add_input(absl::StrCat("^", from));
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
