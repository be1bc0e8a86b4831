#include "grappler/rewrite/loop_swap.h"

#include <algorithm>
#include <functional>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "grappler/ops/swap_ops.h"
#include "absl/strings/str_cat.h"
#include "grappler/ops/swap_ops.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/grappler/utils.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

// Ops that pass a list along, or read only its length or element shape.
bool KeepsElementsInPlace(const NodeDef& node) {
  static const auto* ops = new std::set<std::string>{
      "Enter", "Exit", "Merge", "Switch", "NextIteration", "Identity", "NoOp",
      "TensorListLength", "TensorListElementShape"};
  return ops->count(node.op()) > 0;
}

bool IsAddNOfThree(const NodeInfo& node) {
  return node.def->op() == "AddN" && node.inputs.size() >= 3;
}

std::vector<int> TensorsOfBuffer(const TensorTable& table, int buffer) {
  std::vector<int> tensors;
  for (size_t t = 0; t < table.tensors.size(); ++t) {
    if (table.tensors[t].buffer == buffer) tensors.push_back(static_cast<int>(t));
  }
  return tensors;
}

bool OnGpu(const std::string& device) { return absl::StartsWith(device, "GPU"); }

// The earliest value a gradient loop carries from one iteration to the next that
// its compute produces (not a counter, an invariant or a list), as the tensor its
// body reads (the Switch's port 1), or -1. `position`: the order's.
int EarliestCarriedValue(const TensorTable& table, int loop, const std::vector<int>& position) {
  int best = -1, best_position = 0;
  const int n = static_cast<int>(table.loops.loop_of_node.size());
  for (int m = 0; m < n; ++m) {
    const NodeInfo& merge = table.nodes[m];
    if (LoopOf(table, m) != loop || !tensorflow::grappler::IsMerge(*merge.def) ||
        merge.outputs.empty()) {
      continue;
    }
    int next = -1;
    for (int t : merge.inputs) {
      const NodeInfo& producer = table.nodes[table.tensors[t].node];
      if (tensorflow::grappler::IsNextIteration(*producer.def) && !producer.inputs.empty()) {
        next = producer.inputs[0];
      }
    }
    if (next < 0) continue;
    const TensorInfo& value = table.tensors[next];
    const NodeInfo& producer = table.nodes[value.node];
    const std::string& op = producer.def->op();
    if (!SwapOpsTakeType(value.dtype) || value.dtype == tensorflow::DT_INT32 ||
        value.dtype == tensorflow::DT_INT64 || tensorflow::grappler::IsSwitch(*producer.def) ||
        op == "Identity" || op == "Enter" || absl::StartsWith(op, "TensorList") ||
        LoopOf(table, value.node) != loop) {
      continue;
    }
    // The body's side of the variable: port 1 of the Switch reading the Merge.
    int body = -1;
    for (int c : table.tensors[merge.outputs[0]].consumers) {
      const NodeInfo& sw = table.nodes[c];
      if (tensorflow::grappler::IsSwitch(*sw.def) && sw.outputs.size() >= 2) body = sw.outputs[1];
    }
    if (body < 0) continue;
    bool read_by_sum = false;
    for (int c : table.tensors[body].consumers) read_by_sum |= IsAddNOfThree(table.nodes[c]);
    if (read_by_sum) continue;  // another reader could change which buffer it sums into
    if (best < 0 || position[value.node] < best_position) {
      best = body;
      best_position = position[value.node];
    }
  }
  return best;
}

NodeDef SwapNode(const std::string& name, const std::string& input, bool swap_out,
                 tensorflow::DataType dtype, const std::string& device) {
  NodeDef node;
  node.set_name(name);
  node.set_op(swap_out ? kSwapOutOpName : kSwapInOpName);
  node.set_device(device);
  node.add_input(input);
  (*node.mutable_attr())["T"].set_type(dtype);
  return node;
}

}  // namespace

int64_t LoopListBytes(const TensorTable& table, int index) {
  const ListInstance& list = table.loops.lists[index];
  if (list.item < 0 || list.capacity < 0) return 0;
  const TensorInfo& item = table.tensors[list.item];
  if (!item.size_known || (list.referenced && table.buffers[item.buffer].persistent)) return 0;
  return list.capacity * item.bytes;
}

