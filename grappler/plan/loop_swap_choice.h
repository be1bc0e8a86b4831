// Plan: swapping a loop's accumulators as a planner mechanism (see
// plan/mechanism.h), the third after recomputation and swapping.
//
// Items are list instances (TensorTable::loops.lists indices): TensorLists a
// forward while-loop fills for its gradient, whose elements go to host memory as
// they are pushed and come back as the gradient loop pops them
// (rewrite/loop_swap.h). A list is not one forward buffer that waits for the
// backward pass (a holding): it is filled step by step inside the loop, so its
// candidates are proposed once per simulated peak (ProposeAtPeak), not per
// holding. A swappable list (LoopSwapBlocker is "") of at least min_tensor_bytes
// whose storage is live at the peak is a candidate worth what the device gets
// back: its elements, or, for elements read from another list, that list's
// storage once this list was its last holder. Its cost is its copies, out once
// and back once per step: 2 x bytes / bandwidth, scaled by how much of a copy the
// device cannot hide (CopyExposure of the graph's first device: loops run where
// their lists are).
//
// The exact search gets no items (its plans are recompute-only), and the final
// cleanup gives a list back only as the whole candidate it came in.
#ifndef TFMEMOPT_GRAPPLER_PLAN_LOOP_SWAP_CHOICE_H_
#define TFMEMOPT_GRAPPLER_PLAN_LOOP_SWAP_CHOICE_H_

#include <vector>

#include "grappler/plan/mechanism.h"
#include "grappler/rewrite/loop_swap.h"

namespace tfmemopt {

class LoopSwapChoice : public Mechanism {
 public:
  explicit LoopSwapChoice(const PlanContext& context);

  const char* name() const override { return "loop_swap"; }
  absl::Status Apply(TensorTable* work, const std::vector<int>& order,
                     const std::vector<int>& items, bool variant) override;
  void Undo(TensorTable* work) override { edit_.Undo(work); }
  const std::vector<int>& order() const override { return applied_.order; }
  const std::vector<int>& applied() const override { return applied_.swapped; }
  double AddSeconds(double seconds) const override;

  void BeginProposals(const std::vector<int>& items) override;
  // Lists are no holdings: nothing to propose per holding.
  void Propose(const PeakView& view, const Holding& holding, int self,
               std::vector<Candidate>* out) override {}
  void ProposeAtPeak(const PeakView& view, int self, std::vector<Candidate>* out) override;

  double ItemSeconds(int list) const override;

  // The bandwidth the rewrite copies at (the swap mechanism's, SwapBandwidth).
  double bandwidth() const { return bandwidth_; }

 private:
  const PlanContext& ctx_;
  double bandwidth_ = 0;
  double exposure_ = 1;
  std::vector<bool> chosen_;  // per list: in the current choice
  LoopSwapRewrite applied_;
  TableEdit edit_;
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_LOOP_SWAP_CHOICE_H_
