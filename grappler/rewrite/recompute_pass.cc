#include "grappler/rewrite/recompute_pass.h"

#include <algorithm>
#include <climits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/grappler/utils.h"

namespace tfmemopt {
namespace {

std::string TensorRef(const std::string& node, int port) {
  return port == 0 ? node : absl::StrCat(node, ":", port);
}

std::string CloneName(const std::string& original) {
  return absl::StrCat(kRecomputeScope, original);
}

}  // namespace

bool ReadsClonesWhenPinned(const TensorTable& table, const ControlFlowInfo& flow,
                           int consumer) {
  return table.nodes[consumer].backward && !flow.Under(consumer);
}

bool ReadsRecomputedValues(const TensorTable& table, const ControlFlowInfo& flow,
                           int consumer) {
  const NodeInfo& node = table.nodes[consumer];
  if (!node.backward || flow.Under(consumer)) return false;
  return LatestBackwardInput(table, flow, consumer) >= 0;
}

int LatestBackwardInput(const TensorTable& table, const ControlFlowInfo& flow, int consumer,
                        const std::vector<int>* position) {
  int latest = -1;
  auto consider = [&](int producer) {
    if (!table.nodes[producer].backward || flow.Under(producer)) return;
    if (latest < 0 || (position != nullptr && (*position)[producer] > (*position)[latest])) {
      latest = producer;
    }
  };
  const NodeInfo& node = table.nodes[consumer];
  for (int t : node.inputs) {
    if (table.tensors[t].role != TensorRole::kPersistent) consider(table.tensors[t].node);
  }
  // Gradient code orders some forward-looking ops (e.g. SquaredDifference's x - y)
  // after the incoming gradient with a control edge: that makes them late too.
  for (int producer : node.control_inputs) consider(producer);
  return latest;
}

void TableEdit::Begin(const TensorTable& table) {
  nodes = table.nodes.size();
  tensors = table.tensors.size();
  buffers = table.buffers.size();
  consumers.clear();
  inputs.clear();
  control_inputs.clear();
  buffer_fields.clear();
  temp_bytes.clear();
}

void TableEdit::Undo(TensorTable* table) const {
  for (auto it = control_inputs.rbegin(); it != control_inputs.rend(); ++it) {
    table->nodes[it->first].control_inputs.resize(it->second);
  }
  for (auto it = inputs.rbegin(); it != inputs.rend(); ++it) {
    table->nodes[std::get<0>(*it)].inputs[std::get<1>(*it)] = std::get<2>(*it);
  }
  for (auto it = consumers.rbegin(); it != consumers.rend(); ++it) {
    table->tensors[it->first].consumers = it->second;
  }
  for (auto it = buffer_fields.rbegin(); it != buffer_fields.rend(); ++it) {
    table->buffers[it->first] = it->second;
  }
  for (auto it = temp_bytes.rbegin(); it != temp_bytes.rend(); ++it) {
    table->nodes[it->first].temp_bytes = it->second;
  }
  table->nodes.resize(nodes);
  table->tensors.resize(tensors);
  table->buffers.resize(buffers);
}

absl::Status BuildRecomputeRewrite(const TensorTable& base, const std::vector<int>& order,
                                   const ControlFlowInfo& flow,
                                   const std::vector<int>& nodes, RecomputeRewrite* rewrite,
                                   ClonePlacement placement, int clone_readers_from) {
  rewrite->table = base;
  return RecomputeInPlace(&rewrite->table, order, flow, nodes, rewrite, nullptr, placement,
                          clone_readers_from);
}

absl::Status RecomputeInPlace(TensorTable* table_ptr, const std::vector<int>& order,
                              const ControlFlowInfo& flow, const std::vector<int>& nodes,
                              RecomputeRewrite* rewrite, TableEdit* edit,
                              ClonePlacement placement, int clone_readers_from) {
  TensorTable& table = *table_ptr;
  const int n = static_cast<int>(table.nodes.size());
  if (static_cast<int>(order.size()) != n) {
    return absl::InvalidArgumentError("recompute: the order does not cover the graph");
  }
  if (edit != nullptr) edit->Begin(table);
  std::vector<int> position(n, -1);
  for (int s = 0; s < n; ++s) position[order[s]] = s;
  std::vector<char> chosen(n, 0);
  for (int r : nodes) {
    if (r < 0 || r >= n) return absl::InvalidArgumentError("recompute: bad node index");
    if (table.nodes[r].stateful || table.nodes[r].backward || flow.Under(r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "recompute: ", table.nodes[r].def->name(),
          " is stateful, backward or under control flow and cannot be recomputed"));
    }
    chosen[r] = 1;
  }
  std::vector<int> chosen_in_order;
  for (int node : order) {
    if (chosen[node]) chosen_in_order.push_back(node);
  }