std::string LoopSwapBlocker(const TensorTable& table, int index) {
  const ListInstance& list = table.loops.lists[index];
  const LoopFrame& loop = table.loops.loops[list.loop];
  if (list.item < 0 || list.pushes.empty()) return "not_filled_by_the_loop";
  const TensorInfo& item = table.tensors[list.item];
  if (list.referenced && table.buffers[item.buffer].persistent) return "references_a_variable";
  if (list.pops.empty()) return "not_an_accumulator";  // e.g. a TensorArray of outputs
  if (LoopOf(table, list.creator) >= 0) return "nested_loop";
  if (!SwapOpsTakeType(item.dtype)) return "non_plain_dtype";
  if (list.capacity < 0) return loop.trip_count < 0 ? "dynamic_trip_count" : "unknown_size";
  if (!item.size_known) return "unknown_size";
  if (table.buffers[list.buffer].host_bytes > 0) return "swapped";
  if (OnGpu(table.nodes[list.pushes[0]].device)) return "gpu_not_supported";
  // Every reader of the list (through its plumbing) keeps its elements in place,
  // except the pushes and pops themselves.
  std::set<int> pushes(list.pushes.begin(), list.pushes.end());
  std::set<int> pops(list.pops.begin(), list.pops.end());
  for (int t : TensorsOfBuffer(table, list.buffer)) {
    for (int c : table.tensors[t].consumers) {
      const NodeInfo& reader = table.nodes[c];
      if (IsAddNOfThree(reader)) return "feeds_addn";
      if (pushes.count(c) || pops.count(c) || KeepsElementsInPlace(*reader.def)) continue;
      // A popped element (port 1 shares the list's buffer) read by compute is fine.
      bool element_reader = false;
      for (int pop : list.pops) {
        const NodeInfo& p = table.nodes[pop];
        element_reader |= p.outputs.size() >= 2 && t == p.outputs[1];
      }
      if (!element_reader) return "read_as_a_whole";
    }
  }
  for (int t : TensorsOfBuffer(table, item.buffer)) {
    for (int c : table.tensors[t].consumers) {
      if (IsAddNOfThree(table.nodes[c])) return "feeds_addn";
    }
  }
  for (int pop : list.pops) {
    if (LoopOf(table, pop) < 0 || table.nodes[pop].outputs.size() < 2) return "popped_outside_a_loop";
  }
  return "";
}

absl::Status BuildLoopSwapRewrite(TensorTable&& table, const std::vector<int>& order,
                                  const std::vector<int>& lists,
                                  double bandwidth_bytes_per_sec, LoopSwapRewrite* rewrite) {
  rewrite->table = std::move(table);
  return LoopSwapInPlace(&rewrite->table, order, lists, bandwidth_bytes_per_sec, rewrite,
                         nullptr);
}

