#include "grappler/rewrite/lms_swap_optimizer.h"

#include <algorithm>
#include <climits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/analyze/kernel_memory.h"
#include "grappler/ops/swap_ops.h"
#include "grappler/rewrite/recompute_pass.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/grappler/utils.h"
#include "tensorflow/core/util/device_name_utils.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

// MaxPoolGrad `grad` read oneDNN's workspace through `pooled` (its MaxPool's
// output) and now reads a swap-in of it (the planner does not swap such a tensor,
// SwapChoice::Swappable, as Eigen's kernel sums overlapping windows in another
// order; this keeps the table right should a swap reach one): TF's oneDNN layout pass rewrites a
// MaxPoolGrad only when its input 1 comes from the oneDNN MaxPool
// (MaxpoolGradRewrite in mkl_layout_pass.cc), so the gradient takes Eigen's path
// with its scratch (analyze/kernel_memory.h) and reads no workspace. The table
// follows, as a fresh analysis of the rewritten graph would: the workspace buffer
// is emptied and the gradient gets Eigen's scratch.
void DropOneDnnWorkspace(TensorTable* table, int grad, int pooled, TableEdit* edit) {
  const int pool = table->tensors[pooled].node;
  for (int b : table->nodes[pool].extra_buffers) {
    if (table->buffers[b].released_by != grad) continue;
    if (edit != nullptr) edit->SaveBuffer(*table, b);
    table->buffers[b].bytes = 0;
  }
  if (edit != nullptr) edit->SaveTempBytes(*table, grad);
  table->nodes[grad].temp_bytes = MaxPoolGradScratchBytes(*table, table->nodes[grad]);
}

std::string TensorRef(const std::string& node, int port) {
  return port == 0 ? node : absl::StrCat(node, ":", port);
}

bool OnGpu(const std::string& device) {
  tensorflow::DeviceNameUtils::ParsedName parsed;
  return tensorflow::DeviceNameUtils::ParseFullName(device, &parsed) && parsed.has_type &&
         parsed.type == "GPU";
}

// The host CPU of the machine that holds `device`.
std::string HostOf(const std::string& device) {
  tensorflow::DeviceNameUtils::ParsedName parsed;
  if (!tensorflow::DeviceNameUtils::ParseFullName(device, &parsed)) return "/device:CPU:0";
  parsed.type = "CPU";
  parsed.has_type = true;
  parsed.id = 0;
  parsed.has_id = true;
  return tensorflow::DeviceNameUtils::ParsedNameToString(parsed);
}

NodeDef SwapNode(const std::string& name, const std::string& input, bool gpu, bool swap_out,
                 tensorflow::DataType dtype, const std::string& device) {
  NodeDef node;
  node.set_name(name);
  node.add_input(input);
  (*node.mutable_attr())["T"].set_type(dtype);
  if (gpu) {
    // TFLMS: an Identity on the host, then one on the GPU; TF inserts the copies.
    node.set_op("Identity");
    node.set_device(swap_out ? HostOf(device) : device);
    (*node.mutable_attr())["_grappler_do_not_remove"].set_b(true);
  } else {
    node.set_op(swap_out ? kSwapOutOpName : kSwapInOpName);
    node.set_device(device);
  }
  return node;
}

}  // namespace

std::vector<int> LateReaders(const TensorTable& table, const ControlFlowInfo& flow, int tensor) {
  std::vector<int> readers;
  for (int c : table.tensors[tensor].consumers) {
    if (std::find(readers.begin(), readers.end(), c) != readers.end()) continue;
    if (ReadsRecomputedValues(table, flow, c)) readers.push_back(c);
  }
  return readers;
}

absl::Status BuildSwapRewrite(TensorTable&& input, const std::vector<int>& order,
                              const ControlFlowInfo& flow, const std::vector<int>& tensors,
                              const SwapOptions& options, SwapRewrite* rewrite) {
  rewrite->table = std::move(input);
  return SwapInPlace(&rewrite->table, order, flow, tensors, options, rewrite, nullptr);
}

