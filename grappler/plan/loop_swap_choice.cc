#include "grappler/plan/loop_swap_choice.h"

#include <algorithm>

#include "grappler/plan/swap_choice.h"

namespace tfmemopt {

LoopSwapChoice::LoopSwapChoice(const PlanContext& context) : ctx_(context) {
  bandwidth_ = SwapBandwidth(ctx_.table, ctx_.options);
  exposure_ = CopyExposure(ctx_.table.devices.empty() ? std::string() : ctx_.table.devices.front());
  chosen_.assign(ctx_.table.loops.lists.size(), false);
}

absl::Status LoopSwapChoice::Apply(TensorTable* work, const std::vector<int>& order,
                                   const std::vector<int>& items, bool variant) {
  return LoopSwapInPlace(work, order, items, bandwidth_, &applied_, &edit_);
}

double LoopSwapChoice::AddSeconds(double seconds) const {
  return seconds + applied_.copy_seconds * exposure_;
}

double LoopSwapChoice::ItemSeconds(int list) const {
  return 2.0 * static_cast<double>(LoopListBytes(ctx_.table, list)) / bandwidth_ * exposure_;
}

void LoopSwapChoice::BeginProposals(const std::vector<int>& items) {
  std::fill(chosen_.begin(), chosen_.end(), false);
  for (int list : items) chosen_[list] = true;
}

void LoopSwapChoice::ProposeAtPeak(const PeakView& view, int self, std::vector<Candidate>* out) {
  const TensorTable& table = ctx_.table;
  if (!ctx_.options.enable_swap || table.loops.lists.empty() || bandwidth_ <= 0) return;
  // Liveness of the base table's buffers (the view's table appends its own).
  auto live = [&](int buffer) {
    return buffer >= 0 && buffer < static_cast<int>(table.buffers.size()) &&
           buffer < static_cast<int>(view.live.size()) && view.live[buffer];
  };
  for (size_t l = 0; l < table.loops.lists.size(); ++l) {
    const int list = static_cast<int>(l);
    if (chosen_[l]) continue;
    const ListInstance& instance = table.loops.lists[l];
    const int64_t bytes = LoopListBytes(table, list);
    if (bytes <= 0 || bytes < ctx_.options.min_tensor_bytes ||
        !LoopSwapBlocker(table, list).empty()) {
      continue;
    }
    // What the device gets back: the list's own elements, or, for elements read
    // from another list, that list's storage once this was its last holder.
    int64_t gain = 0;
    if (!instance.referenced) {
      if (live(instance.buffer)) gain = table.buffers[instance.buffer].bytes;
    } else {
      const int source_index = table.tensors[instance.item].buffer;
      const BufferInfo& source = table.buffers[source_index];
      if (live(source_index) && source.held_by.size() == 1 &&
          source.held_by[0] == instance.buffer) {
        gain = source.bytes;
      }
    }
    if (gain <= 0) continue;
    Candidate candidate;
    candidate.mechanism = self;
    candidate.owner = instance.enter;
    candidate.items = {list};
    candidate.gain = gain;
    candidate.seconds = ItemSeconds(list) + 1e-7;
    out->push_back(std::move(candidate));
  }
}

}  // namespace tfmemopt
