// Plan: splitting per-sample work along the batch, the planner's fourth choice.
//
// Keeping, swapping and recomputing lower the peak only down to one op's own
// working set at full batch. When the budget cannot be met that way (or the
// allocator model refuses an allocation of the best plan), the planner splits:
//  * Regions: ops that analyze/per_sample.h classifies as per-sample or (in the
//    backward pass) as batch reductions, minus those the user excludes, those TF
//    must keep (fetches), and any that would read a region tensor whole or a
//    reduction's partial sum. Their connected parts are the candidate regions;
//    the one with the largest op working set is tried first, then all of them.
//  * Factor: k = 2, 3, 4, 6, 8, 12, ... (each power of two, then 1.5 times it; at
//    most MemoryPlannerOptions::max_split_slices and the batch size), the smallest
//    first, since every slice runs smaller kernels; a k whose largest (aligned)
//    slice is no smaller than the last k's is skipped. The search stops at a power
//    of two no closer to fitting than the plan without splitting or than the k
//    before it (a plateau), or at the second power of two in a row that does
//    worse: the allocator model's peak is not monotone in k.
//  * Batch statistics: the regions first end at every gradient of a mean over the
//    batch (batch normalization's). Only when no such split fits, and
//    split_batch_statistics allows it, the search runs again with regions passing
//    through them; that split is taken if it fits, or if it beats the first
//    search's split on both counts below (it reorders the sums that batch
//    normalization's backward subtracts: docs/split.md#batch-statistics).
// Each candidate is built (rewrite/split_pass.h), analyzed afresh like any graph
// (shapes, sizes, costs, the executor's order) and planned by PlanMemory, which
// may still recompute or swap (a slice's backward can recompute that slice's
// forward). The first candidate whose plan fits wins. If none fits, the one
// closest to fitting as the planner judges plans (plan/objective.h: the excess over
// the budget plus an allocator refusal's missing bytes), and only if it beats the
// plan without splitting on both counts, that and the predicted peak: a split
// changes the order of the weight gradients' sums, which a tie does not justify.
//
// Predicted added time: the split graph's predicted compute minus the original's
// (OpLevelCostEstimator on the slices' shapes, plus the cuts, joins and sums),
// plus the plan's own added time on the split graph, plus kSliceOverheadSeconds per
// added op (kernel launches and smaller, less efficient kernels).
#ifndef TFMEMOPT_GRAPPLER_PLAN_SPLIT_CHOICE_H_
#define TFMEMOPT_GRAPPLER_PLAN_SPLIT_CHOICE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/per_sample.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/memory_optimizer_options.h"
#include "grappler/plan/memory_planner.h"
#include "grappler/rewrite/split_pass.h"
#include "tensorflow/core/grappler/grappler_item.h"

namespace tfmemopt {

inline constexpr double kSliceOverheadSeconds = 5e-6;

struct SplitTrial {
  int slices = 0;
  int region_nodes = 0;
  std::vector<int64_t> peak_bytes;  // per device, the plan's predicted peak
  bool fits = false;
  int64_t excess = 0;  // Objective::excess: over the budget plus a refusal's missing bytes
  double added_seconds = 0;
  bool through_batch_statistics = false;  // regions passed through batch statistics
};

// A split graph, analyzed and planned. table.nodes point into item->graph.
struct SplitGraph {
  std::unique_ptr<tensorflow::grappler::GrapplerItem> item;
  TensorTable table;
  std::vector<int> order;
  ControlFlowInfo flow;
  MemoryPlan plan;
  PlannedRewrite rewrite;
  SimulationResult simulation;
};

struct SplitOutcome {
  bool planned = false;  // the split planner ran
  bool applied = false;  // a split was chosen
  bool fits = false;     // ... and its plan fits the budget
  int64_t excess = 0;    // ... else by how much it misses (SplitTrial::excess)
  int64_t peak = 0;      // ... the worst device's predicted peak
  // The split passes through gradients of batch statistics (MemoryOptimizerOptions::
  // split_batch_statistics): chosen only when no other split fits (PlanSplit).
  bool through_batch_statistics = false;
  std::string note;      // why nothing was split, when nothing was
  int64_t batch = 0;
  SplitSpec spec;
  SplitSummary summary;
  std::vector<std::string> region;  // names of the split ops, in graph order
  std::map<std::string, int> region_ops;  // op type -> count
  std::map<std::string, int> left_alone;  // per-sample analysis: ops not splittable, by reason
  double added_seconds = 0;
  std::vector<SplitTrial> trials;
  // The chosen split graph and its plan (when applied).
  SplitGraph chosen;
};

// Plans a split of `item` (whose table, order and control flow are given) under
// `planner`'s budgets, when `unsplit` (the plan without splitting, simulated as
// `unsplit_simulation`) does not fit. `options` are the pass's (for analyzing the
// split graphs).
absl::Status PlanSplit(const tensorflow::grappler::GrapplerItem& item, const TensorTable& table,
                       const std::vector<int>& order, const ControlFlowInfo& flow,
                       const MemoryOptimizerOptions& options,
                       const MemoryPlannerOptions& planner, const MemoryPlan& unsplit,
                       const SimulationResult& unsplit_simulation, SplitOutcome* out);

// Whether a plan needs splitting: it does not fit, or the allocator model refuses
// one of its allocations on a device with a budget.
bool NeedsSplit(const MemoryPlan& plan, const SimulationResult& simulation,
                const std::vector<int64_t>& budget_bytes);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_SPLIT_CHOICE_H_
