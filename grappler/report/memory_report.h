// Report: what the pass found and did for one graph, as JSON for Python and as one
// log line, plus the process-wide list that tfmemopt.reports() reads.
#ifndef TFMEMOPT_GRAPPLER_REPORT_MEMORY_REPORT_H_
#define TFMEMOPT_GRAPPLER_REPORT_MEMORY_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "grappler/analyze/arrival_order_sums.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/memory_optimizer_options.h"
#include "grappler/simulate/liveness_simulator.h"

namespace tfmemopt {

struct PeakTensor {
  std::string name;
  std::string op;
  std::string role;
  int64_t bytes = 0;
};

struct DeviceReport {
  std::string device;
  int64_t memory_bytes = 0;  // as the Grappler cluster reports it (0 = unknown)
  std::string memory_source;  // "cluster", "TF_CPU_BFC_MEM_LIMIT_IN_MB", "none"
  // How many of the graph's devices share this device's allocator (logical CPUs on
  // one BFC pool); memory_bytes is this device's share.
  int memory_shared_by = 1;
  int64_t budget_bytes = 0;   // 0 = no budget known
  int64_t persistent_bytes = 0;
  // Predicted peak: as the device's allocator counts it (BFC chunks) where that is
  // modelled, else the sum of live tensors.
  int64_t peak_before_bytes = 0;
  int64_t peak_after_bytes = 0;
  int64_t live_peak_bytes = 0;  // sum of live tensors at the peak step (after)
  std::string allocator = "none";  // "bfc" when the allocator model applies
  int peak_step = -1;
  std::vector<PeakTensor> top_tensors_at_peak;  // 10 largest
  // Peak the planner's own simulation predicts for its plan (allocator peak where
  // modelled); when the budget cannot be met, the smallest peak it found.
  int64_t planned_peak_bytes = 0;
  // The largest working set of one op in the original graph: its distinct input and
  // output buffers plus its scratch memory. No plan that keeps ops whole can go
  // below persistent_bytes plus this.
  int64_t max_op_working_set_bytes = 0;
  std::string max_op_working_set_op;
  // The first allocation BFC's model could not place in the plan's simulation (0
  // bytes: none): TF would run out of memory there even below the limit.
  int64_t allocator_refused_bytes = 0;
  std::string allocator_refused;
  // The same for the original graph: with a refusal, TF would run out of memory
  // without a plan, and peak_before_bytes is only how far the model got (it
  // stops at the device's memory), not what the step needs.
  int64_t allocator_refused_before_bytes = 0;
  // The allocator histories replayed before the step (ResidentHistory in
  // simulate/liveness_simulator.h), each with its peak (0: it refused), and the
  // worst, which the allocator figures above describe.
  std::vector<std::pair<std::string, int64_t>> allocator_history_peaks;
  std::string allocator_history;
  // The pool the pass read off the device's live allocator (analyze/allocator_state.h;
  // empty: not read) and the bytes its chunks held then.
  std::vector<PoolChunk> observed_pool;
  int64_t observed_pool_bytes = 0;
  // What the device's allocator held when the graph was planned that is not the
  // graph's persistent buffers or inputs: memory the step cannot use, taken from
  // budget_bytes when count_memory_held_outside applies (else 0).
  int64_t held_outside_bytes = 0;
  // A BFC region the pool holds before the step (allocator_region_bytes, at most the
  // device's memory), which the allocator model starts from; 0: the pool grows in
  // regions of 2 MiB, 4 MiB, ... (docs/allocator.md).
  int64_t allocator_region_bytes = 0;
};

// Fills DeviceReport::max_op_working_set_* for `device` from `table`.
void FillOpWorkingSet(const TensorTable& table, DeviceReport* device);

// What recomputation did to a graph.
struct RecomputeReport {
  bool planned = false;  // the planner ran
  std::string policy;
  std::vector<std::string> nodes;  // recomputed ops (original names), in order
  int num_triggers = 0;
  double added_seconds = 0;     // predicted compute of the clones
  double step_seconds = 0;      // predicted compute of the whole step, before
  bool feasible = true;
  int simulations = 0;
  // AUTO: "exact" (the cheapest recompute-only plan that fits, or none cheaper
  // than the greedy plan fits) or "greedy"; see MemoryPlan::search.
  std::string search;
  int exact_candidates = -1;  // candidates of the exact search; -1: not run
  std::vector<std::string> checkpoints;  // SQRT
  std::map<std::string, int> left_alone;  // forward ops never recomputed, by reason
  std::vector<std::string> hinted_but_not_recomputable;
  std::string note;  // e.g. why a SQRT or MANUAL plan was not applied
};

// What swapping did to a graph.
struct SwapReport {
  bool planned = false;  // the planner could swap
  bool feasible = true;
  std::vector<std::string> tensors;  // swapped tensors, in order
  int num_swap_out = 0;
  int num_swap_in = 0;
  int64_t bytes_to_host = 0;
  int64_t host_peak_bytes = 0;  // host bytes held at once, predicted
  double copy_seconds = 0;      // predicted copy time, both directions
};

// A TensorList a loop fills (analyze/loops.h) and what the plan did with it.
struct LoopListReport {
  std::string list;  // the Enter that starts the instance
  std::string item;  // the tensor each iteration pushes
  int64_t capacity = -1;  // elements; -1 unknown
  std::string capacity_source;
  int64_t bytes = 0;     // device bytes it holds at its fullest, unswapped
  bool swapped = false;  // moved to host memory as it is filled
  double copy_seconds = 0;  // predicted copy time per step (both directions), if swapped
  // Why it was not swapped: a LoopSwapBlocker reason, "not_needed" (the plan
  // met the budget without it) or "swap_disabled"; "" if swapped.
  std::string left_alone;
};

// One while-loop of the graph.
struct LoopReport {
  std::string frame;
  bool backward = false;  // a gradient loop
  int64_t trip_count = -1;
  std::string trip_count_source;  // "condition", "assume_trip_count" or ""
  int parallel_iterations = 1;
  std::vector<LoopListReport> lists;
  // Why nothing of the loop was moved ("" if something was): "gradient_loop" (it
  // pops what another loop filled), "fills_no_list", else the distinct reasons of
  // its lists that hold data, comma-separated.
  std::string left_alone;
};

// What the scheduling stage did to a graph (before any swap or recompute).
struct ScheduleReport {
  bool planned = false;  // the stage ran
  // Added control edges, as (waited for, waiting) node names.
  std::vector<std::pair<std::string, std::string>> edges;
  // Per device: predicted peak of the original order and of the scheduled one.
  std::map<std::string, int64_t> peak_before_bytes, peak_after_bytes;
  // Per device: the peak of the backward pass's own bytes, before and after.
  std::map<std::string, int64_t> backward_peak_before_bytes, backward_peak_after_bytes;
  int simulations = 0;
};

// What splitting per-sample work along the batch did to a graph.
struct SplitReport {
  bool planned = false;  // the split planner ran (nothing else met the budget)
  bool applied = false;
  int64_t batch = 0;     // the static batch size found
  int slices = 0;        // k
  std::vector<int64_t> rows;  // rows per slice
  int stages = 0;        // parts run one slice after another (see rewrite/split_pass.h)
  std::vector<std::string> ops;            // the split ops (original names)
  std::map<std::string, int> op_types;     // op type -> how many were split
  int cuts = 0, joins = 0, sums = 0, shape_constants = 0, added_nodes = 0;
  double added_seconds = 0;  // predicted
  // The split passes through gradients of batch statistics (no other split fit).
  bool through_batch_statistics = false;
  std::map<std::string, int> left_alone;  // per-sample candidates not split, by reason
  struct Trial {
    int slices = 0;
    int region_ops = 0;
    std::vector<int64_t> peak_bytes;  // per device
    bool fits = false;
    double added_seconds = 0;
    bool through_batch_statistics = false;
  };
  std::vector<Trial> trials;  // what the planner simulated, in order
  std::string note;
};

// How the planner chose among the plans it found (AUTO with both mechanisms: the
// joint search and each mechanism searched alone; the best is kept).
struct PlanChoiceReport {
  struct Candidate {
    std::string name;  // "joint", "swap_only", "recompute_only"
    bool fits = false;
    double added_seconds = 0;
    int recomputed = 0;  // forward nodes cloned
    int swapped = 0;     // tensors swapped
    std::map<std::string, int64_t> peak_bytes;  // per device, predicted
    int simulations = 0;  // plans its search simulated
  };
  std::vector<Candidate> candidates;
  std::string chosen;  // a candidate's name, or "exact" (the exact search's plan)
  // Control edges (waited for, waiting) that pin TF's executor to the order the
  // plan was simulated in (each clone right before its reader; plan/pin_order.h).
  std::vector<std::pair<std::string, std::string>> order_edges;
  // Allocator refusals steered around (plan/steer.cc): windows of neighbouring BFC
  // chunks the searches freed, and the tensors the applied plan takes for them.
  int allocator_windows = 0;
  std::vector<std::string> freed_for_allocator;
};

// What the order guard (plan/order_guard.h) found and did.
struct OrderGuardReport {
  bool checked = false;
  // Per device: the highest peak over the executor's inline choices, before and
  // after pinning.
  std::map<std::string, int64_t> worst_peak_before_bytes, worst_peak_after_bytes;
  // Per device: the peak when the nodes that may run at the start of the step do
  // (plan/order_guard.h), before and after the guard.
  std::map<std::string, int64_t> eager_start_peak_before_bytes, eager_start_peak_after_bytes;
  std::vector<std::pair<std::string, std::string>> edges;  // (waited for, waiting)
  // Of `edges`, those that make a node that may run at the start wait for its
  // reader's other input.
  int deferred = 0;
  bool complete = true;
  // The graph needed no plan: the edges are all the pass added (its simulated
  // order met the budget, another order TF's executor may pick did not).
  bool unplanned = false;
};

// What the merge stage did to keep the pairs TF's oneDNN layout pass merges
// (rewrite/onednn_merge_guard.h).
struct MergeGuardReport {
  // False when the merges were given up because the plan fits its budget only with
  // the order edges that break them (the output is then the unguarded one).
  bool kept = true;
  int pairs = 0;
  int edges_shared = 0, edges_removed = 0, edges_moved = 0;
  int partner_edges = 0;  // rivals made to wait for a BiasAddGrad's merge partner
  // Edges moved or taken back so that no merged pair has a path between its nodes
  // (rewrite/onednn_merge_guard.h: BreakMergeCycles).
  int cycle_edges = 0;
  std::vector<std::string> unmerged;
};

// What the pace stage did to a loop's running sums (rewrite/loop_pacing.h).
struct LoopPacingReport {
  int values = 0;  // carried values that some producer now waits for
  std::vector<std::pair<std::string, std::string>> edges;  // (waited for, waiting)
  // Paced although nothing was planned: the graph fits its budget as predicted, but
  // its loops' running ahead could take it over (the pace stage in
  // tfmemopt_optimizer.cc).
  bool unplanned = false;
};

struct MemoryReport {
  std::string graph_id;
  std::string status = "ok";  // "ok" | "fallback"
  std::string failed_stage;   // set when status == "fallback"
  std::string message;
  MemoryOptimizerOptions options;
  int num_nodes = 0;
  // Nodes no fetch needs (the executor prunes them): not planned, returned as they are.
  int never_run_nodes = 0;
  int num_tensors = 0;
  // Tensors of unknown size: dense ones with unknown dimensions (counted as 1
  // each), and variants (TensorLists, optionals) whose contents shape inference
  // does not give (counted as empty); assume_batch_size can help only the first.
  int unresolved_tensors = 0;
  int unresolved_variants = 0;
  std::vector<std::string> unresolved_examples;  // a few names, for the user
  int64_t batch_dims_resolved = 0;
  // Dimensions shape inference left unknown that are not the inputs' batch, taken
  // as assume_batch_size.
  int64_t batch_dims_assumed = 0;
  bool graph_changed = false;
  // The min_tensor_bytes threshold of the applied plan (the adaptive default may
  // lower it when the budget needs smaller tensors); -1: nothing was planned.
  int64_t min_tensor_bytes = -1;
  std::vector<DeviceReport> devices;
  RecomputeReport recompute;
  SwapReport swap;
  ScheduleReport schedule;
  SplitReport split;
  PlanChoiceReport plan_choice;
  OrderGuardReport order_guard;
  MergeGuardReport onednn_merges;
  LoopPacingReport loop_pacing;
  std::vector<LoopReport> loops;
  int loop_swap_nodes = 0;  // nodes the loop swap added (swap-outs, swap-ins, triggers)
  // Sums of the graph the pass was given that TF adds up in the order their terms
  // finish (analyze/arrival_order_sums.h): their last bits follow the execution
  // order, with or without the pass.
  std::vector<ArrivalOrderSum> arrival_order_sums;
  // Timelines of the final graph and of the original one: per device, transient
  // bytes per step by role.
  std::vector<DeviceTimeline> timeline;
  std::vector<DeviceTimeline> timeline_before;
  std::map<std::string, double> stage_seconds;
  double total_seconds = 0;

  std::string ToJson() const;
  // The one INFO line per graph.
  std::string Summary() const;
};

std::string FormatBytes(int64_t bytes);

// Process-wide list of reports, newest last. A token names a graph's entry so that
// the meta-optimizer's second iteration over the same graph replaces it.
int64_t PublishReport(int64_t token, const std::string& json);
// The reports from the start-th on (all of them by default).
std::vector<std::string> PublishedReports(int64_t start = 0);
int64_t NumPublishedReports();
void ClearPublishedReports();

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REPORT_MEMORY_REPORT_H_
