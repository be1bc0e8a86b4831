#include "grappler/rewrite/onednn_merge_guard.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/grappler/utils/topological_sort.h"

namespace tfmemopt {
namespace {

using tensorflow::GraphDef;
using tensorflow::NodeDef;

// TF's EdgeSet keeps up to 64 / sizeof(void*) edges inline, in insertion order; past
// that it is a hash set, and CheckForNodeMerge's comparison of the two nodes'
// control inputs (in EdgeSet order) no longer depends on the GraphDef.
constexpr int kEdgeSetInline = 64 / sizeof(const void*);

bool IsControl(absl::string_view input) { return absl::StartsWith(input, "^"); }

// "name", "name:0" -> ("name", 0); "name:2" -> ("name", 2).
std::pair<std::string, int> ParseTensor(absl::string_view input) {
  const size_t colon = input.rfind(':');
  if (colon == absl::string_view::npos) return {std::string(input), 0};
  int index = 0;
  for (char c : input.substr(colon + 1)) {
    if (c < '0' || c > '9') return {std::string(input), 0};
    index = index * 10 + (c - '0');
  }
  return {std::string(input.substr(0, colon)), index};
}

std::vector<std::string> ControlInputs(const NodeDef& node) {
  std::vector<std::string> out;
  for (const std::string& input : node.input()) {
    if (IsControl(input)) out.push_back(input.substr(1));
  }
  return out;
}

int DataInputCount(const NodeDef& node) {
  int count = 0;
  for (const std::string& input : node.input()) count += IsControl(input) ? 0 : 1;
  return count;
}

// Consumers of each node: (consumer index, input slot or -1 for a control input).
class GraphIndex {
 public:
  explicit GraphIndex(const GraphDef& graph) : graph_(graph) {
    for (int i = 0; i < graph.node_size(); ++i) index_[graph.node(i).name()] = i;
    consumers_.resize(graph.node_size());
    producers_.resize(graph.node_size());
    for (int i = 0; i < graph.node_size(); ++i) {
      const NodeDef& node = graph.node(i);
      for (int slot = 0; slot < node.input_size(); ++slot) {
        const std::string& input = node.input(slot);
        const bool control = IsControl(input);
        const int from = Find(control ? input.substr(1) : ParseTensor(input).first);
        if (from < 0) continue;
        consumers_[from].push_back({i, control ? -1 : slot});
        producers_[i].push_back(from);
      }
    }
  }
  int Find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? -1 : it->second;
  }
  const NodeDef& node(int i) const { return graph_.node(i); }
  const std::vector<std::pair<int, int>>& consumers(int i) const { return consumers_[i]; }
  // Every node reachable from `from` along data and control edges, `from` included.
  std::unordered_set<int> Descendants(const std::vector<int>& from) const {
    std::unordered_set<int> seen(from.begin(), from.end());
    std::deque<int> queue(from.begin(), from.end());
    while (!queue.empty()) {
      const int n = queue.front();
      queue.pop_front();
      for (const auto& [consumer, slot] : consumers_[n]) {
        if (seen.insert(consumer).second) queue.push_back(consumer);
      }
    }
    return seen;
  }
  // Every node from which `to` is reachable, `to` included.
  std::unordered_set<int> Ancestors(int to) const {
    std::unordered_set<int> seen = {to};
    std::deque<int> queue = {to};
    while (!queue.empty()) {
      const int n = queue.front();
      queue.pop_front();
      for (int producer : producers_[n]) {
        if (seen.insert(producer).second) queue.push_back(producer);
      }
    }
    return seen;
  }