absl::Status SwapInPlace(TensorTable* table_ptr, const std::vector<int>& order,
                         const ControlFlowInfo& flow, const std::vector<int>& tensors,
                         const SwapOptions& options, SwapRewrite* rewrite, TableEdit* edit) {
  TensorTable& table = *table_ptr;
  const int n = static_cast<int>(table.nodes.size());
  if (static_cast<int>(order.size()) != n) {
    return absl::InvalidArgumentError("swap: the order does not cover the graph");
  }
  if (options.bandwidth_bytes_per_sec <= 0) {
    return absl::InvalidArgumentError("swap: the copy bandwidth must be positive");
  }
  if (edit != nullptr) edit->Begin(table);
  std::vector<int> position(n, -1);
  for (int s = 0; s < n; ++s) position[order[s]] = s;

  rewrite->new_defs.clear();
  rewrite->rewires.clear();
  rewrite->waits.clear();
  rewrite->swapped.clear();
  rewrite->num_swap_out = rewrite->num_swap_in = 0;
  rewrite->bytes_to_host = 0;
  rewrite->copy_seconds = 0;

  std::vector<int> sorted = tensors;
  for (int t : sorted) {
    if (t < 0 || t >= static_cast<int>(table.tensors.size())) {
      return absl::InvalidArgumentError("swap: bad tensor index");
    }
  }
  std::sort(sorted.begin(), sorted.end(), [&](int a, int b) {
    const int pa = position[table.tensors[a].node], pb = position[table.tensors[b].node];
    return pa != pb ? pa < pb : a < b;
  });
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());

  // First, on the graph as it is: each swap's readers, grouped per swap-in, and
  // when each swap-in starts (walking back from its first reader along the latest
  // backward inputs until the ops passed cover the copy).
  struct Planned {
    int tensor;
    std::vector<std::vector<int>> groups;
    std::vector<int> triggers;
  };
  std::vector<Planned> planned;
  for (int t : sorted) {
    const TensorInfo& tensor = table.tensors[t];
    if (table.nodes[tensor.node].backward || flow.Under(tensor.node)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "swap: ", table.TensorName(t), " is not a forward tensor outside control flow"));
    }
    std::vector<int> readers = LateReaders(table, flow, t);
    if (readers.empty()) continue;
    std::sort(readers.begin(), readers.end(),
              [&](int a, int b) { return position[a] < position[b]; });
    const double copy = static_cast<double>(tensor.bytes) / options.bandwidth_bytes_per_sec;
    Planned swap{t, {}, {}};
    if (options.fuse_swapins) {
      swap.groups.push_back(readers);
    } else {
      for (int r : readers) swap.groups.push_back({r});
    }
    for (const std::vector<int>& group : swap.groups) {
      int x = group.front(), ops = 0;
      double seconds = 0;
      while (true) {
        if (options.lag_ops > 0 && ops >= options.lag_ops) break;
        if (seconds >= copy && ops >= std::max(1, options.lead_ops)) break;
        const int previous = LatestBackwardInput(table, flow, x, &position);
        if (previous < 0) break;
        x = previous;
        ++ops;
        seconds += table.nodes[x].compute_seconds;
      }
      swap.triggers.push_back(ops > 0 ? x : -1);
    }
    if (std::find(swap.triggers.begin(), swap.triggers.end(), -1) != swap.triggers.end()) continue;
    planned.push_back(std::move(swap));
  }

  // Then the edit.
  std::vector<std::vector<int>> after(n);  // new nodes to run right after each node
  absl::flat_hash_set<std::string> used_names;
  for (const Planned& swap : planned) {
    const int t = swap.tensor;
    const TensorInfo tensor = table.tensors[t];  // a copy: the tables grow below
    const int producer_node = tensor.node;
    const std::string producer_name = table.nodes[producer_node].def->name();
    const std::string device = table.nodes[producer_node].def->device();
    const std::string short_device = table.nodes[producer_node].device;
    const bool gpu = OnGpu(device);
    const double copy = static_cast<double>(tensor.bytes) / options.bandwidth_bytes_per_sec;
    // Named after the producer (and its output port, when not 0); "X:1" spelled "X_1"
    // could meet a node named X_1, so a name already taken gets a counter.
    const std::string stem = tensor.port == 0
                                 ? producer_name
                                 : absl::StrCat(producer_name, "/output_", tensor.port);
    std::string base = stem;
    for (int k = 1; !used_names.insert(base).second; ++k) base = absl::StrCat(stem, "_", k);

    rewrite->new_defs.push_back(SwapNode(absl::StrCat(kSwapOutScope, base),
                                         TensorRef(producer_name, tensor.port), gpu,
                                         /*swap_out=*/true, tensor.dtype, device));
    const int out_node = static_cast<int>(table.nodes.size());
    const int stash_tensor = static_cast<int>(table.tensors.size());
    {
      NodeInfo info;
      info.def = &rewrite->new_defs.back();
      info.device = ShortDeviceName(info.def->device());
      info.stateful = !gpu;
      info.compute_seconds = copy;
      info.inputs = {t};
      info.outputs = {stash_tensor};
      TensorInfo stash = tensor;
      stash.node = out_node;
      stash.port = 0;
      stash.consumers.clear();
      stash.role = TensorRole::kActivation;
      BufferInfo buffer;
      buffer.owner = stash_tensor;
      buffer.device = info.device;
      if (gpu && std::binary_search(table.devices.begin(), table.devices.end(), info.device)) {
        buffer.bytes = tensor.bytes;  // on the host CPU device
      } else {
        buffer.host_bytes = tensor.bytes;  // in the host pool, off the allocator
      }
      stash.buffer = static_cast<int>(table.buffers.size());
      table.buffers.push_back(buffer);
      table.tensors.push_back(std::move(stash));
      if (edit != nullptr) edit->SaveConsumers(table, t);
      table.tensors[t].consumers.push_back(out_node);
      table.nodes.push_back(std::move(info));
      after[producer_node].push_back(out_node);
    }
    ++rewrite->num_swap_out;

    for (size_t g = 0; g < swap.groups.size(); ++g) {
      const std::vector<int>& group = swap.groups[g];
      const std::string name =
          swap.groups.size() == 1
              ? absl::StrCat(kSwapInScope, base)
              : absl::StrCat(kSwapInScope, base, "/", table.nodes[group.front()].def->name());
      NodeDef in = SwapNode(name, table.nodes[out_node].def->name(), gpu, /*swap_out=*/false,
                            tensor.dtype, device);
      in.add_input(absl::StrCat("^", table.nodes[swap.triggers[g]].def->name()));
      rewrite->new_defs.push_back(std::move(in));
      const int in_node = static_cast<int>(table.nodes.size());
      const int in_tensor = static_cast<int>(table.tensors.size());
      NodeInfo info;
      info.def = &rewrite->new_defs.back();
      info.device = short_device;
      info.stateful = !gpu;
      info.backward = true;
      info.compute_seconds = copy;
      info.inputs = {stash_tensor};
      info.outputs = {in_tensor};
      TensorInfo copy_back = tensor;
      copy_back.node = in_node;
      copy_back.port = 0;
      copy_back.consumers.clear();
      copy_back.role = TensorRole::kActivation;
      BufferInfo buffer;
      buffer.owner = in_tensor;
      buffer.bytes = tensor.bytes;
      buffer.device = short_device;
      copy_back.buffer = static_cast<int>(table.buffers.size());
      table.buffers.push_back(buffer);
      table.tensors.push_back(std::move(copy_back));
      table.tensors[stash_tensor].consumers.push_back(in_node);
      info.control_inputs = {swap.triggers[g]};
      table.nodes.push_back(std::move(info));
      after[swap.triggers[g]].push_back(in_node);
      ++rewrite->num_swap_in;
      rewrite->copy_seconds += copy;

      for (int reader : group) {
        const bool read_workspace = UsesOneDnnWorkspace(table, table.nodes[reader]);
        std::vector<int>& inputs = table.nodes[reader].inputs;
        for (size_t slot = 0; slot < inputs.size(); ++slot) {
          if (inputs[slot] != t) continue;
          if (edit != nullptr) {
            edit->SaveInput(table, reader, static_cast<int>(slot));
            edit->SaveConsumers(table, t);
          }
          inputs[slot] = in_tensor;
          std::vector<int>& consumers = table.tensors[t].consumers;
          consumers.erase(std::find(consumers.begin(), consumers.end(), reader));
          table.tensors[in_tensor].consumers.push_back(reader);
          rewrite->rewires.push_back({reader, static_cast<int>(slot), name,
                                      table.nodes[reader].def->name()});
        }
        if (read_workspace && !UsesOneDnnWorkspace(table, table.nodes[reader])) {
          DropOneDnnWorkspace(&table, reader, t, edit);
        }
      }
    }
    if (!gpu) {
      // The producer's readers that stay in the forward pass wait for the
      // swap-out. Otherwise the executor may run one of them inline and queue the
      // swap-out behind the rest of the forward pass (with one inter-op thread it
      // runs just before its swap-in), and the tensor stays on the device all
      // along. On a GPU the swap-out runs in the host's own executor, so nothing
      // queues it behind the device's ops.
      std::vector<int> readers;
      for (int output : table.nodes[producer_node].outputs) {
        for (int c : table.tensors[output].consumers) {
          if (c >= n || ReadsRecomputedValues(table, flow, c)) continue;
          if (std::find(readers.begin(), readers.end(), c) == readers.end()) {
            readers.push_back(c);
          }
        }
      }
      std::sort(readers.begin(), readers.end());
      for (int c : readers) {
        if (edit != nullptr) edit->SaveControlInputs(table, c);
        table.nodes[c].control_inputs.push_back(out_node);
        rewrite->waits.push_back(
            {c, table.nodes[out_node].def->name(), table.nodes[c].def->name()});
      }
    }
    rewrite->swapped.push_back(t);
    rewrite->bytes_to_host += tensor.bytes;
    rewrite->copy_seconds += copy;
  }

  rewrite->order.clear();
  rewrite->order.reserve(table.nodes.size());
  for (int node : order) {
    rewrite->order.push_back(node);
    for (int added : after[node]) rewrite->order.push_back(added);
  }
  return absl::OkStatus();
}

