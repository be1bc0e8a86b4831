#include "grappler/rewrite/loop_pacing.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

// The node that computes tensor `t`, looking through Identities.
int ProducerThroughIdentities(const TensorTable& table, int t) {
  int node = table.tensors[t].node;
  while (table.nodes[node].def->op() == "Identity" && table.nodes[node].inputs.size() == 1) {
    node = table.tensors[table.nodes[node].inputs[0]].node;
  }
  return node;
}

// The nodes of `loop` that `node` waits for within one iteration (data and control
// inputs), `node` included. A Merge is where an iteration starts: its inputs come from
// outside the loop or from the previous iteration, so the walk stops there.
absl::flat_hash_set<int> SameIterationAncestors(const TensorTable& table, int loop, int node) {
  absl::flat_hash_set<int> seen{node};
  std::vector<int> stack{node};
  while (!stack.empty()) {
    const int n = stack.back();
    stack.pop_back();
    const NodeInfo& info = table.nodes[n];
    if (tensorflow::grappler::IsMerge(*info.def)) continue;
    auto visit = [&](int m) {
      if (LoopOf(table, m) == loop && seen.insert(m).second) stack.push_back(m);
    };
    for (int t : info.inputs) visit(table.tensors[t].node);
    for (int m : info.control_inputs) visit(m);
  }
  return seen;
}

// Whether `sw` (a node of `loop`) is the Switch of a value the loop carries from one
// iteration to the next that its compute produces: a Merge of the loop at input 0, a
// NextIteration among the Merge's inputs, and a float type (not the counter, a
// TensorList or a resource, whose chains cost nothing and run ahead by design).
bool IsCarriedValueSwitch(const TensorTable& table, int loop, int sw) {
  namespace g = tensorflow::grappler;
  const NodeInfo& s = table.nodes[sw];
  if (!g::IsSwitch(*s.def) || s.inputs.empty() || s.outputs.size() < 2) return false;
  const int merge = table.tensors[s.inputs[0]].node;
  if (LoopOf(table, merge) != loop || !g::IsMerge(*table.nodes[merge].def)) return false;
  bool carried = false;
  for (int t : table.nodes[merge].inputs) {
    carried |= g::IsNextIteration(*table.nodes[table.tensors[t].node].def);
  }
  return carried && tensorflow::DataTypeIsFloating(table.tensors[s.outputs[1]].dtype);
}

// Adds the pacing edges of one graph: which producer waits for which carried value.
class LoopPacer {
 public:
  // What one walk over a node's same-iteration ancestors tells.
  struct NodeFacts {
    std::vector<int> carried;  // the carried values it reads (their Switches, sorted)
    // It has a Switch of its loop among its ancestors, so it is dead when the loop
    // exits.
    bool waits_on_predicate = false;
  };

  LoopPacer(const TensorTable& table, tensorflow::GraphDef* graph, LoopPacingResult* result)
      : table_(table), graph_(graph), result_(result) {
    for (int i = 0; i < graph->node_size(); ++i) {
      const NodeDef& node = graph->node(i);
      index_[node.name()] = i;
      if (node.op() == "Identity" && node.input_size() == 1) {
        auto [it, inserted] = identity_of_.emplace(node.input(0), node.name());
        if (!inserted && node.name() < it->second) it->second = node.name();
      }
    }
  }

  // Whether `p` may be given a pacing edge in `loop`: a node of the loop the output
  // still has, not control flow, not Const, not stateful, dead when the loop exits;
  // a TensorList op only when it reads one element (PopBack, GetItem): the others
  // pass the list itself along and allocate nothing per element, and a swapped list's
  // copies are paced by the loop swap. A read of an element never set allocates
  // zeros (a gradient loop's lists of gradients nothing wrote), so unpaced such
  // reads run ahead with their memory.
  bool MayWait(int loop, int p) {
    const NodeInfo& producer = table_.nodes[p];
    const std::string& op = producer.def->op();
    return LoopOf(table_, p) == loop && !tensorflow::grappler::IsControlFlow(*producer.def) &&
           !producer.stateful && op != "Const" &&
           (!absl::StartsWith(op, "TensorList") || op == "TensorListPopBack" ||
            op == "TensorListGetItem") &&
           index_.contains(producer.def->name()) && FactsOf(loop, p).waits_on_predicate;
  }

  // Makes `p` wait for the read of the carried value of Switch `sw`, unless `p`
  // already reads that value within the iteration, or the Switch waits for `p`
  // (a cycle). Returns whether `p` now waits (or already waited) for it.
  bool Wait(int loop, int p, int sw) {
    const std::vector<int>& own = FactsOf(loop, p).carried;
    if (std::binary_search(own.begin(), own.end(), sw) ||
        SameIterationAncestors(table_, loop, sw).contains(p)) {
      return false;
    }
    const std::string read = ReadOf(sw);
    const std::string& name = table_.nodes[p].def->name();
    NodeDef* waiting = graph_->mutable_node(index_.at(name));
    const std::string control = absl::StrCat("^", read);
    for (const std::string& input : waiting->input()) {
      if (input == control) return true;
    }
    waiting->add_input(control);
    waited_for_.insert(sw);
    result_->edges.emplace_back(read, name);
    return true;
  }