 private:
  const GraphDef& graph_;
  std::unordered_map<std::string, int> index_;
  std::vector<std::vector<std::pair<int, int>>> consumers_;
  std::vector<std::vector<int>> producers_;
};

// A pair the layout pass merges: `first` feeds `second` (Conv2D + BiasAdd, Pad +
// conv), or both read the same gradient (Conv2DBackpropFilter + BiasAddGrad).
struct MergePair {
  std::string first, second;
  bool first_feeds_second = false;
  std::vector<std::string> control;  // the control inputs both have in the original
  // Conv2DBackpropFilter + BiasAddGrad only: the other Conv2DBackpropFilter nodes that
  // read the same gradient (the bias gradients of convolutions whose outputs are
  // summed, e.g. a residual block's two branches, are one node after CSE).
  std::vector<std::string> rivals;
};

// Each node's position in the order Grappler's meta-optimizer leaves the graph in
// (TopologicalSort), or its GraphDef index if the graph has a cycle.
std::vector<int> TopologicalRank(const GraphDef& graph) {
  std::vector<int> rank(graph.node_size());
  for (int i = 0; i < graph.node_size(); ++i) rank[i] = i;
  std::vector<const NodeDef*> order;
  if (!tensorflow::grappler::ComputeTopologicalOrder(graph, &order).ok()) return rank;
  // NodeDefs of a RepeatedPtrField are allocated one by one: map them by address.
  std::unordered_map<const NodeDef*, int> index;
  for (int i = 0; i < graph.node_size(); ++i) index[&graph.node(i)] = i;
  for (size_t i = 0; i < order.size(); ++i) rank[index.at(order[i])] = static_cast<int>(i);
  return rank;
}

// The node whose output 0 is `second`'s input `slot`, if its op is one of `ops`.
int ProducerOf(const GraphIndex& graph, const NodeDef& second, int slot,
               const std::vector<absl::string_view>& ops) {
  if (slot >= second.input_size() || IsControl(second.input(slot))) return -1;
  const auto [name, index] = ParseTensor(second.input(slot));
  const int producer = graph.Find(name);
  if (producer < 0 || index != 0) return -1;
  const std::string& op = graph.node(producer).op();
  return std::find(ops.begin(), ops.end(), op) != ops.end() ? producer : -1;
}

// The pairs of `graph` that meet the layout pass's merge conditions on edges.
std::vector<MergePair> MergeablePairs(const GraphDef& graph) {
  GraphIndex index(graph);
  std::vector<int> rank;  // computed for the first BiasAddGrad
  std::vector<MergePair> pairs;
  for (int i = 0; i < graph.node_size(); ++i) {
    const NodeDef& node = graph.node(i);
    int first = -1;
    bool feeds = true;
    std::vector<int> rivals;
    if (node.op() == "BiasAdd") {
      first = ProducerOf(index, node, 0, {"Conv2D"});
    } else if (node.op() == "Conv2D" || node.op() == "_FusedConv2D") {
      first = ProducerOf(index, node, 0, {"Pad"});
    } else if (node.op() == "BiasAddGrad" && node.input_size() > 0 &&
               !IsControl(node.input(0))) {
      // GetConv2DBackpropFilterOrBiasAddGrad: the first out-edge of the gradient's
      // producer to a Conv2DBackpropFilter reading it as input 2. Out-edges are kept
      // in the order the consumers were added to TF's Graph, which is the order of the
      // GraphDef that Grappler returns: a topological sort.
      feeds = false;
      const auto gradient = ParseTensor(node.input(0));
      const int producer = index.Find(gradient.first);
      if (producer < 0) continue;
      if (rank.empty()) rank = TopologicalRank(graph);
      for (const auto& [consumer, slot] : index.consumers(producer)) {
        const NodeDef& candidate = index.node(consumer);
        if (slot == 2 && candidate.op() == "Conv2DBackpropFilter" &&
            ParseTensor(candidate.input(2)) == gradient) {
          rivals.push_back(consumer);
          if (first < 0 || rank[consumer] < rank[first]) first = consumer;
        }
      }
      rivals.erase(std::remove(rivals.begin(), rivals.end(), first), rivals.end());
    }
    if (first < 0) continue;
    if (feeds && index.consumers(first).size() != 1) continue;  // its one out-edge
    std::vector<std::string> control = ControlInputs(node);
    if (ControlInputs(index.node(first)) != control) continue;
    MergePair pair{index.node(first).name(), node.name(), feeds, std::move(control), {}};
    for (int rival : rivals) pair.rivals.push_back(index.node(rival).name());
    pairs.push_back(std::move(pair));
  }
  return pairs;
}

void SetControlInputs(NodeDef* node, const std::vector<std::string>& control) {
  std::vector<std::string> data;
  for (const std::string& input : node->input()) {
    if (!IsControl(input)) data.push_back(input);
  }
  node->clear_input();
  for (const std::string& input : data) node->add_input(input);
  for (const std::string& name : control) node->add_input(absl::StrCat("^", name));
}

}  // namespace

