// Plan: recomputation as a planner mechanism (see plan/mechanism.h).
//
// Items are base forward nodes to clone for the backward pass
// (rewrite/recompute_pass.h). At the peak, a holding's candidate is its producer
// plus whatever inputs would otherwise have to be kept alive (the closure, back
// to tensors that are live anyway: its anchors), worth the holding's bytes minus
// the buffers the closure keeps alive, at the closure's OpLevelCostEstimator time.
// The alternative placement triggers each clone one backward step earlier; a
// pinned plan triggers it right before its reader (ClonePlacement).
//
// The policies that fix a recompute set without a search live here too: SQRT
// (OpenAI's checkpoints='memory') and MANUAL (the user's hints).
#ifndef TFMEMOPT_GRAPPLER_PLAN_RECOMPUTE_CHOICE_H_
#define TFMEMOPT_GRAPPLER_PLAN_RECOMPUTE_CHOICE_H_

#include <string>
#include <vector>

#include "grappler/plan/mechanism.h"
#include "grappler/rewrite/recompute_pass.h"

namespace tfmemopt {

// Why forward node `node` may not be recomputed ("stateful", "control_flow",
// "non_plain_dtype", "reads_reference_variable", "unknown_size", "persistent",
// "excluded", "not_included",
// "input_or_structural"), or "" if it may.
std::string NotRecomputableReason(const TensorTable& table, const ControlFlowInfo& flow,
                                  const MemoryPlannerOptions& options, int node);

class RecomputeChoice : public Mechanism {
 public:
  // Counts the forward nodes it will never recompute in plan->left_alone.
  RecomputeChoice(const PlanContext& context, MemoryPlan* plan);

  const char* name() const override { return "recompute"; }
  absl::Status Apply(TensorTable* work, const std::vector<int>& order,
                     const std::vector<int>& items, bool variant) override;
  void Undo(TensorTable* work) override { edit_.Undo(work); }
  // Each clone triggered right before its earliest reader (kBeforeReader), serving
  // the backward readers from `readers_from` on.
  absl::Status ApplyPinned(TensorTable* work, const std::vector<int>& order,
                           const std::vector<int>& items, int readers_from) override;
  const std::vector<int>& order() const override { return applied_.order; }
  const std::vector<int>& applied() const override { return applied_.cloned; }
  double AddSeconds(double seconds) const override { return seconds + applied_.added_seconds; }

  void BeginProposals(const std::vector<int>& items) override;
  bool Covers(int buffer) const override;
  void Propose(const PeakView& view, const Holding& holding, int self,
               std::vector<Candidate>* out) override;

  bool HasVariant(const std::vector<int>& items) const override { return !items.empty(); }
  bool Divisible() const override { return true; }
  double ItemSeconds(int item) const override;
  bool ExactItems(int limit, std::vector<int>* items) override;
  std::function<bool(uint64_t)> ExactFilter(const std::vector<std::pair<int, int>>& items,
                                            int self) const override;

  // SQRT: the forward tensors that alone connect the forward graph's earlier part
  // to its later part are candidate checkpoints; every ceil(sqrt(n))-th is kept
  // (recorded in plan->checkpoints) and the big forward nodes between them form
  // one segment each, to recompute.
  void SqrtSegments(std::vector<std::vector<int>>* segments);
  // MANUAL: the hinted nodes that may be recomputed; the others are recorded in
  // plan->hinted_but_not_recomputable with the reason.
  void ManualItems(std::vector<int>* items);

 private:
  const PlanContext& ctx_;
  MemoryPlan* plan_;
  std::vector<bool> recomputable_;  // per base node
  std::vector<bool> chosen_;        // per base node: in the current choice
  std::vector<bool> in_closure_;    // scratch of Propose
  std::vector<bool> direct_;        // per base node: read by a backward op (ExactItems)
  RecomputeRewrite applied_;
  TableEdit edit_;
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_RECOMPUTE_CHOICE_H_
