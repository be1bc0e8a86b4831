#include "grappler/plan/mechanism.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/rewrite/recompute_pass.h"
#include "tensorflow/core/framework/types.h"

namespace tfmemopt {

PlanContext::PlanContext(const TensorTable& table, const std::vector<int>& order,
                         const ControlFlowInfo& flow, const MemoryPlannerOptions& options)
    : table(table), order(order), flow(flow), options(options) {
  tensors_of_buffer.resize(table.buffers.size());
  for (size_t t = 0; t < table.tensors.size(); ++t) {
    tensors_of_buffer[table.tensors[t].buffer].push_back(static_cast<int>(t));
  }
  pinned.assign(table.buffers.size(), false);
  for (const NodeInfo& node : table.nodes) {
    if (node.def->op() != "AddN" || node.inputs.size() < 3) continue;
    for (int t : node.inputs) pinned[table.tensors[t].buffer] = true;
  }
}

bool PlanContext::FeedsAddN(int node) const {
  for (int t : table.nodes[node].outputs) {
    if (pinned[table.tensors[t].buffer]) return true;
  }
  return false;
}

bool PlanContext::ReadsAddNInputEarly(int node) const {
  for (int u : table.nodes[node].inputs) {
    const int b = table.tensors[u].buffer;
    if (!pinned[b]) continue;
    bool late = false;
    for (int t : tensors_of_buffer[b]) {
      for (int c : table.tensors[t].consumers) late = late || ReadsRecomputedValues(table, flow, c);
    }
    if (!late) return true;
  }
  return false;
}

bool PlainType(tensorflow::DataType dtype) {
  return dtype != tensorflow::DT_RESOURCE && dtype != tensorflow::DT_VARIANT &&
         dtype != tensorflow::DT_STRING && dtype != tensorflow::DT_INVALID &&
         !tensorflow::IsRefType(dtype);
}

bool MatchesAnyScope(const std::string& name, const std::vector<std::string>& scopes) {
  for (const std::string& scope : scopes) {
    if (InScope(name, scope)) return true;
  }
  return false;
}

namespace {

bool MatchesAnyType(const std::string& op, const std::vector<std::string>& types) {
  return std::find(types.begin(), types.end(), op) != types.end();
}

}  // namespace

std::string FilterReason(const tensorflow::NodeDef& def, const MemoryPlannerOptions& options) {
  if (MatchesAnyScope(def.name(), options.exclude_scopes) ||
      MatchesAnyType(def.op(), options.exclude_op_types)) {
    return "excluded";
  }
  if ((!options.include_scopes.empty() && !MatchesAnyScope(def.name(), options.include_scopes)) ||
      (!options.include_op_types.empty() && !MatchesAnyType(def.op(), options.include_op_types))) {
    return "not_included";
  }
  return "";
}

bool InScope(const std::string& name, const std::string& scope) {
  if (scope.empty()) return false;
  const std::string trimmed = scope.back() == '/' ? scope.substr(0, scope.size() - 1) : scope;
  return name == trimmed || absl::StartsWith(name, absl::StrCat(trimmed, "/"));
}

}  // namespace tfmemopt
