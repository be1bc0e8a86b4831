// Plan: a memory-aware execution order, enforced by added control edges.
//
// TF's executor runs independent branches in an order that its scheduling rules
// decide (emulated by ExecutorOrder), not by memory: in the backward pass of a
// ResNet block with a projection shortcut, both branches' BatchNorm gradients are
// live at once. This stage lowers the simulated peak before anything is swapped or
// recomputed, greedily, one control edge at a time:
//  * at the step where the peak is reached, it looks at the largest buffers live
//    there; at the step where the peak of the backward pass's own bytes (what
//    neither swap nor recompute can remove) is reached, at the largest of those
//    (the forward activations kept for the gradient are as large, and would hide
//    them);
//  * a buffer made by an independent branch (its producer is no ancestor of the
//    step's node) is a candidate to delay: its producer, or the first node of its
//    branch, waits for the step's node or for a node that frees a large buffer;
//  * a buffer whose last reader runs later is a candidate to free earlier: the
//    step's node waits for that reader;
//  * every candidate is simulated, and the one that lowers the peak (or, at the
//    same peak, the backward bytes' peak) most, by at least min_gain_bytes (the
//    config's min_tensor_bytes), without raising either, is kept
//    once the allocator model confirms that the predicted peak does not rise.
// Until no candidate helps, or the edge and simulation limits are reached.
//
// Never touched: stateful nodes (their order can carry meaning), nodes under
// control flow (frames), control-flow and structural ops, nodes of different
// devices, and nodes tfmemopt added. An edge never closes a cycle, and never
// changes which inputs of a multi-input AddN it is the last reader of (TF's AddN
// sums into a reusable input first, so that would change the sum's last bits).
#ifndef TFMEMOPT_GRAPPLER_PLAN_SCHEDULE_H_
#define TFMEMOPT_GRAPPLER_PLAN_SCHEDULE_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/simulate/liveness_simulator.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

// Attribute set on every node that got a scheduling edge, so that a later pass
// over our own output recognizes it.
inline constexpr char kScheduledAttr[] = "_tfmemopt_scheduled";

struct ScheduleOptions {
  // The allocator model that checks each kept edge (SimulationFor in the pass).
  SimulationOptions simulation;
  // An edge must lower the peak (or the backward peak) by at least this much.
  int64_t min_gain_bytes = 1 << 20;
  int max_edges = 16;
  // Candidate simulations in all (planning effort).
  int max_simulations = 120;
};

struct Schedule {
  // Control edges to add, as (from, to) node indices: `to` waits for `from`.
  std::vector<std::pair<int, int>> edges;
  // Per device (TensorTable::devices order): predicted peak (PredictedPeak) of
  // the original and of the scheduled order.
  std::vector<int64_t> peak_before, peak_after;
  // Per device: the peak of the backward pass's own bytes (what neither swap nor
  // recompute removes), in the original order and in the scheduled one.
  std::vector<int64_t> backward_peak_before, backward_peak_after;
  int simulations = 0;
  // The executor order with the edges, and its full simulation.
  std::vector<int> order;
  SimulationResult simulation;
};

// Finds control edges that lower the simulated peak of the table's graph, run in
// its emulated executor order. `before` is that order's full simulation.
absl::Status PlanSchedule(const TensorTable& table, const ControlFlowInfo& flow,
                          const SimulationResult& before, const ScheduleOptions& options,
                          Schedule* schedule);

// Adds the schedule's edges to `graph`, the GraphDef the table was built from.
absl::Status ApplySchedule(const TensorTable& table, const Schedule& schedule,
                           tensorflow::GraphDef* graph);

// True if `graph` holds nodes scheduled by tfmemopt (our own output).
bool HasScheduledNodes(const tensorflow::GraphDef& graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_SCHEDULE_H_
