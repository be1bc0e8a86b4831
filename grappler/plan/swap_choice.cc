#include "grappler/plan/swap_choice.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "grappler/analyze/kernel_memory.h"
#include "grappler/ops/swap_ops.h"

namespace tfmemopt {

double CopyExposure(const std::string& device) {
  return absl::StartsWith(device, "GPU") ? 0.1 : 1.0;
}

double DefaultHostBandwidth(const std::string& device) {
  // CPU test bed: TfMemSwapOut/In at 128 MiB, median of warm runs, the slower
  // direction (python benchmarks/host_bandwidth.py). GPUs: an assumed effective
  // PCIe 3.0 x16 rate; set host_bandwidth_bytes_per_sec for your machine.
  return absl::StartsWith(device, "GPU") ? 12e9 : 3.65e9;
}

double SwapBandwidth(const TensorTable& table, const MemoryPlannerOptions& options) {
  if (options.swap.bandwidth_bytes_per_sec > 0) return options.swap.bandwidth_bytes_per_sec;
  bool gpu = false;
  for (const std::string& device : table.devices) gpu |= absl::StartsWith(device, "GPU");
  return DefaultHostBandwidth(gpu ? "GPU:0" : "CPU:0");
}

SwapChoice::SwapChoice(const PlanContext& context) : ctx_(context) {
  swap_options_ = ctx_.options.swap;
  swap_options_.bandwidth_bytes_per_sec = SwapBandwidth(ctx_.table, ctx_.options);
  swapped_.assign(ctx_.table.tensors.size(), false);
}

absl::Status SwapChoice::Apply(TensorTable* work, const std::vector<int>& order,
                               const std::vector<int>& items, bool variant) {
  return SwapInPlace(work, order, ctx_.flow, items, swap_options_, &applied_, &edit_);
}

double SwapChoice::ItemSeconds(int tensor) const {
  const TensorInfo& t = ctx_.table.tensors[tensor];
  const std::string& device = ctx_.table.nodes[t.node].device;
  return 2.0 * static_cast<double>(t.bytes) / swap_options_.bandwidth_bytes_per_sec *
         CopyExposure(device);
}

double SwapChoice::AddSeconds(double seconds) const {
  for (int t : applied_.swapped) seconds += ItemSeconds(t);
  return seconds;
}

bool SwapChoice::Swappable(int tensor) const {
  const TensorTable& table = ctx_.table;
  const TensorInfo& t = table.tensors[tensor];
  const NodeInfo& producer = table.nodes[t.node];
  // A graph input's buffer belongs to the caller, who keeps it: swapping frees nothing.
  const std::string& op = producer.def->op();
  if (op == "_Arg" || op == "Placeholder" || op == "PlaceholderWithDefault") return false;
  // A MaxPoolGrad that reads oneDNN's workspace through this tensor would read a
  // swap-in instead and take Eigen's kernel (analyze/kernel_memory.h), which adds
  // the gradients of overlapping windows in another order: not bit for bit.
  for (int reader : t.consumers) {
    const NodeInfo& grad = table.nodes[reader];
    if (grad.inputs.size() > 1 && grad.inputs[1] == tensor && UsesOneDnnWorkspace(table, grad)) {
      return false;
    }
  }
  return !producer.backward && !ctx_.flow.Under(t.node) && SwapOpsTakeType(t.dtype) &&
         t.size_known && !table.buffers[t.buffer].persistent &&
         !table.buffers[t.buffer].external && FilterReason(*producer.def, ctx_.options).empty();
}

void SwapChoice::BeginProposals(const std::vector<int>& items) {
  std::fill(swapped_.begin(), swapped_.end(), false);
  for (int t : items) swapped_[t] = true;
  count_ = static_cast<int64_t>(items.size());
}

bool SwapChoice::Covers(int buffer) const {
  for (int t : ctx_.tensors_of_buffer[buffer]) {
    if (swapped_[t]) return true;
  }
  return false;
}

bool SwapChoice::EarlyReader(const NodeInfo& added) const {
  return absl::StartsWith(added.def->name(), kSwapOutScope);
}

int64_t SwapChoice::Room(const std::vector<int>& items) const {
  if (ctx_.options.max_swapped_tensors <= 0) return INT64_MAX;
  return ctx_.options.max_swapped_tensors - static_cast<int64_t>(items.size());
}

void SwapChoice::Propose(const PeakView& view, const Holding& holding, int self,
                         std::vector<Candidate>* out) {
  const MemoryPlannerOptions& options = ctx_.options;
  const bool can_swap =
      options.enable_swap &&
      (options.max_swapped_tensors <= 0 || count_ < options.max_swapped_tensors);
  if (!can_swap || ctx_.pinned[holding.buffer]) return;
  for (int t : holding.late_tensors) {
    if (!Swappable(t)) return;
  }
  Candidate swap;
  swap.mechanism = self;
  swap.owner = holding.owner_node;
  swap.nodes = {holding.owner_node};
  swap.items = holding.late_tensors;
  swap.gain = ctx_.table.buffers[holding.buffer].bytes;
  for (int t : holding.late_tensors) swap.seconds += ItemSeconds(t);
  swap.seconds += 1e-7;
  out->push_back(std::move(swap));
}

}  // namespace tfmemopt
