// Plan: for every forward tensor the backward pass reads, keep it, recompute it or
// swap it to host memory, so that the simulated peak fits the budget at the lowest
// predicted added time.
//
// Costs: a recompute costs the OpLevelCostEstimator time of the ops it clones; a
// swap costs its two copies (bytes / bandwidth), scaled by how much of a copy the
// device cannot hide behind compute (all of it on a CPU, whose cores do the copy;
// a tenth on a GPU, whose copy engines run beside the kernels).
//
// Recompute policies:
//  * AUTO: budget-driven. At the simulated peak, every forward buffer that only
//    waits for the backward pass is a candidate, to drop and recompute (its
//    producer plus whatever inputs would otherwise have to be kept alive: the
//    closure, back to tensors that are live anyway, its anchors) or to swap.
//    Candidates are taken by bytes saved per second added; the plan is simulated
//    again after each step, until the peak fits or nothing lowers it any more (then
//    the lowest peak found is reported as the minimum). Choices the budget turns
//    out not to need are dropped again at the end, most expensive first.
//    Small graphs (see exact_max_candidates) then get an exact search: every set
//    of recompute candidates, cheapest first, is simulated until one fits; it
//    replaces the greedy plan if it is cheaper. On such graphs (exact_max_nodes)
//    each plan is simulated with the clones triggered as late as possible and, if
//    that does not fit, one backward step earlier (see RecomputeInPlace), and the
//    better placement is kept.
//  * SQRT: OpenAI's checkpoints='memory'. The articulation points of the forward
//    graph (tensors that alone connect its earlier part to its later part) are the
//    candidate checkpoints; every ceil(sqrt(n))-th is kept and every other forward
//    node is recomputed, so a chain of n layers keeps about sqrt(n).
//  * MANUAL: exactly the hinted nodes (name scopes in the config, TF's
//    `_recompute_hint` attribute, tfmemopt.recompute_scope()'s `_tfmemopt_recompute`).
// Under SQRT and MANUAL, swapping (if enabled) then takes over what is still over
// the budget.
//
// Never recomputed: stateful nodes (random ops, variable reads and updates, I/O),
// nodes under control flow (loops, cond branches), graph inputs, constants and
// variables, nodes that read or produce resources, variants or strings. Never
// swapped: tensors produced under control flow or by the backward pass, and
// tensors of non-plain types.
#ifndef TFMEMOPT_GRAPPLER_PLAN_MEMORY_PLANNER_H_
#define TFMEMOPT_GRAPPLER_PLAN_MEMORY_PLANNER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/memory_optimizer_options.h"
#include "grappler/rewrite/lms_swap_optimizer.h"
#include "grappler/rewrite/loop_swap.h"
#include "grappler/rewrite/recompute_pass.h"
#include "grappler/simulate/liveness_simulator.h"
#include "tensorflow/core/framework/graph.pb.h"

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
};

// A plan applied: recomputation first, swapping on top of it, then the loops'
// accumulators (each rewrite takes over the previous one's table).
struct PlannedRewrite {
  RecomputeRewrite recompute;
  SwapRewrite swap;
  LoopSwapRewrite loop_swap;
  const TensorTable& table() const { return loop_swap.table; }
  const std::vector<int>& order() const { return loop_swap.order; }
};

// Peak of a device as the report states it: the allocator's where modelled (it
// counts whole chunks), never less than the live bytes (past its memory limit the
// allocator model refuses allocations and its own peak stops growing).
int64_t PredictedPeak(const DeviceTimeline& timeline);

// The copy bandwidth used for a device ("CPU:0", "GPU:0") when the config gives none:
// measured on the CPU test bed (benchmarks/host_bandwidth.py), assumed for GPUs.
double DefaultHostBandwidth(const std::string& device);

// Plans for the table, simulated along `order`. On success `rewrite` and
// `simulation` hold the chosen plan applied and simulated (an empty plan if nothing
// is changed).
absl::Status PlanMemory(const TensorTable& table, const std::vector<int>& order,
                        const ControlFlowInfo& flow, const MemoryPlannerOptions& options,
                        MemoryPlan* plan, PlannedRewrite* rewrite, SimulationResult* simulation);

// Applies a planned rewrite to `graph`, the GraphDef the table was built from.
absl::Status ApplyPlannedRewrite(const PlannedRewrite& rewrite, tensorflow::GraphDef* graph);

// Why forward node `node` may not be recomputed ("stateful", "control_flow",
// "non_plain_dtype", "unknown_size", "persistent", "excluded", "not_included",
// "input_or_structural"), or "" if it may.
std::string NotRecomputableReason(const TensorTable& table, const ControlFlowInfo& flow,
                                  const MemoryPlannerOptions& options, int node);

// True if `name` is in `scope` (equal to it, or under it: "scope/...").
bool InScope(const std::string& name, const std::string& scope);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_MEMORY_PLANNER_H_
