// Plan: a plan's peak must not hang on a guess about TF's executor.
//
// When a kernel finishes and makes several expensive kernels ready at once, TF's
// executor runs one of them inline and queues the others; which one depends on the
// order of the kernel's out edges, which the graph does not fix (InlineChoice,
// simulate/liveness_simulator.h). The planner simulates one choice. A plan whose
// peak is low in that order can be much higher in another: a split's slices, a
// clone's reader, a weight gradient run before or after the data gradient of the
// same layer. The guard simulates the rewritten graph under every choice; when one
// of them peaks above the planned order (on a device whose budget the planned order
// meets; the choices are a sample of what the executor does, not a bound, so the
// budget is not the threshold), it pins the planned order with control edges
// (PinOrder over every choice, plan/pin_order.h), so that whichever successor TF
// takes, the order run is the one planned. What it cannot pin (nodes under control
// flow, the edge limit) it reports, and the plan's peak is then the worst choice's;
// edges of an incomplete pinning that lower no device's worst peak are taken back.
//
// A graph that needs no plan (its simulated order meets the budget) is guarded too,
// more narrowly: it is pinned only where a choice peaks above the budget, so that a
// graph that fits in every sampled order is left exactly as the user wrote it. On
// benchmarks/models.py's text_cnn, whose peak in TF's own order moves from 103 to
// 153 MiB from process to process (inter-op threads or not), the choices peak at
// 127.5, 127.3 and 134.5 MiB; under a 130 MiB budget 7 edges pin it, and it then
// measured 110.7 and 110.9 MiB in two processes
// (docs/design.md#order-grapplerplanorder_guardcc).
//
// One more order is sampled: the eager start. With several inter-op threads, TF's
// executor runs every node whose inputs are arguments, variable reads and constants
// as soon as the step starts (the emulation, one thread, runs it where its reader
// needs it). An optimizer term that needs no gradient is such a node: SGD's
// `m * momentum` (tf_keras's SGD computes it even with momentum 0), RMSprop's
// `rho * velocity`, a weight-sized product each, held from the first kernel to the
// end of the backward pass. When the guard pins, it first makes each such node that
// allocates at least OrderGuardOptions::defer_min_bytes wait for the latest other
// input of its first reader, and takes that order as the target if its peak is no
// higher. A 24-layer MLP with momentum (tests/test_order_guard.py) measured 25.5-27
// MiB of its own so, against 32-34 MiB as TF builds it, bit for bit the same.
#ifndef TFMEMOPT_GRAPPLER_PLAN_ORDER_GUARD_H_
#define TFMEMOPT_GRAPPLER_PLAN_ORDER_GUARD_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/simulate/liveness_simulator.h"

namespace tfmemopt {

struct OrderGuardOptions {
  SimulationOptions simulation;  // for the table's devices
  // Budget per device name; devices without one (or 0) are not checked.
  std::map<std::string, int64_t> budget_bytes;
  // Most control edges the guard adds; each costs a few emulations of the graph.
  int max_edges = 256;
  // Pin only where some choice peaks above a device's budget (for a graph the plan
  // leaves as it is, which every order below its budget fits); otherwise wherever a
  // choice peaks above the planned order.
  bool pin_only_over_budget = false;
  // A node that TF's executor may run at the start of the step (its inputs are
  // arguments, variable reads and constants) but that the planned order runs later
  // is made to wait for the node before it there when it allocates at least this
  // many bytes (smaller ones move too few bytes to be worth an edge).
  int64_t defer_min_bytes = 64 << 10;
};

struct OrderGuardResult {
  bool checked = false;  // some device had a budget
  // Per device name: the highest predicted peak over the inline choices, before
  // and after pinning (after == the planned order's peak when `complete`).
  std::map<std::string, int64_t> worst_peak_before_bytes, worst_peak_after_bytes;
  // Per device name: the peak when every node that may run at the start of the step
  // does (what TF's executor does with several inter-op threads), before and after.
  std::map<std::string, int64_t> eager_start_peak_before_bytes, eager_start_peak_after_bytes;
  // Added control edges, as (waited for, waiting) node names.
  std::vector<std::pair<std::string, std::string>> edges;
  // How many of `edges` defer a node that may run at the start (they come first).
  int deferred = 0;
  // Every choice runs the planned order (or none had to be pinned).
  bool complete = true;
};

// Checks `table` (a rewritten graph, its executor order `order` and `planned`, the
// simulation of that order) under every InlineChoice; pins where a choice exceeds a
// budget that the planned order meets. The edges are added to `table`'s control
// inputs and listed in `result` (to add to the GraphDef, ApplyPinnedEdges).
absl::Status GuardOrder(TensorTable* table, const ControlFlowInfo& flow,
                        const std::vector<int>& order, const SimulationResult& planned,
                        const OrderGuardOptions& options, OrderGuardResult* result);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_ORDER_GUARD_H_