  // Everything about the graph as it is comes first, before the edit changes it:
  // which consumers read clones, the earliest backward consumer each clone serves
  // (directly or through the clones that read it: it must exist by then), and its
  // trigger, the latest gradient-side input of that consumer.
  std::vector<signed char> late(n, -1);
  const bool pinned = placement == ClonePlacement::kBeforeReader;
  if (clone_readers_from >= n) {
    return absl::InvalidArgumentError("recompute: bad clone_readers_from node");
  }
  const int readers_from =
      pinned && clone_readers_from >= 0 ? position[clone_readers_from] : -1;
  auto reads_clones = [&](int c) {
    if (late[c] < 0) {
      late[c] = (pinned ? ReadsClonesWhenPinned(table, flow, c) && position[c] >= readers_from
                        : ReadsRecomputedValues(table, flow, c))
                    ? 1
                    : 0;
    }
    return late[c] == 1;
  };
  std::vector<int> earliest(n, INT_MAX);
  std::vector<int> earliest_node(n, -1);
  for (auto it = chosen_in_order.rbegin(); it != chosen_in_order.rend(); ++it) {
    const int r = *it;
    for (int t : table.nodes[r].outputs) {
      for (int c : table.tensors[t].consumers) {
        int at = INT_MAX, via = -1;
        if (chosen[c]) {
          at = earliest[c];
          via = earliest_node[c];
        } else if (reads_clones(c)) {
          at = position[c];
          via = c;
        }
        if (at < earliest[r] || (at == earliest[r] && via >= 0 && via < earliest_node[r])) {
          earliest[r] = at;
          earliest_node[r] = via;
        }
      }
    }
  }
  std::vector<int> trigger(n, -1);
  for (int r : chosen_in_order) {
    if (earliest_node[r] < 0) continue;
    if (pinned) {
      // The backward node nearest before the reader: the clone runs right before
      // its reader. The reader is the clone's earliest, so no node before it
      // depends on the clone, and the edge closes no cycle. Without one (the reader
      // is the first backward node), nobody reads the clone. A function's return
      // value is no trigger: TF takes it out of the body (IsReturnValue).
      for (int s = position[earliest_node[r]] - 1; s >= 0 && trigger[r] < 0; --s) {
        const int candidate = order[s];
        if (table.nodes[candidate].backward && !flow.Under(candidate) &&
            !IsReturnValue(*table.nodes[candidate].def)) {
          trigger[r] = candidate;
        }
      }
      if (trigger[r] < 0) earliest_node[r] = -1;
      continue;
    }
    trigger[r] = LatestBackwardInput(table, flow, earliest_node[r], &position);
    if (trigger[r] < 0) {
      return absl::InternalError(
          absl::StrCat("recompute: no trigger for ", table.nodes[r].def->name()));
    }
    if (placement == ClonePlacement::kEarlier) {
      const int earlier = LatestBackwardInput(table, flow, trigger[r], &position);
      if (earlier >= 0) trigger[r] = earlier;
    }
  }

  rewrite->clone_defs.clear();
  rewrite->rewires.clear();
  rewrite->cloned.clear();
  rewrite->num_triggers = 0;
  rewrite->added_seconds = 0;
  std::vector<int> clone_node(n, -1);
  std::vector<int> key(n, -1);  // the clone runs right after the node at this position

