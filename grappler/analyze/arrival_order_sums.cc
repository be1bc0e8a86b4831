#include "grappler/analyze/arrival_order_sums.h"

#include <map>
#include <string>
#include <vector>

#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/grappler/utils.h"

namespace tfmemopt {
namespace {

using tensorflow::GetNodeAttrString;
using tensorflow::NodeDef;
using tensorflow::grappler::IsControlInput;
using tensorflow::grappler::NodeName;
using tensorflow::grappler::NumNonControlInputs;

// (0 + a) + b == (0 + b) + a in floats: a sum's order shows from three terms on.
constexpr int kMinOrderDependentTerms = 3;

// The name of the first data input of `node`, or "" when it has none.
std::string FirstDataInput(const NodeDef& node) {
  if (node.input_size() == 0 || IsControlInput(node.input(0))) return "";
  return NodeName(node.input(0));
}

}  // namespace

std::vector<ArrivalOrderSum> FindArrivalOrderSums(const tensorflow::GraphDef& graph) {
  // A TemporaryVariable's ref reaches the AssignAdds directly or through the Assign
  // that zeroes it (memory_optimizer.cc feeds them the Assign's output).
  std::map<std::string, std::string> variable_of;  // node name -> TemporaryVariable
  std::map<std::string, std::string> var_name_of;  // TemporaryVariable -> its var_name
  for (const NodeDef& node : graph.node()) {
    if (node.op() == "TemporaryVariable") {
      variable_of[node.name()] = node.name();
      var_name_of[node.name()] = GetNodeAttrString(node, "var_name");
    }
  }
  for (const NodeDef& node : graph.node()) {
    if (node.op() != "Assign") continue;
    const auto it = variable_of.find(FirstDataInput(node));
    if (it != variable_of.end()) variable_of[node.name()] = it->second;
  }
  std::map<std::string, int> terms;  // TemporaryVariable -> AssignAdds into it
  for (const NodeDef& node : graph.node()) {
    if (node.op() != "AssignAdd") continue;
    const auto it = variable_of.find(FirstDataInput(node));
    if (it != variable_of.end()) ++terms[it->second];
  }
  std::map<std::string, std::string> destroyed_by;  // var_name -> DestroyTemporaryVariable
  for (const NodeDef& node : graph.node()) {
    if (node.op() == "DestroyTemporaryVariable") {
      destroyed_by[GetNodeAttrString(node, "var_name")] = node.name();
    }
  }
  std::vector<ArrivalOrderSum> sums;
  for (const NodeDef& node : graph.node()) {
    if (node.op() == "AccumulateNV2") {
      const int terms_added = NumNonControlInputs(node);
      if (terms_added >= kMinOrderDependentTerms) sums.push_back({node.name(), terms_added});
      continue;
    }
    if (node.op() != "TemporaryVariable") continue;
    const auto count = terms.find(node.name());
    if (count == terms.end() || count->second < kMinOrderDependentTerms) continue;
    // TemporaryVariable's var_name defaults to the node's name when empty.
    std::string var_name = var_name_of[node.name()];
    if (var_name.empty()) var_name = node.name();
    const auto destroy = destroyed_by.find(var_name);
    sums.push_back(
        {destroy == destroyed_by.end() ? node.name() : destroy->second, count->second});
  }
  return sums;
}

}  // namespace tfmemopt