absl::Status ApplySwapRewrite(const SwapRewrite& rewrite, tensorflow::GraphDef* graph) {
  for (const SwapRewrite::Rewire& rewire : rewrite.rewires) {
    if (rewire.node < 0 || rewire.node >= graph->node_size()) {
      return absl::InternalError("swap: rewired node out of range");
    }
    NodeDef* node = graph->mutable_node(rewire.node);
    if (node->name() != rewire.node_name ||
        rewire.slot >= node->input_size() ||
        tensorflow::grappler::IsControlInput(node->input(rewire.slot))) {
      return absl::InternalError(
          absl::StrCat("swap: graph and table disagree at ", node->name()));
    }
    node->set_input(rewire.slot, rewire.input);
  }
  for (const SwapRewrite::Wait& wait : rewrite.waits) {
    if (wait.node < 0 || wait.node >= graph->node_size() ||
        graph->node(wait.node).name() != wait.node_name) {
      return absl::InternalError(
          absl::StrCat("swap: graph and table disagree at ", wait.node_name));
    }
    graph->mutable_node(wait.node)->add_input(absl::StrCat("^", wait.swap_out));
  }
  for (const NodeDef& added : rewrite.new_defs) *graph->add_node() = added;
  return absl::OkStatus();
}

std::vector<int64_t> HostBytesTimeline(const TensorTable& table, const std::vector<int>& order,
                                       int64_t* peak) {
  std::vector<int> position(table.nodes.size(), -1);
  for (size_t s = 0; s < order.size(); ++s) position[order[s]] = static_cast<int>(s);
  std::vector<int64_t> delta(order.size() + 1, 0);
  for (size_t t = 0; t < table.tensors.size(); ++t) {
    const TensorInfo& tensor = table.tensors[t];
    const BufferInfo& buffer = table.buffers[tensor.buffer];
    if (buffer.host_bytes <= 0 || buffer.owner != static_cast<int>(t)) continue;
    const int start = position[tensor.node];
    int last = start;
    for (int c : tensor.consumers) last = std::max(last, position[c]);
    if (start < 0) continue;
    delta[start] += buffer.host_bytes;
    delta[last + 1] -= buffer.host_bytes;
  }
  std::vector<int64_t> timeline(order.size(), 0);
  int64_t live = 0;
  *peak = 0;
  for (size_t s = 0; s < order.size(); ++s) {
    live += delta[s];
    timeline[s] = live;
    *peak = std::max(*peak, live);
  }
  return timeline;
}

}  // namespace tfmemopt
