// Plan: swapping as a planner mechanism (see plan/mechanism.h).
//
// Items are base forward tensors to copy to host memory after their forward use
// and back before their first backward reader (rewrite/lms_swap_optimizer.h). At
// the peak, a holding's candidate swaps its late tensors, worth the holding's
// bytes, at the time of the two copies (bytes / bandwidth, scaled by how much of
// a copy the device cannot hide behind compute: all of it on a CPU, whose cores do
// the copy; a tenth on a GPU, whose copy engines run beside the kernels).
//
// Never swapped: tensors produced under control flow or by the backward pass,
// graph inputs and other caller-held buffers, persistent buffers, tensors of
// types the swap ops do not take, and AddN inputs (PlanContext::pinned).
#ifndef TFMEMOPT_GRAPPLER_PLAN_SWAP_CHOICE_H_
#define TFMEMOPT_GRAPPLER_PLAN_SWAP_CHOICE_H_

#include <string>
#include <vector>

#include "grappler/plan/mechanism.h"
#include "grappler/rewrite/lms_swap_optimizer.h"

namespace tfmemopt {

// The copy bandwidth used for a device ("CPU:0", "GPU:0") when the config gives none:
// measured on the CPU test bed (benchmarks/host_bandwidth.py), assumed for GPUs.
double DefaultHostBandwidth(const std::string& device);
// The bandwidth a plan copies at: the config's, else the default for the table's
// devices (one bandwidth per plan; a graph on a GPU copies at the GPU's).
double SwapBandwidth(const TensorTable& table, const MemoryPlannerOptions& options);
// Fraction of a copy's time the device cannot hide behind compute: all of it on a
// CPU, whose cores do the copy; a tenth on a GPU, whose copy engines run beside
// the kernels.
double CopyExposure(const std::string& device);

class SwapChoice : public Mechanism {
 public:
  explicit SwapChoice(const PlanContext& context);

  const char* name() const override { return "swap"; }
  absl::Status Apply(TensorTable* work, const std::vector<int>& order,
                     const std::vector<int>& items, bool variant) override;
  void Undo(TensorTable* work) override { edit_.Undo(work); }
  const std::vector<int>& order() const override { return applied_.order; }
  const std::vector<int>& applied() const override { return applied_.swapped; }
  double AddSeconds(double seconds) const override;

  void BeginProposals(const std::vector<int>& items) override;
  bool Covers(int buffer) const override;
  bool EarlyReader(const NodeInfo& added) const override;
  void Propose(const PeakView& view, const Holding& holding, int self,
               std::vector<Candidate>* out) override;

  int64_t Room(const std::vector<int>& items) const override;
  double ItemSeconds(int item) const override;

  // The swap rewrite's options: the config's, with the device's default bandwidth
  // when none is given (one bandwidth per plan; a graph on a GPU copies at the GPU's).
  const SwapOptions& options() const { return swap_options_; }

 private:
  bool Swappable(int tensor) const;

  const PlanContext& ctx_;
  SwapOptions swap_options_;
  std::vector<bool> swapped_;  // per base tensor: in the current choice
  int64_t count_ = 0;          // tensors in the current choice
  SwapRewrite applied_;
  TableEdit edit_;
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_SWAP_CHOICE_H_
