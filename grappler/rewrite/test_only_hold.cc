#include "grappler/rewrite/test_only_hold.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/tensor.pb.h"
#include "tensorflow/core/framework/tensor_shape.pb.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tfmemopt {
namespace {

using tensorflow::DataType;
using tensorflow::NodeDef;

std::string Name(const char* part) { return absl::StrCat(kTestOnlyHoldScope, part); }

NodeDef* AddNode(tensorflow::GraphDef* graph, const char* part, const char* op,
                 const std::string& device) {
  NodeDef* node = graph->add_node();
  node->set_name(Name(part));
  node->set_op(op);
  node->set_device(device);
  return node;
}

// A Const of `dtype` holding `value` in a tensor of shape `dims`.
NodeDef* AddConst(tensorflow::GraphDef* graph, const char* part, const std::string& device,
                  DataType dtype, const std::vector<int64_t>& dims) {
  NodeDef* node = AddNode(graph, part, "Const", device);
  (*node->mutable_attr())["dtype"].set_type(dtype);
  tensorflow::TensorProto* tensor = (*node->mutable_attr())["value"].mutable_tensor();
  tensor->set_dtype(dtype);
  for (int64_t d : dims) tensor->mutable_tensor_shape()->add_dim()->set_size(d);
  return node;
}

// The name of the node an input string names ("^a", "a:1" -> "a").
std::string InputNode(const std::string& input) {
  std::string name = input[0] == '^' ? input.substr(1) : input;
  const size_t colon = name.rfind(':');
  return colon == std::string::npos ? name : name.substr(0, colon);
}

}  // namespace

absl::Status AddTestOnlyHold(int64_t bytes, const std::vector<std::string>& wait_for,
                             tensorflow::GraphDef* graph) {
  if (bytes <= 0) return absl::OkStatus();
  std::string device;
  absl::flat_hash_map<std::string, const NodeDef*> nodes;
  for (const NodeDef& node : graph->node()) {
    if (absl::StartsWith(node.name(), kTestOnlyHoldScope)) return absl::OkStatus();
    if (device.empty()) device = node.device();
    nodes[node.name()] = &node;
  }
  std::vector<std::string> sinks;
  absl::flat_hash_set<std::string> seen;
  auto add = [&](const std::string& name) {
    if (nodes.contains(name) && seen.insert(name).second) sinks.push_back(name);
  };
  for (const std::string& fetch : wait_for) {
    auto it = nodes.find(InputNode(fetch));
    if (it == nodes.end()) continue;
    // A function's fetch becomes its _Retval, which no edge may leave: wait for what
    // it returns instead.
    for (const std::string& input : it->second->input()) {
      if (input[0] != '^') add(InputNode(input));
    }
  }
  if (sinks.empty()) {
    return absl::InternalError("test_only_hold_bytes: the graph has no fetch to hold until");
  }

  NodeDef* shape = AddConst(graph, "shape", device, tensorflow::DT_INT64, {1});
  (*shape->mutable_attr())["value"].mutable_tensor()->add_int64_val((bytes + 7) / 8);
  NodeDef* condition = AddConst(graph, "condition", device, tensorflow::DT_BOOL, {});
  (*condition->mutable_attr())["value"].mutable_tensor()->add_bool_val(true);
  // The fill value comes from a stateful op: a Fill of constants would be folded into
  // a Const when TF instantiates the function, allocated then, outside the step.
  AddNode(graph, "stamp", "Timestamp", device);
  NodeDef* value = AddNode(graph, "value", "ZerosLike", device);
  value->add_input(Name("stamp"));
  (*value->mutable_attr())["T"].set_type(tensorflow::DT_DOUBLE);

  NodeDef* buffer = AddNode(graph, "buffer", "Fill", device);
  buffer->add_input(Name("shape"));
  buffer->add_input(Name("value"));
  (*buffer->mutable_attr())["T"].set_type(tensorflow::DT_DOUBLE);
  (*buffer->mutable_attr())["index_type"].set_type(tensorflow::DT_INT64);

  // Assert reads the buffer itself: an op that only reads its shape (Size) would be
  // folded into a constant, and the buffer, unread, pruned.
  NodeDef* keep = AddNode(graph, "keep", "Assert", device);
  keep->add_input(Name("condition"));
  keep->add_input(Name("buffer"));
  for (const std::string& sink : sinks) keep->add_input(absl::StrCat("^", sink));
  (*keep->mutable_attr())["T"].mutable_list()->add_type(tensorflow::DT_DOUBLE);
  (*keep->mutable_attr())["summarize"].set_i(1);
  return absl::OkStatus();
}

}  // namespace tfmemopt
