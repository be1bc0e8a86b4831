#include "grappler/plan/order_guard.h"

#include <algorithm>

#include "grappler/plan/memory_planner.h"
#include "grappler/plan/pin_order.h"

namespace tfmemopt {
namespace {

constexpr InlineChoice kChoices[] = {InlineChoice::kNearestUpdate, InlineChoice::kFirstInGraph,
                                     InlineChoice::kLastInGraph};

// Per device name, the highest PredictedPeak over the choices' orders.
absl::Status WorstPeaks(const TensorTable& table, const SimulationOptions& simulation,
                        std::map<std::string, int64_t>* worst) {
  worst->clear();
  for (InlineChoice choice : kChoices) {
    std::vector<int> order;
    absl::Status status = ExecutorOrder(table, &order, choice);
    if (!status.ok()) return status;
    SimulationResult result;
    status = Simulate(table, order, simulation, &result);
    if (!status.ok()) return status;
    for (const DeviceTimeline& device : result.devices) {
      int64_t& peak = (*worst)[device.device];
      peak = std::max(peak, PredictedPeak(device));
    }
  }
  return absl::OkStatus();
}

// Whether the order decides some device's peak: one of the choices peaks above the
// planned order on a device whose budget the planned order meets (a plan that does
// not fit in its own order is the planner's to report). The three choices are a
// sample of the orders TF's executor runs, not their bounds: with several inter-op
// threads, swap-ins and clones that the choices keep in place can run far ahead
// (benchmarks/models.py's wavenet planned to 312 MiB, whose choices peak at 331 MiB
// under a 365 MiB budget, measured 490 and 518 MiB unpinned, 281 and 282 MiB pinned;
// docs/design.md). So a choice above the planned order is reason enough to pin it,
// whether or not it crosses the budget.
bool OrderDecidesPeak(const std::map<std::string, int64_t>& worst,
                      const SimulationResult& planned,
                      const std::map<std::string, int64_t>& budgets, bool only_over_budget) {
  for (const DeviceTimeline& device : planned.devices) {
    auto budget = budgets.find(device.device);
    auto peak = worst.find(device.device);
    if (budget == budgets.end() || budget->second <= 0 || peak == worst.end()) continue;
    const int64_t planned_peak = PredictedPeak(device);
    if (planned_peak > budget->second) continue;
    if (peak->second > (only_over_budget ? budget->second : planned_peak)) return true;
  }
  return false;
}

// Whether some device's worst peak in `after` is below its worst peak in `before`.
bool Lowers(const std::map<std::string, int64_t>& after,
            const std::map<std::string, int64_t>& before) {
  for (const auto& [device, peak] : after) {
    auto it = before.find(device);
    if (it != before.end() && peak < it->second) return true;
  }
  return false;
}

// In `target`, the kernel that finishes last among a node's inputs is the one that
// makes it ready. Where one kernel makes two or more expensive nodes ready at once,
// TF's choice among them is the arbitrary one: every such node but the first (in
// `target`) is made to wait for the node right before it in `target`, so that it
// becomes ready just when the target runs it. One pass in target order, an edge per
// ambiguity; the edges follow `target`, so none closes a cycle. (PinOrder then fixes
// what this leaves, one emulation per edge.) Untimed nodes (constants, IsUntimed in
// plan/pin_order.h) run wherever they become ready, so they neither make a node
// ready here nor are waited for.
void WaitForPredecessors(TensorTable* table, const ControlFlowInfo& flow,
                         const std::vector<int>& target, TableEdit* edit,
                         PinnedOrder* pinned) {
  const int num_nodes = static_cast<int>(table->nodes.size());
  std::vector<int> position(num_nodes, -1);
  for (int i = 0; i < static_cast<int>(target.size()); ++i) position[target[i]] = i;
  // claimed[n]: an expensive node that n's completion makes ready, first in target.
  std::vector<int> claimed(num_nodes, -1);
  for (int i = 0; i < static_cast<int>(target.size()); ++i) {
    const int s = target[i];
    int last = -1;
    auto consider = [&](int p) {
      // Loop back edges (from a node the target runs later) make nothing ready.
      if (p >= 0 && position[p] < i && !IsUntimed(*table->nodes[p].def) &&
          (last < 0 || position[p] > position[last])) {
        last = p;
      }
    };
    for (int t : table->nodes[s].inputs) consider(table->tensors[t].node);
    for (int c : table->nodes[s].control_inputs) consider(c);
    if (last < 0 || !IsExpensiveKernel(*table, s)) continue;
    if (claimed[last] < 0) {
      claimed[last] = s;
      continue;
    }
    int before = -1;
    for (int k = i - 1; k >= 0 && before < 0; --k) {
      if (!IsUntimed(*table->nodes[target[k]].def)) before = target[k];
    }
    if (before < 0 || before == last || !MayWait(*table, flow, s) ||
        !MayBeWaitedFor(*table, flow, before)) {
      continue;
    }
    edit->SaveControlInputs(*table, s);
    table->nodes[s].control_inputs.push_back(before);
    pinned->edges.push_back({before, s});
    claimed[before] = s;
  }
}

}  // namespace

absl::Status GuardOrder(TensorTable* table, const ControlFlowInfo& flow,
                        const std::vector<int>& order, const SimulationResult& planned,
                        const OrderGuardOptions& options, OrderGuardResult* result) {
  *result = OrderGuardResult();
  for (const auto& [device, bytes] : options.budget_bytes) result->checked |= bytes > 0;
  if (!result->checked) return absl::OkStatus();
  absl::Status status = WorstPeaks(*table, options.simulation, &result->worst_peak_before_bytes);
  if (!status.ok()) return status;
  result->worst_peak_after_bytes = result->worst_peak_before_bytes;
  if (!OrderDecidesPeak(result->worst_peak_before_bytes, planned, options.budget_bytes,
                        options.pin_only_over_budget)) {
    return absl::OkStatus();
  }
  // Pinning may stop incomplete; its edges are kept only if they lower some device's
  // worst peak, so `edit` records them to take back.
  TableEdit edit;
  edit.Begin(*table);
  PinnedOrder ready_sets, pinned;
  WaitForPredecessors(table, flow, order, &edit, &ready_sets);
  std::vector<int> pinned_order;
  const std::vector<InlineChoice> choices(std::begin(kChoices), std::end(kChoices));
  status = PinOrder(table, flow, order, options.max_edges, &edit, &pinned, &pinned_order,
                    choices);
  if (!status.ok()) return status;
  pinned.edges.insert(pinned.edges.begin(), ready_sets.edges.begin(), ready_sets.edges.end());
  result->complete = pinned.complete;
  status = WorstPeaks(*table, options.simulation, &result->worst_peak_after_bytes);
  if (!status.ok()) return status;
  if (!pinned.complete &&
      !Lowers(result->worst_peak_after_bytes, result->worst_peak_before_bytes)) {
    edit.Undo(table);
    result->worst_peak_after_bytes = result->worst_peak_before_bytes;
    return absl::OkStatus();
  }
  result->edges = PinnedEdgeNames(*table, pinned);
  return absl::OkStatus();
}

}  // namespace tfmemopt
