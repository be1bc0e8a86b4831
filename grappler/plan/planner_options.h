// Plan: the planner's options and its result, shared by the planner's pieces
// (plan/memory_planner.h, plan/descent.h and the mechanisms under plan/).
#ifndef TFMEMOPT_GRAPPLER_PLAN_PLANNER_OPTIONS_H_
#define TFMEMOPT_GRAPPLER_PLAN_PLANNER_OPTIONS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "grappler/memory_optimizer_options.h"
#include "grappler/rewrite/lms_swap_optimizer.h"
#include "grappler/simulate/liveness_simulator.h"

namespace tfmemopt {

struct MemoryPlannerOptions {
  RecomputePolicy policy = RecomputePolicy::kAuto;
  bool enable_recompute = true;
  bool enable_swap = true;
  // Per device of the table (TensorTable::devices order); 0: no budget there.
  std::vector<int64_t> budget_bytes;
  // Smaller tensors are kept (MANUAL recompute hints override this).
  int64_t min_tensor_bytes = 1 << 20;
  std::vector<std::string> exclude_scopes, include_scopes;
  std::vector<std::string> exclude_op_types, include_op_types;
  // MANUAL: name scopes whose nodes are recomputed.
  std::vector<std::string> hint_scopes;
  // At most this many tensors are swapped (TFLMS n_tensors); 0: no limit.
  int64_t max_swapped_tensors = 0;
  // Bandwidth and swap-in timing; bandwidth 0 picks the default for the device.
  SwapOptions swap;
  SimulationOptions simulation;
  // Upper bound on simulations of candidate plans (planning effort).
  int max_simulations = 400;
  // AUTO, exact search: on graphs of at most exact_max_nodes nodes whose recompute
  // candidates (forward nodes whose clone a backward op would read) number at most
  // exact_max_candidates, subsets of candidates are simulated cheapest first, and
  // the first that fits replaces the greedy plan if it is cheaper (sets that cost
  // at least the greedy plan are not tried). Its effort is bounded by
  // exact_max_simulations (up to 2 per set: both trigger placements) and by
  // exact_max_node_steps (simulations x nodes: a simulation's cost grows with the
  // graph; about 0.6 s on the test machine); past either, the greedy plan stands.
  int exact_max_candidates = 20;
  int exact_max_nodes = 1000;
  int exact_max_simulations = 4000;
  int64_t exact_max_node_steps = 400000;
  // Splitting (plan/split_choice.h): at most this many slices of the batch.
  int max_split_slices = 64;
};

// A plan the planner found and weighed against others (AUTO with both mechanisms:
// the joint search and each mechanism alone).
struct CandidatePlan {
  std::string name;  // "joint", "swap_only", "recompute_only"
  bool fits = false;
  double added_seconds = 0;
  int recomputed = 0;  // recompute items (forward nodes to clone)
  int swapped = 0;     // swapped tensors
  std::vector<int64_t> peak_bytes;  // per device, PredictedPeak
  int simulations = 0;  // plans simulated by its search
};

struct MemoryPlan {
  std::vector<int> recompute_nodes;  // base node indices that got a clone
  std::vector<int> swap_tensors;     // base tensor indices that are swapped
  std::vector<int> loop_swap_lists;  // TensorTable::loops.lists indices that are swapped
  // Per device, the simulated peak of the chosen plan (see PredictedPeak); when the
  // budget cannot be met, the lowest peak found.
  std::vector<int64_t> peak_bytes;
  bool feasible = true;
  int simulations = 0;
  // AUTO: "exact" if the plan is the cheapest recompute-only plan that fits (or
  // none cheaper than the greedy plan fits), "greedy" if the exact search was not
  // run or ran out of simulations; "" under other policies.
  std::string search;
  int exact_candidates = -1;  // the exact search's candidates; -1: not run
  double added_seconds = 0;  // recompute compute + the copy time not hidden
  std::vector<int> checkpoints;  // SQRT: nodes whose output is kept as a checkpoint
  // Forward nodes never recomputed, by reason ("stateful", "control_flow", ...).
  std::map<std::string, int> left_alone;
  std::vector<std::string> hinted_but_not_recomputable;  // MANUAL: names, with reason
  std::string note;  // why a SQRT or MANUAL plan was not applied, if it was not
  // AUTO with both mechanisms: the plans weighed, and the one kept (before the exact
  // search, which may still replace it by a cheaper recompute-only plan).
  std::vector<CandidatePlan> candidate_plans;
  std::string chosen_plan;
  // Allocator refusals the searches steered around (plan/steer.cc): windows of
  // neighbouring chunks freed, and the base buffers taken for them.
  int allocator_windows = 0;
  std::vector<int> steered_buffers;
  // Of those, the tensors the applied plan swaps or recomputes (buffer owners).
  std::vector<std::string> steered_tensors;
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_PLANNER_OPTIONS_H_
