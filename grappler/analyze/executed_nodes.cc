#include "grappler/analyze/executed_nodes.h"

#include <deque>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/grappler/utils.h"

namespace tfmemopt {

using tensorflow::GraphDef;
using tensorflow::NodeDef;
using tensorflow::grappler::GrapplerItem;
using tensorflow::grappler::NodeName;

namespace {

bool IsStatefulOp(const NodeDef& node) {
  const tensorflow::OpDef* op_def = nullptr;
  // An op the registry does not know is a function call: it may have side effects.
  if (!tensorflow::OpRegistry::Global()->LookUpOpDef(node.op(), &op_def).ok()) return true;
  return op_def->is_stateful();
}

}  // namespace

bool SplitNeverRunNodes(const GrapplerItem& item, GrapplerItem* executed,
                        std::vector<NodeDef>* never_run) {
  never_run->clear();
  if (item.fetch.empty()) return false;
  const GraphDef& graph = item.graph;
  absl::flat_hash_map<std::string, int> index;
  for (int i = 0; i < graph.node_size(); ++i) index[graph.node(i).name()] = i;

  std::deque<int> frontier;
  std::vector<bool> runs(graph.node_size(), false);
  auto reach = [&](const std::string& input) {
    auto it = index.find(NodeName(input));
    if (it != index.end() && !runs[it->second]) {
      runs[it->second] = true;
      frontier.push_back(it->second);
    }
  };
  for (const std::string& fetch : item.fetch) reach(fetch);
  for (const std::string& keep : item.keep_ops) reach(keep);
  // A fed node is one Grappler must keep (GrapplerItem::NodesToPreserve), even
  // when nothing reads it: a function's argument the body ignores (an unused loop
  // bound) is still an argument. Its value is given, so its inputs are not reached.
  for (const auto& feed : item.feed) reach(feed.first);
  // A function's body keeps its side effects unless Grappler may prune them.
  if (!item.optimization_options().allow_pruning_stateful_and_dataset_ops) {
    for (const NodeDef& node : graph.node()) {
      if (IsStatefulOp(node)) reach(node.name());
    }
  }
  // What is fed is not computed: its producer's inputs are not needed for it.
  absl::flat_hash_set<std::string> fed;
  for (const auto& feed : item.feed) fed.insert(NodeName(feed.first));
  while (!frontier.empty()) {
    const NodeDef& node = graph.node(frontier.front());
    frontier.pop_front();
    if (fed.count(node.name())) continue;
    for (const std::string& input : node.input()) reach(input);
  }
  int executed_count = 0;
  for (bool r : runs) executed_count += r ? 1 : 0;
  if (executed_count == graph.node_size()) return false;

  GraphDef kept;
  *kept.mutable_versions() = graph.versions();
  *kept.mutable_library() = graph.library();
  for (int i = 0; i < graph.node_size(); ++i) {
    if (runs[i]) {
      *kept.add_node() = graph.node(i);
    } else {
      never_run->push_back(graph.node(i));
    }
  }
  *executed = item.WithGraph(std::move(kept));
  // What other Session.run calls execute (initializers, save and restore) is not
  // part of this step; those nodes go back unchanged with the rest.
  executed->init_ops.clear();
  executed->save_op.clear();
  executed->restore_op.clear();
  executed->save_restore_loc_tensor.clear();
  executed->queue_runners.clear();
  return true;
}

int AppendNeverRunNodes(std::vector<tensorflow::NodeDef> never_run,
                        tensorflow::GraphDef* graph) {
  absl::flat_hash_set<std::string> present;
  for (const tensorflow::NodeDef& node : graph->node()) present.insert(node.name());
  absl::flat_hash_set<std::string> pending;
  for (const tensorflow::NodeDef& node : never_run) pending.insert(node.name());
  // A never-run node stays when each input is in the output or a never-run node
  // that stays: drop the others until nothing changes (never-run nodes may read
  // each other in any order).
  std::vector<bool> dropped(never_run.size(), false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < never_run.size(); ++i) {
      if (dropped[i]) continue;
      for (const std::string& input : never_run[i].input()) {
        const std::string name = NodeName(input);
        if (!present.contains(name) && !pending.contains(name)) {
          dropped[i] = true;
          pending.erase(never_run[i].name());
          changed = true;
          break;
        }
      }
    }
  }
  int left_out = 0;
  for (size_t i = 0; i < never_run.size(); ++i) {
    if (dropped[i]) {
      ++left_out;
    } else {
      *graph->add_node() = std::move(never_run[i]);
    }
  }
  return left_out;
}

}  // namespace tfmemopt
