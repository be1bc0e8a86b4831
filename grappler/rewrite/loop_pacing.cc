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

int LoopOf(const TensorTable& table, int node) {
  const std::vector<int>& loop_of = table.loops.loop_of_node;
  return node < static_cast<int>(loop_of.size()) ? loop_of[node] : -1;
}

bool IsControlFlow(const NodeDef& node) {
  namespace g = tensorflow::grappler;
  return g::IsEnter(node) || g::IsExit(node) || g::IsMerge(node) || g::IsSwitch(node) ||
         g::IsNextIteration(node) || node.op() == "LoopCond";
}

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

// Whether `node` waits on its loop's predicate: it has a Switch of `loop` among its
// same-iteration ancestors, so it is dead when the loop exits.
bool WaitsOnPredicate(const TensorTable& table, int loop, int node) {
  for (int m : SameIterationAncestors(table, loop, node)) {
    if (tensorflow::grappler::IsSwitch(*table.nodes[m].def)) return true;
  }
  return false;
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

// The carried values (their Switches, sorted) that `node` reads within one iteration.
std::vector<int> CarriedValuesRead(const TensorTable& table, int loop, int node) {
  std::vector<int> switches;
  for (int m : SameIterationAncestors(table, loop, node)) {
    if (IsCarriedValueSwitch(table, loop, m)) switches.push_back(m);
  }
  std::sort(switches.begin(), switches.end());
  return switches;
}

// Adds the pacing edges of one graph: which producer waits for which carried value.
class LoopPacer {
 public:
  LoopPacer(const TensorTable& table, tensorflow::GraphDef* graph, LoopPacingResult* result)
      : table_(table), graph_(graph), result_(result) {
    for (int i = 0; i < graph->node_size(); ++i) index_[graph->node(i).name()] = i;
  }

  // Whether `p` may be given a pacing edge in `loop`: a node of the loop the output
  // still has, not control flow, not Const, not stateful, dead when the loop exits;
  // not a TensorList op either, which hands out an element the list holds (no new
  // memory: a swapped list's copies are paced by the loop swap).
  bool MayWait(int loop, int p) const {
    const NodeInfo& producer = table_.nodes[p];
    return LoopOf(table_, p) == loop && !IsControlFlow(*producer.def) && !producer.stateful &&
           producer.def->op() != "Const" && !absl::StartsWith(producer.def->op(), "TensorList") &&
           index_.contains(producer.def->name()) && WaitsOnPredicate(table_, loop, p);
  }

  // Makes `p` wait for the read of the carried value of Switch `sw`, unless `p`
  // already reads that value within the iteration, or the Switch waits for `p`
  // (a cycle). Returns whether `p` now waits (or already waited) for it.
  bool Wait(int loop, int p, int sw) {
    const std::vector<int>& own = CarriedBy(loop, p);
    if (std::binary_search(own.begin(), own.end(), sw) ||
        SameIterationAncestors(table_, loop, sw).contains(p)) {
      return false;
    }
    const std::string read = ReadOf(sw);
    const std::string& name = table_.nodes[p].def->name();
    if (!added_.emplace(read, name).second) return true;
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

  // The carried values (their Switches, sorted) `node` reads within an iteration.
  const std::vector<int>& CarriedBy(int loop, int node) {
    auto it = carried_.find(node);
    if (it == carried_.end()) {
      it = carried_.emplace(node, CarriedValuesRead(table_, loop, node)).first;
    }
    return it->second;
  }

  int values_waited_for() const { return static_cast<int>(waited_for_.size()); }

 private:
  // What a node waits for to start once its iteration has the carried value of a
  // Switch: an Identity reading the Switch's port 1 (the lowering's), or a new one
  // (a control edge from the Switch itself would be live when the loop exits).
  std::string ReadOf(int sw) {
    auto it = reads_.find(sw);
    if (it != reads_.end()) return it->second;
    std::string read;
    for (int c : table_.tensors[table_.nodes[sw].outputs[1]].consumers) {
      const NodeDef& def = *table_.nodes[c].def;
      if (def.op() == "Identity" && index_.contains(def.name()) &&
          (read.empty() || def.name() < read)) {
        read = def.name();
      }
    }
    if (read.empty()) {
      const NodeDef& sw_def = *table_.nodes[sw].def;
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
  absl::flat_hash_map<int, std::vector<int>> carried_;
  absl::flat_hash_map<int, std::string> reads_;
  std::set<std::pair<std::string, std::string>> added_;
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
    if (loop < 0 || loops[loop].parallel_iterations <= 1 || IsControlFlow(*consumer.def) ||
        consumer.inputs.size() < 2) {
      continue;
    }
    const std::vector<int> needed = pacer.CarriedBy(loop, c);
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
  for (int l = 0; l < static_cast<int>(loops.size()); ++l) {
    if (loops[l].parallel_iterations <= 1) continue;
    std::vector<std::pair<int, int>> values;  // (Switch, producer of the next value)
    for (int sw = 0; sw < n; ++sw) {
      if (LoopOf(table, sw) != l || !IsCarriedValueSwitch(table, l, sw)) continue;
      const int merge = table.tensors[table.nodes[sw].inputs[0]].node;
      for (int t : table.nodes[merge].inputs) {
        const NodeInfo& next = table.nodes[table.tensors[t].node];
        if (!g::IsNextIteration(*next.def) || next.inputs.size() != 1) continue;
        const int p = ProducerThroughIdentities(table, next.inputs[0]);
        if (pacer.MayWait(l, p)) values.emplace_back(sw, p);
      }
    }
    for (size_t v = 1; v < values.size(); ++v) {
      pacer.Wait(l, values[v].second, values[0].first);
      pacer.Wait(l, values[0].second, values[v].first);
    }
  }
  result->values = pacer.values_waited_for();
  return absl::OkStatus();
}

}  // namespace tfmemopt