absl::Status KeepOneDnnMerges(const GraphDef& original, GraphDef* rewritten,
                              MergeGuardResult* result) {
  *result = MergeGuardResult();
  const std::vector<MergePair> pairs = MergeablePairs(original);
  result->pairs = static_cast<int>(pairs.size());
  if (pairs.empty()) return absl::OkStatus();
  // Rebuilt after an edit: edits change consumers and reachability.
  auto index = std::make_unique<GraphIndex>(*rewritten);
  bool stale = false;
  for (const MergePair& pair : pairs) {
    if (stale) index = std::make_unique<GraphIndex>(*rewritten);
    stale = false;
    const GraphIndex& graph = *index;  // not used after an edit below
    const int a = graph.Find(pair.first), b = graph.Find(pair.second);
    if (a < 0 || b < 0) continue;
    const std::vector<std::string>& original_control = pair.control;
    const std::vector<std::string> control_a = ControlInputs(graph.node(a));
    const std::vector<std::string> control_b = ControlInputs(graph.node(b));
    bool edited = false;

    if (control_a != control_b) {
      // What the pass added to either node, in a fixed order (the first node's, then
      // the second's), kept where the merged node could wait for it without a cycle.
      std::vector<std::string> added;
      for (const auto* list : {&control_a, &control_b}) {
        for (const std::string& name : *list) {
          if (std::find(original_control.begin(), original_control.end(), name) ==
                  original_control.end() &&
              std::find(added.begin(), added.end(), name) == added.end()) {
            added.push_back(name);
          }
        }
      }
      const std::unordered_set<int> after_pair = graph.Descendants({a, b});
      std::vector<std::string> keep;
      for (const std::string& name : added) {
        const int from = graph.Find(name);
        if (from >= 0 && !after_pair.count(from)) keep.push_back(name);
      }
      const int control_count = static_cast<int>(original_control.size() + keep.size());
      if (DataInputCount(graph.node(a)) + control_count > kEdgeSetInline ||
          DataInputCount(graph.node(b)) + control_count > kEdgeSetInline) {
        keep.clear();
      }
      std::vector<std::string> control = original_control;
      control.insert(control.end(), keep.begin(), keep.end());
      for (const auto& [list, node] : {std::make_pair(&control_a, a), std::make_pair(&control_b, b)}) {
        for (const std::string& name : keep) {
          if (std::find(list->begin(), list->end(), name) == list->end()) ++result->edges_shared;
        }
        for (const std::string& name : *list) {
          if (std::find(control.begin(), control.end(), name) == control.end()) {
            ++result->edges_removed;
          }
        }
        SetControlInputs(rewritten->mutable_node(node), control);
      }
      edited = stale = true;
    }

    if (pair.first_feeds_second) {
      // The first node's control out-edges start at the second node instead: whoever
      // waited for the first waits for the merged node. (A control input from the
      // first node to the second was taken back above: it is not an original one, and
      // the first node reaches itself.)
      if (edited) index = std::make_unique<GraphIndex>(*rewritten);
      const GraphIndex& now = *index;
      stale = false;
      std::unordered_set<int> before_second;  // nodes that reach the second node
      bool ancestors_known = false;
      for (const auto& [consumer, slot] : now.consumers(a)) {
        if (consumer == b) continue;
        if (slot >= 0) {
          result->unmerged.push_back(absl::StrCat(pair.first, " + ", pair.second));
          continue;
        }
        if (!ancestors_known) {
          before_second = now.Ancestors(b);
          ancestors_known = true;
        }
        NodeDef* waiting = rewritten->mutable_node(consumer);
        std::vector<std::string> control = ControlInputs(*waiting);
        control.erase(std::remove(control.begin(), control.end(), pair.first), control.end());
        if (!before_second.count(consumer) &&
            std::find(control.begin(), control.end(), pair.second) == control.end()) {
          control.push_back(pair.second);
          ++result->edges_moved;
        } else {
          ++result->edges_removed;
        }
        SetControlInputs(waiting, control);
        stale = true;
      }
    }

    if (!pair.rivals.empty()) {
      // The same partner as in the original: a rival that the rewrite moved ahead of
      // it in the topological sort would take the merge, and the bias gradient would
      // come from another convolution's oneDNN primitive (other last bits). Each
      // rival waits for the partner, unless the rewritten graph makes it run before
      // the partner: then the rival takes the merge, and the pair is listed in
      // `unmerged`. (Past kEdgeSetInline out-edges of the gradient TF keeps them in a
      // hash set, and the partner is not decided by the order at all.)
      if (stale) index = std::make_unique<GraphIndex>(*rewritten);
      stale = false;
      const int partner = index->Find(pair.first);
      const std::unordered_set<int> before_partner = index->Ancestors(partner);
      for (const std::string& name : pair.rivals) {
        const int rival = index->Find(name);
        if (rival < 0) continue;
        std::vector<std::string> control = ControlInputs(index->node(rival));
        if (std::find(control.begin(), control.end(), pair.first) != control.end()) continue;
        if (before_partner.count(rival)) {
          result->unmerged.push_back(absl::StrCat(pair.first, " + ", pair.second, " (", name,
                                                  " runs first)"));
          continue;
        }
        control.push_back(pair.first);
        SetControlInputs(rewritten->mutable_node(rival), control);
        ++result->partner_edges;
        stale = true;
      }
    }
  }
  std::sort(result->unmerged.begin(), result->unmerged.end());
  result->unmerged.erase(std::unique(result->unmerged.begin(), result->unmerged.end()),
                         result->unmerged.end());
  return absl::OkStatus();
}