  for (int r : chosen_in_order) {
    if (earliest_node[r] < 0) continue;  // nobody would read the clone
    const NodeInfo original = table.nodes[r];  // a copy: the table grows below
    const int trigger_node = trigger[r];
    key[r] = position[trigger_node];

    tensorflow::NodeDef clone = *original.def;
    clone.set_name(CloneName(original.def->name()));
    bool triggered_by_input = false;
    for (int i = 0; i < clone.input_size(); ++i) {
      if (tensorflow::grappler::IsControlInput(clone.input(i))) continue;
      const tensorflow::TensorId id = tensorflow::ParseTensorName(clone.input(i));
      auto found = table.node_index.find(std::string(id.node()));
      if (found == table.node_index.end()) {
        return absl::InternalError(absl::StrCat("recompute: missing input ", clone.input(i)));
      }
      const int producer = found->second;
      if (producer >= n || clone_node[producer] < 0) continue;
      clone.set_input(i, TensorRef(CloneName(table.nodes[producer].def->name()), id.index()));
      key[r] = std::max(key[r], key[producer]);
      if (trigger[producer] == trigger_node) triggered_by_input = true;
    }
    if (!triggered_by_input) {
      clone.add_input(absl::StrCat("^", table.nodes[trigger_node].def->name()));
      ++rewrite->num_triggers;
    }
    rewrite->clone_defs.push_back(std::move(clone));

    const int index = static_cast<int>(table.nodes.size());
    clone_node[r] = index;
    NodeInfo info = original;
    info.def = &rewrite->clone_defs.back();
    info.backward = true;
    info.inputs.clear();
    info.outputs.clear();
    // The original keeps its kernel's extra buffers (a MaxPool workspace) until
    // their reader runs, which now reads the clone's: counting them once, on the
    // original, over-estimates the clone's shorter-lived ones, never under.
    info.extra_buffers.clear();
    info.updated_variables.clear();
    for (int t : original.inputs) {
      const int producer = table.tensors[t].node;
      const int source = clone_node[producer] >= 0
                             ? table.nodes[clone_node[producer]].outputs[table.tensors[t].port]
                             : t;
      info.inputs.push_back(source);
      if (edit != nullptr && source < static_cast<int>(edit->tensors)) {
        edit->SaveConsumers(table, source);
      }
      table.tensors[source].consumers.push_back(index);
    }
    info.control_inputs = original.control_inputs;
    if (!triggered_by_input) info.control_inputs.push_back(trigger_node);
    table.nodes.push_back(std::move(info));
    for (int t : original.outputs) {
      TensorInfo tensor = table.tensors[t];
      tensor.node = index;
      tensor.consumers.clear();
      tensor.role = TensorRole::kActivation;
      const int new_tensor = static_cast<int>(table.tensors.size());
      const int forwarded = ForwardedInput(*original.def, tensor.port);
      const std::vector<int>& clone_inputs = table.nodes[index].inputs;
      if (forwarded >= 0 && forwarded < static_cast<int>(clone_inputs.size())) {
        tensor.buffer = table.tensors[clone_inputs[forwarded]].buffer;
      } else {
        BufferInfo buffer;
        buffer.owner = new_tensor;
        buffer.bytes = tensor.bytes;
        buffer.device = original.device;
        tensor.buffer = static_cast<int>(table.buffers.size());
        table.buffers.push_back(buffer);
      }
      table.tensors.push_back(std::move(tensor));
      table.nodes[index].outputs.push_back(new_tensor);
    }
    rewrite->cloned.push_back(r);
    rewrite->added_seconds += original.compute_seconds;

    // Backward consumers read the clone from now on.
    absl::flat_hash_set<int> seen;
    for (int t : original.outputs) {
      const int port = table.tensors[t].port;
      const int new_tensor = table.nodes[index].outputs[port];
      seen.clear();
      const std::vector<int> consumers = table.tensors[t].consumers;
      for (int c : consumers) {
        if (c >= n || chosen[c] || !seen.insert(c).second || !reads_clones(c)) continue;
        for (size_t slot = 0; slot < table.nodes[c].inputs.size(); ++slot) {
          if (table.nodes[c].inputs[slot] != t) continue;
          if (edit != nullptr) {
            edit->SaveInput(table, c, static_cast<int>(slot));
            edit->SaveConsumers(table, t);
          }
          table.nodes[c].inputs[slot] = new_tensor;
          std::vector<int>& old_consumers = table.tensors[t].consumers;
          old_consumers.erase(std::find(old_consumers.begin(), old_consumers.end(), c));
          table.tensors[new_tensor].consumers.push_back(c);
          rewrite->rewires.push_back({c, static_cast<int>(slot),
                                      TensorRef(table.nodes[index].def->name(), port),
                                      table.nodes[c].def->name()});
        }
      }
    }
  }

  // The order: each clone right after its trigger (and its clone inputs), which
  // is where the executor can first run it.
  std::vector<std::vector<int>> after(n);
  for (int r : chosen_in_order) {
    if (clone_node[r] >= 0) after[order[key[r]]].push_back(clone_node[r]);
  }
  rewrite->order.clear();
  rewrite->order.reserve(table.nodes.size());
  for (int node : order) {
    rewrite->order.push_back(node);
    for (int clone : after[node]) rewrite->order.push_back(clone);
  }
  return absl::OkStatus();
}

absl::Status ApplyRecomputeRewrite(const RecomputeRewrite& rewrite,
                                   tensorflow::GraphDef* graph) {
  for (const RecomputeRewrite::Rewire& rewire : rewrite.rewires) {
    if (rewire.node < 0 || rewire.node >= graph->node_size()) {
      return absl::InternalError("recompute: rewired node out of range");
    }
    tensorflow::NodeDef* node = graph->mutable_node(rewire.node);
    if (node->name() != rewire.node_name ||
        rewire.slot >= node->input_size() ||
        tensorflow::grappler::IsControlInput(node->input(rewire.slot))) {
      return absl::InternalError(
          absl::StrCat("recompute: graph and table disagree at ", node->name()));
    }
    node->set_input(rewire.slot, rewire.input);
  }
  for (const tensorflow::NodeDef& clone : rewrite.clone_defs) *graph->add_node() = clone;
  return absl::OkStatus();
}

bool HasTfMemOptNodes(const tensorflow::GraphDef& graph) {
  for (const tensorflow::NodeDef& node : graph.node()) {
    if (absl::StartsWith(node.name(), kTfMemOptScope)) return true;
  }
  return false;
}

}  // namespace tfmemopt
