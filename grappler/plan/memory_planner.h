// Plan: for every forward tensor the backward pass reads, keep it, recompute it or
// swap it to host memory, so that the simulated peak fits the budget at the lowest
// predicted added time.
//
// The pieces: each mechanism proposes candidates with the bytes they save and the
// time they add, in a file of its own (plan/recompute_choice.h,
// plan/swap_choice.h, plan/loop_swap_choice.h; their common shape is
// plan/mechanism.h); the search over
// plans (the greedy descent and the exact search) is plan/descent.h and knows no
// mechanism; PlanMemory below composes them under the configured policies.
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
//    With swapping enabled too, the same search runs three times: jointly, and with
//    each mechanism alone (as a configuration with the other disabled would run
//    it); the plan that fits at the lowest added time is kept (none fitting: the
//    one closest to fitting), and MemoryPlan::candidate_plans says what each found.
//    A single-mechanism search is given up once its choice adds 1.5 times the time
//    of a fitting plan in hand.
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
// Loops (with enable_swap): the TensorLists a forward loop fills for its gradient
// are the third mechanism's (plan/loop_swap_choice.h), weighed like any other swap.
//
// Never recomputed: stateful nodes (random ops, variable reads and updates, I/O),
// nodes under control flow (loops, cond branches), graph inputs, constants and
// variables, nodes that read or produce resources, variants or strings. Never
// swapped: tensors produced under control flow or by the backward pass (a loop's
// accumulators go as whole lists), and tensors of non-plain types.
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
#include "grappler/plan/loop_swap_choice.h"
#include "grappler/plan/mechanism.h"
#include "grappler/plan/pin_order.h"
#include "grappler/plan/planner_options.h"
#include "grappler/plan/recompute_choice.h"
#include "grappler/plan/swap_choice.h"
#include "grappler/rewrite/lms_swap_optimizer.h"
#include "grappler/rewrite/loop_swap.h"
#include "grappler/rewrite/recompute_pass.h"
#include "grappler/simulate/liveness_simulator.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

// A plan applied: recomputation first, swapping on top of it, then the loops'
// accumulators (each rewrite takes over the previous one's table).
struct PlannedRewrite {
  RecomputeRewrite recompute;
  SwapRewrite swap;
  LoopSwapRewrite loop_swap;
  // Control edges (from, to) that pin the executor to the order simulated
  // (plan/pin_order.h), when the plan was simulated pinned.
  std::vector<std::pair<std::string, std::string>> pin_edges;
  const TensorTable& table() const { return loop_swap.table; }
  const std::vector<int>& order() const { return loop_swap.order; }
};

// Peak of a device as the report states it: the allocator's where modelled (it
// counts whole chunks), never less than the live bytes (past its memory limit the
// allocator model refuses allocations and its own peak stops growing).
int64_t PredictedPeak(const DeviceTimeline& timeline);

// Plans for the table, simulated along `order`. On success `rewrite` and
// `simulation` hold the chosen plan applied and simulated (an empty plan if nothing
// is changed).
absl::Status PlanMemory(const TensorTable& table, const std::vector<int>& order,
                        const ControlFlowInfo& flow, const MemoryPlannerOptions& options,
                        MemoryPlan* plan, PlannedRewrite* rewrite, SimulationResult* simulation);

// Applies a planned rewrite to `graph`, the GraphDef the table was built from.
absl::Status ApplyPlannedRewrite(const PlannedRewrite& rewrite, tensorflow::GraphDef* graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_MEMORY_PLANNER_H_