absl::Status BreakMergeCycles(const GraphDef& original, GraphDef* rewritten,
                              MergeGuardResult* result) {
  std::set<std::pair<std::string, std::string>> original_edges;  // (waited for, waiting)
  for (const NodeDef& node : original.node()) {
    for (const std::string& name : ControlInputs(node)) original_edges.insert({name, node.name()});
  }
  // Each round breaks the paths of one pair; a pair with a path left is kept apart,
  // so the rounds end.
  for (int round = 0; round <= rewritten->node_size(); ++round) {
    const GraphIndex index(*rewritten);
    bool edited = false;
    for (const MergePair& pair : MergeablePairs(*rewritten)) {
      if (pair.first_feeds_second) continue;  // the first node's one out-edge: no path
      const int filter = index.Find(pair.first), bias = index.Find(pair.second);
      const int gradient = index.Find(ParseTensor(index.node(bias).input(0)).first);
      for (const auto& [from, to] : {std::make_pair(bias, filter), std::make_pair(filter, bias)}) {
        const std::unordered_set<int> after = index.Descendants({from});
        if (!after.count(to)) continue;
        const std::unordered_set<int> before = index.Ancestors(to);
        // Nodes on a path, in GraphDef order (the edits do not depend on hashing).
        for (int n = 0; n < rewritten->node_size(); ++n) {
          if (n == from || !after.count(n) || !before.count(n)) continue;
          NodeDef* node = rewritten->mutable_node(n);
          const std::vector<std::string> control = ControlInputs(*node);
          std::vector<std::string> kept;
          for (const std::string& name : control) {
            const int source = index.Find(name);
            if (source < 0 || !after.count(source) ||
                original_edges.count({name, node->name()})) {
              kept.push_back(name);
              continue;
            }
            if (source == bias && gradient >= 0) {
              const std::string& moved = index.node(gradient).name();
              if (std::find(control.begin(), control.end(), moved) == control.end() &&
                  std::find(kept.begin(), kept.end(), moved) == kept.end()) {
                kept.push_back(moved);
              }
              ++result->cycle_edges_moved;
            } else {
              ++result->cycle_edges_removed;
            }
          }
          if (kept != control) {
            SetControlInputs(node, kept);
            edited = true;
          }
        }
        if (!edited && gradient >= 0) {
          // No edge of the pass's on the path: the pair runs as two kernels (the
          // merge condition is equal control inputs; the gradient is read anyway).
          std::vector<std::string> control = ControlInputs(index.node(bias));
          control.push_back(index.node(gradient).name());
          SetControlInputs(rewritten->mutable_node(bias), control);
          result->unmerged.push_back(
              absl::StrCat(pair.first, " + ", pair.second, " (a path between them)"));
          edited = true;
        }
        if (edited) break;
      }
      if (edited) break;  // the index is stale
    }
    if (!edited) break;
  }
  std::sort(result->unmerged.begin(), result->unmerged.end());
  return absl::OkStatus();
}

}  // namespace tfmemopt
