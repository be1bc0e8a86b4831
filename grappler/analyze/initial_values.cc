#include "grappler/analyze/initial_values.h"

#include <string>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/utils.h"

namespace tfmemopt {
namespace {

using Key = std::tuple<std::string, std::string, std::string>;  // device, container, name

// Grappler may optimize several graphs at once (one per thread), hence the lock.
absl::Mutex registry_mutex;
absl::flat_hash_map<Key, HeldInitialValue>& Registry() {
  static auto* registry = new absl::flat_hash_map<Key, HeldInitialValue>();
  return *registry;
}
// Every variable an AssignVariableOp of a recorded graph assigned, from a Const or not.
absl::flat_hash_set<Key>& Initialized() {
  static auto* initialized = new absl::flat_hash_set<Key>();
  return *initialized;
}
// Tells apart Consts of one name in different graphs.
int64_t recorded_graphs = 0;

// A VarHandleOp names its variable by shared_name, or by its own name without one.
Key KeyOf(const tensorflow::NodeDef& handle) {
  std::string name = tensorflow::GetNodeAttrString(handle, "shared_name");
  if (name.empty()) name = handle.name();
  return {handle.device(), tensorflow::GetNodeAttrString(handle, "container"), name};
}

int64_t ConstBytes(const tensorflow::NodeDef& node) {
  auto it = node.attr().find("value");
  if (it == node.attr().end() || !it->second.has_tensor()) return 0;
  const tensorflow::TensorProto& value = it->second.tensor();
  if (!tensorflow::TensorShape::IsValid(value.tensor_shape())) return 0;
  const tensorflow::TensorShape shape(value.tensor_shape());
  return shape.num_elements() * tensorflow::DataTypeSize(value.dtype());
}

}  // namespace

void RecordInitializedVariables(const tensorflow::GraphDef& graph) {
  absl::flat_hash_map<std::string, const tensorflow::NodeDef*> by_name;
  for (const tensorflow::NodeDef& node : graph.node()) by_name[node.name()] = &node;
  // The node an input comes from, through Identities.
  auto source = [&](const std::string& input) -> const tensorflow::NodeDef* {
    const tensorflow::NodeDef* node = nullptr;
    std::string name = tensorflow::grappler::NodeName(input);
    for (int hops = 0; hops < 8; ++hops) {
      auto it = by_name.find(name);
      if (it == by_name.end()) return nullptr;
      node = it->second;
      if (node->op() != "Identity" || node->input_size() == 0) return node;
      name = tensorflow::grappler::NodeName(node->input(0));
    }
    return node;
  };
  absl::MutexLock lock(&registry_mutex);
  const int64_t graph_serial = recorded_graphs++;
  for (const tensorflow::NodeDef& node : graph.node()) {
    if (node.op() != "AssignVariableOp" || node.input_size() < 2) continue;
    const tensorflow::NodeDef* handle = source(node.input(0));
    const tensorflow::NodeDef* value = source(node.input(1));
    if (handle == nullptr || handle->op() != "VarHandleOp") continue;
    Initialized().insert(KeyOf(*handle));
    if (value == nullptr || value->op() != "Const") continue;
    const int64_t bytes = ConstBytes(*value);
    if (bytes <= 0) continue;
    Registry()[KeyOf(*handle)] = {absl::StrCat(graph_serial, "/", value->name()), bytes};
  }
}

HeldInitialValue HeldInitialValueOf(const tensorflow::NodeDef& var_handle) {
  if (var_handle.op() != "VarHandleOp") return {};
  absl::MutexLock lock(&registry_mutex);
  auto it = Registry().find(KeyOf(var_handle));
  return it == Registry().end() ? HeldInitialValue{} : it->second;
}

bool InitializedByRecordedGraph(const tensorflow::NodeDef& var_handle) {
  if (var_handle.op() != "VarHandleOp") return false;
  absl::MutexLock lock(&registry_mutex);
  return Initialized().contains(KeyOf(var_handle));
}

}  // namespace tfmemopt