  const NodeFacts& FactsOf(int loop, int node) {  // memoized
    auto it = facts_.find(node);
    if (it != facts_.end()) return it->second;
    NodeFacts facts;
    for (int m : SameIterationAncestors(table_, loop, node)) {
      facts.waits_on_predicate |= tensorflow::grappler::IsSwitch(*table_.nodes[m].def);
      if (IsCarriedValueSwitch(table_, loop, m)) facts.carried.push_back(m);
    }
    std::sort(facts.carried.begin(), facts.carried.end());
    return facts_.emplace(node, std::move(facts)).first->second;
  }

  int values_waited_for() const { return static_cast<int>(waited_for_.size()); }

 private:
  // What a node waits for to start once its iteration has the carried value of a
  // Switch: an Identity reading the Switch's port 1 already in the graph (the
  // lowering's, or the loop swap's trigger), or a new one (a control edge from the
  // Switch itself would be live when the loop exits). A second Identity of the same
  // port would be merged into the first by TF's common-subexpression elimination
  // when the meta-optimizer runs again, moving our edges onto a node we did not name.
  std::string ReadOf(int sw) {
    auto it = reads_.find(sw);
    if (it != reads_.end()) return it->second;
    const NodeDef& sw_def = *table_.nodes[sw].def;
    auto existing = identity_of_.find(absl::StrCat(sw_def.name(), ":1"));
    std::string read = existing == identity_of_.end() ? "" : existing->second;
    if (read.empty()) {
      read = absl::StrCat(kLoopPaceScope, sw_def.name());
      if (!index_.contains(read)) {
        NodeDef* identity = graph_->add_node();
        identity->set_name(read);
        identity->set_op("Identity");
        identity->set_device(sw_def.device());
        identity->add_input(absl::StrCat(sw_def.name(), ":1"));
        (*identity->mutable_attr())["T"].set_type(
            table_.tensors[table_.nodes[sw].outputs[1]].dtype);
        index_[read] = graph_->node_size() - 1;
      }
    }
    reads_.emplace(sw, read);
    return read;
  }

  const TensorTable& table_;
  tensorflow::GraphDef* graph_;
  LoopPacingResult* result_;
  absl::flat_hash_map<std::string, int> index_;
  // The Identity (least name) reading each tensor and nothing else, by tensor name.
  absl::flat_hash_map<std::string, std::string> identity_of_;
  absl::flat_hash_map<int, NodeFacts> facts_;
  absl::flat_hash_map<int, std::string> reads_;
  std::set<int> waited_for_;
};

}  // namespace

absl::Status PaceLoops(const TensorTable& table, tensorflow::GraphDef* graph,
                       LoopPacingResult* result) {
  namespace g = tensorflow::grappler;
  const std::vector<LoopFrame>& loops = table.loops.loops;
  if (loops.empty()) return absl::OkStatus();
  LoopPacer pacer(table, graph, result);
  const int n = static_cast<int>(table.nodes.size());

  // A value combined with a carried value it is computed without waits for that
  // value's read: its producer could otherwise run parallel_iterations ahead.
  for (int c = 0; c < n; ++c) {
    const int loop = LoopOf(table, c);
    const NodeInfo& consumer = table.nodes[c];
    if (loop < 0 || loops[loop].parallel_iterations <= 1 ||
        g::IsControlFlow(*consumer.def) || consumer.inputs.size() < 2) {
      continue;
    }
    const std::vector<int> needed = pacer.FactsOf(loop, c).carried;
    for (int t : consumer.inputs) {
      const int p = ProducerThroughIdentities(table, t);
      if (!pacer.MayWait(loop, p)) continue;
      for (int sw : needed) {
        if (pacer.Wait(loop, p, sw)) break;
      }
    }
  }

  // Lockstep: the carried values of a loop advance together. Each one's next value
  // waits for the read of the first one (lowest index) in the same iteration, and the
  // first one's next value waits for every other's read, so no chain runs more than
  // about two iterations ahead of another (a recurrent gradient ahead of its
  // weight-gradient sums keeps each iteration's gradient of the state, which the
  // sums' terms read, on the device).
  // (Switch, producer of the next value) of each loop's carried values.
  std::vector<std::vector<std::pair<int, int>>> values(loops.size());
  for (int sw = 0; sw < n; ++sw) {
    const int l = LoopOf(table, sw);
    if (l < 0 || loops[l].parallel_iterations <= 1 || !IsCarriedValueSwitch(table, l, sw)) {
      continue;
    }
    const int merge = table.tensors[table.nodes[sw].inputs[0]].node;
    for (int t : table.nodes[merge].inputs) {
      const NodeInfo& next = table.nodes[table.tensors[t].node];
      if (!g::IsNextIteration(*next.def) || next.inputs.size() != 1) continue;
      const int p = ProducerThroughIdentities(table, next.inputs[0]);
      if (pacer.MayWait(l, p)) values[l].emplace_back(sw, p);
    }
  }
  for (int l = 0; l < static_cast<int>(loops.size()); ++l) {
    for (size_t v = 1; v < values[l].size(); ++v) {
      pacer.Wait(l, values[l][v].second, values[l][0].first);
      pacer.Wait(l, values[l][0].second, values[l][v].first);
    }
  }
  result->values = pacer.values_waited_for();
  return absl::OkStatus();
}

}  // namespace tfmemopt