absl::Status LoopSwapInPlace(TensorTable* table_ptr, const std::vector<int>& order,
                             const std::vector<int>& lists, double bandwidth_bytes_per_sec,
                             LoopSwapRewrite* rewrite, TableEdit* edit) {
  TensorTable& table = *table_ptr;
  const int n = static_cast<int>(table.nodes.size());
  if (static_cast<int>(order.size()) != n) {
    return absl::InvalidArgumentError("loop swap: the order does not cover the graph");
  }
  if (bandwidth_bytes_per_sec <= 0) {
    return absl::InvalidArgumentError("loop swap: the copy bandwidth must be positive");
  }
  if (edit != nullptr) edit->Begin(table);
  rewrite->new_defs.clear();
  rewrite->rewires.clear();
  rewrite->swapped.clear();
  rewrite->num_swap_out = rewrite->num_swap_in = 0;
  rewrite->bytes_to_host = 0;
  rewrite->copy_seconds = 0;
  std::vector<int> position(n, -1);
  for (int s = 0; s < n; ++s) position[order[s]] = s;
  std::vector<std::vector<int>> after(n);  // new nodes to run right after each node

  std::vector<int> sorted = lists;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  absl::flat_hash_map<int, int> trigger_of_loop;  // gradient loop -> trigger node

  // Appends a node reading `inputs` with one output on a buffer of its own (or on
  // `alias`'s buffer); returns its index.
  auto add_node = [&](NodeDef def, const std::vector<int>& inputs, const TensorInfo& like,
                      int64_t device_bytes, int64_t host_bytes, int alias, bool backward,
                      double seconds) {
    rewrite->new_defs.push_back(std::move(def));
    const int node = static_cast<int>(table.nodes.size());
    const int tensor = static_cast<int>(table.tensors.size());
    NodeInfo info;
    info.def = &rewrite->new_defs.back();
    info.device = ShortDeviceName(info.def->device());
    info.stateful = info.def->op() != "Identity";
    info.backward = backward;
    info.compute_seconds = seconds;
    info.inputs = inputs;
    info.outputs = {tensor};
    TensorInfo out = like;
    out.node = node;
    out.port = 0;
    out.consumers.clear();
    if (alias >= 0) {
      out.buffer = table.tensors[alias].buffer;
    } else {
      BufferInfo buffer;
      buffer.owner = tensor;
      buffer.bytes = device_bytes;
      buffer.host_bytes = host_bytes;
      buffer.device = info.device;
      out.buffer = static_cast<int>(table.buffers.size());
      table.buffers.push_back(buffer);
    }
    table.tensors.push_back(std::move(out));
    for (int t : inputs) {
      if (edit != nullptr) edit->SaveConsumers(table, t);
      table.tensors[t].consumers.push_back(node);
    }
    table.nodes.push_back(std::move(info));
    after.emplace_back();
    return node;
  };
  // Points input `slot` of `reader` at `tensor` instead.
  auto rewire = [&](int reader, int slot, int tensor, const std::string& name) {
    const int old = table.nodes[reader].inputs[slot];
    if (edit != nullptr) {
      edit->SaveInput(table, reader, slot);
      edit->SaveConsumers(table, old);
      edit->SaveConsumers(table, tensor);
    }
    table.nodes[reader].inputs[slot] = tensor;
    std::vector<int>& consumers = table.tensors[old].consumers;
    consumers.erase(std::find(consumers.begin(), consumers.end(), reader));
    table.tensors[tensor].consumers.push_back(reader);
    // The graph's input index of data input `slot` (control inputs come last).
    rewrite->rewires.push_back({reader, slot, name, table.nodes[reader].def->name()});
  };

  for (int index : sorted) {
    if (index < 0 || index >= static_cast<int>(table.loops.lists.size())) {
      return absl::InvalidArgumentError("loop swap: bad list index");
    }
    if (!LoopSwapBlocker(table, index).empty()) continue;
    const ListInstance list = table.loops.lists[index];  // a copy: tables grow below
    const TensorInfo item = table.tensors[list.item];
    const double copy = static_cast<double>(item.bytes) / bandwidth_bytes_per_sec;
    const int64_t list_bytes = list.capacity * item.bytes;

    // Forward: each push stores a host copy of its item.
    for (int push : list.pushes) {
      int item_port = 0;
      IsListWrite(*table.nodes[push].def, &item_port);
      const int pushed = table.nodes[push].inputs[item_port];
      const NodeDef& push_def = *table.nodes[push].def;
      const int out = add_node(
          SwapNode(absl::StrCat(kLoopSwapOutScope, push_def.name()), table.TensorName(pushed),
                   /*swap_out=*/true, item.dtype, push_def.device()),
          {pushed}, table.tensors[pushed], 0, table.tensors[pushed].bytes, -1,
          table.nodes[push].backward, copy);
      rewire(push, item_port, table.nodes[out].outputs[0], table.nodes[out].def->name());
      after[table.tensors[pushed].node].push_back(out);
      ++rewrite->num_swap_out;
    }
    // The list now holds host tensors (and no longer references another list's).
    if (edit != nullptr) edit->SaveBuffer(table, list.buffer);
    BufferInfo& buffer = table.buffers[list.buffer];
    buffer.host_bytes = list.capacity * item.bytes;
    buffer.bytes = 0;
    if (list.referenced && item.buffer != list.buffer) {
      if (edit != nullptr) edit->SaveBuffer(table, item.buffer);
      std::vector<int>& held_by = table.buffers[item.buffer].held_by;
      held_by.erase(std::remove(held_by.begin(), held_by.end(), list.buffer), held_by.end());
    }

    // Gradient loop: each popped element's readers read a device copy.
    for (int pop : list.pops) {
      const int element = table.nodes[pop].outputs[1];
      const int loop = LoopOf(table, pop);
      auto trigger = trigger_of_loop.find(loop);
      if (trigger == trigger_of_loop.end()) {
        int node = -1;
        const int carried = EarliestCarriedValue(table, loop, position);
        if (carried >= 0) {
          NodeDef identity;
          identity.set_name(absl::StrCat(kLoopSwapInScope,
                                         table.nodes[table.tensors[carried].node].def->name(),
                                         "/iteration"));
          identity.set_op("Identity");
          identity.set_device(table.nodes[table.tensors[carried].node].def->device());
          identity.add_input(table.TensorName(carried));
          (*identity.mutable_attr())["T"].set_type(table.tensors[carried].dtype);
          node = add_node(std::move(identity), {carried}, table.tensors[carried], 0, 0, carried,
                          true, 0);
          after[table.tensors[carried].node].push_back(node);
        }
        trigger = trigger_of_loop.emplace(loop, node).first;
      }
      std::vector<int> readers = table.tensors[element].consumers;
      std::sort(readers.begin(), readers.end());
      readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
      const NodeDef& pop_def = *table.nodes[pop].def;
      NodeDef in = SwapNode(absl::StrCat(kLoopSwapInScope, pop_def.name()),
                            table.TensorName(element), /*swap_out=*/false, item.dtype,
                            pop_def.device());
      if (trigger->second >= 0) {
        in.add_input(absl::StrCat("^", table.nodes[trigger->second].def->name()));
      }
      TensorInfo like = item;
      like.role = TensorRole::kGradient;
      const int in_node = add_node(std::move(in), {element}, like, item.bytes, 0, -1, true, copy);
      if (trigger->second >= 0) table.nodes[in_node].control_inputs.push_back(trigger->second);
      after[trigger->second >= 0 ? trigger->second : pop].push_back(in_node);
      const int copied = table.nodes[in_node].outputs[0];
      for (int reader : readers) {
        for (size_t slot = 0; slot < table.nodes[reader].inputs.size(); ++slot) {
          if (table.nodes[reader].inputs[slot] == element) {
            rewire(reader, static_cast<int>(slot), copied, table.nodes[in_node].def->name());
          }
        }
      }
      ++rewrite->num_swap_in;
    }
    rewrite->swapped.push_back(index);
    rewrite->bytes_to_host += list_bytes;
    rewrite->copy_seconds += 2.0 * static_cast<double>(list_bytes) / bandwidth_bytes_per_sec;
  }

  rewrite->order.clear();
  rewrite->order.reserve(table.nodes.size());
  std::function<void(int)> emit = [&](int node) {
    rewrite->order.push_back(node);
    for (int added : after[node]) emit(added);
  };
  for (int node : order) emit(node);
  if (rewrite->order.size() != table.nodes.size()) {
    return absl::InternalError("loop swap: the order misses added nodes");
  }
  return absl::OkStatus();
}

absl::Status ApplyLoopSwapRewrite(const LoopSwapRewrite& rewrite, tensorflow::GraphDef* graph) {
  for (const LoopSwapRewrite::Rewire& rewire : rewrite.rewires) {
    if (rewire.node < 0 || rewire.node >= graph->node_size()) {
      return absl::InternalError("loop swap: rewired node out of range");
    }
    NodeDef* node = graph->mutable_node(rewire.node);
    if (node->name() != rewire.node_name || rewire.slot >= node->input_size() ||
        tensorflow::grappler::IsControlInput(node->input(rewire.slot))) {
      return absl::InternalError(
          absl::StrCat("loop swap: graph and table disagree at ", node->name()));
    }
    node->set_input(rewire.slot, rewire.input);
  }
  for (const NodeDef& added : rewrite.new_defs) *graph->add_node() = added;
  return absl::OkStatus();
}

}  // namespace tfmemopt
