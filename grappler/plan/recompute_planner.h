// Plan: which forward nodes to recompute in the backward pass.
//
// Policies:
//  * AUTO: the cheapest set that brings the simulated peak within the budget. At
//    the simulated peak, every forward buffer that is only waiting for the backward
//    pass is a candidate; dropping it costs the compute of its producer plus the
//    producers of whatever inputs would otherwise have to be kept alive (the
//    closure, back to tensors that are live anyway: checkpoints). Candidates are
//    taken by bytes saved per second of compute, the rewrite is simulated again,
//    and this repeats until the peak fits or nothing is left to drop (then the
//    lowest peak found is reported as the minimum). Groups that turn out not to be
//    needed are dropped again at the end, most expensive first.
//  * SQRT: OpenAI's checkpoints='memory'. The articulation points of the forward
//    graph (tensors that alone connect its earlier part to its later part) are the
//    candidate checkpoints; every ceil(sqrt(n))-th of them is kept and every other
//    forward node is recomputed, so a chain of n layers keeps about sqrt(n).
//  * MANUAL: exactly the hinted nodes (name scopes in the config, TF's
//    `_recompute_hint` attribute, tfmemopt.recompute_scope()'s
//    `_tfmemopt_recompute` attribute).
//
// Never recomputed, whatever the policy: stateful nodes (random ops, variable
// reads and updates, I/O), nodes under control flow (loops, cond branches), graph
// inputs, constants and variables, and nodes that read or produce resources,
// variants or strings.
#ifndef TFMEMOPT_GRAPPLER_PLAN_RECOMPUTE_PLANNER_H_
#define TFMEMOPT_GRAPPLER_PLAN_RECOMPUTE_PLANNER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/memory_optimizer_options.h"
#include "grappler/rewrite/recompute_pass.h"
#include "grappler/simulate/liveness_simulator.h"

namespace tfmemopt {

struct RecomputePlannerOptions {
  RecomputePolicy policy = RecomputePolicy::kAuto;
  // Per device of the table (TensorTable::devices order); 0: no budget there.
  std::vector<int64_t> budget_bytes;
  // Smaller tensors are kept, not recomputed (MANUAL hints override this).
  int64_t min_tensor_bytes = 1 << 20;
  std::vector<std::string> exclude_scopes, include_scopes;
  std::vector<std::string> exclude_op_types, include_op_types;
  // MANUAL: name scopes whose nodes are recomputed.
  std::vector<std::string> hint_scopes;
  SimulationOptions simulation;
  // Upper bound on simulations of candidate plans (planning effort).
  int max_simulations = 400;
};

struct RecomputePlan {
  std::vector<int> nodes;  // base node indices chosen for recomputation
  // Per device, the simulated peak of the chosen plan (allocator peak where
  // modelled); when infeasible it is the lowest peak found.
  std::vector<int64_t> peak_bytes;
  bool feasible = true;
  int simulations = 0;
  std::vector<int> checkpoints;  // SQRT: nodes whose output is kept as a checkpoint
  // Forward nodes that were left alone, by reason ("stateful", "control_flow", ...).
  std::map<std::string, int> left_alone;
  std::vector<std::string> hinted_but_not_recomputable;  // MANUAL: names, with reason
};

// Peak of a device as the report states it: the allocator's where modelled (it
// counts whole chunks), never less than the live bytes.
int64_t PredictedPeak(const DeviceTimeline& timeline);

// Plans recomputation for the table, simulated along `order`. On success `rewrite`
// and `simulation` hold the chosen plan applied and simulated (an empty plan if
// nothing is recomputed).
absl::Status PlanRecompute(const TensorTable& table, const std::vector<int>& order,
                           const ControlFlowInfo& flow,
                           const RecomputePlannerOptions& options, RecomputePlan* plan,
                           RecomputeRewrite* rewrite, SimulationResult* simulation);

// True if `name` is in `scope` (equal to it, or under it: "scope/...").
bool InScope(const std::string& name, const std::string& scope);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_RECOMPUTE_PLANNER_H_
