#include "grappler/plan/order_guard.h"

#include <algorithm>

#include "grappler/plan/memory_planner.h"
#include "grappler/plan/pin_order.h"
#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {
namespace {

constexpr InlineChoice kChoices[] = {InlineChoice::kNearestUpdate, InlineChoice::kFirstInGraph,
                                     InlineChoice::kLastInGraph};

// Calls fn(p) for each node that node `n` waits for: the producers of its inputs, then
// its control inputs.
template <typename Fn>
void ForEachFanin(const TensorTable& table, int n, Fn fn) {
  for (int t : table.nodes[n].inputs) fn(table.tensors[t].node);
  for (int c : table.nodes[n].control_inputs) fn(c);
}

// Per node, whether TF's executor may run it at the very start of the step with
// several inter-op threads: it is not under control flow, and every node it waits
// for (data or control) runs at the start too and is inexpensive (an _Arg, a
// variable read, a constant). The executor hands such a node to the inter-op pool
// as soon as its inputs are there, whatever the emulated single thread does; an
// optimizer term that needs no gradient (SGD's `m * momentum`, RMSprop's
// `rho * velocity`: a weight-sized product each) then holds its output from the
// first kernel to the end of the backward pass.
std::vector<bool> RunsAtStart(const TensorTable& table, const ControlFlowInfo& flow,
                              const std::vector<int>& order) {
  const int num_nodes = static_cast<int>(table.nodes.size());
  std::vector<bool> at_start(num_nodes, false), seen(num_nodes, false);
  for (int n : order) {
    seen[n] = true;
    bool early = !flow.Under(n) && !tensorflow::grappler::IsControlFlow(*table.nodes[n].def);
    auto wait_for = [&](int p) {
      if (p < 0 || !seen[p] || !at_start[p] || IsExpensiveKernel(table, p)) early = false;
    };
    ForEachFanin(table, n, wait_for);
    at_start[n] = early;
  }
  return at_start;
}

// `order` with the nodes that run at the start (RunsAtStart) moved to its front, in
// their own order: what the executor runs when its pool takes them first. A
// topological order, since such a node waits only for such nodes.
std::vector<int> EagerStartOrder(const std::vector<int>& order,
                                 const std::vector<bool>& at_start) {
  std::vector<int> eager;
  eager.reserve(order.size());
  for (int n : order) {
    if (at_start[n]) eager.push_back(n);
  }
  for (int n : order) {
    if (!at_start[n]) eager.push_back(n);
  }
  return eager;
}

absl::Status AddPeaks(const TensorTable& table, const std::vector<int>& order,
                      const SimulationOptions& simulation,
                      std::map<std::string, int64_t>* worst) {
  SimulationResult result;
  absl::Status status = Simulate(table, order, simulation, &result);
  if (!status.ok()) return status;
  for (const DeviceTimeline& device : result.devices) {
    int64_t& peak = (*worst)[device.device];
    peak = std::max(peak, PredictedPeak(device));
  }
  return absl::OkStatus();
}

// Per device name, the highest PredictedPeak over the choices' orders (`worst`), and
// the peak of the order in which the nodes that may run at the start do
// (EagerStartOrder of the default choice's order, `eager_start`).
absl::Status WorstPeaks(const TensorTable& table, const ControlFlowInfo& flow,
                        const SimulationOptions& simulation,
                        std::map<std::string, int64_t>* worst,
                        std::map<std::string, int64_t>* eager_start) {
  worst->clear();
  eager_start->clear();
  for (InlineChoice choice : kChoices) {
    std::vector<int> order;
    absl::Status status = ExecutorOrder(table, &order, choice);
    if (!status.ok()) return status;
    status = AddPeaks(table, order, simulation, worst);
    if (!status.ok()) return status;
    if (choice != InlineChoice::kNearestUpdate) continue;
    status = AddPeaks(table, EagerStartOrder(order, RunsAtStart(table, flow, order)),
                      simulation, eager_start);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// Per device, the higher of the two.
std::map<std::string, int64_t> Higher(std::map<std::string, int64_t> a,
                                      const std::map<std::string, int64_t>& b) {
  for (const auto& [device, peak] : b) a[device] = std::max(a[device], peak);
  return a;
}

// A node that may run at the start (RunsAtStart), allocates at least `min_bytes` and
// reads nothing that large (a product of a variable, a random mask from a shape) is
// made to wait for the latest other producer of its first reader in `target`: the
// executor then runs it when that reader is about to, instead of at the start of the
// step, and the emulated order with it. A producer that depends on the node is never
// waited for (the edge would close a cycle).
void DeferStartNodes(TensorTable* table, const ControlFlowInfo& flow,
                     const std::vector<int>& target, int64_t min_bytes, TableEdit* edit,
                     PinnedOrder* pinned) {
  const int num_nodes = static_cast<int>(table->nodes.size());
  const std::vector<bool> at_start = RunsAtStart(*table, flow, target);
  std::vector<int> position(num_nodes, -1);
  for (int i = 0; i < static_cast<int>(target.size()); ++i) position[target[i]] = i;
  std::vector<std::vector<int>> control_out(num_nodes);
  for (int n = 0; n < num_nodes; ++n) {
    for (int c : table->nodes[n].control_inputs) control_out[c].push_back(n);
  }
  std::vector<int> mark(num_nodes, -1);  // mark[m] == n: m depends on n
  for (int n : target) {
    if (!at_start[n] || AllocatedOutputBytes(*table, n) < min_bytes || !MayWait(*table, flow, n)) {
      continue;
    }
    bool reads_large = false;
    ForEachFanin(*table, n,
                 [&](int p) { reads_large |= AllocatedOutputBytes(*table, p) >= min_bytes; });
    if (reads_large) continue;
    int first = -1;
    for (int t : table->nodes[n].outputs) {
      for (int c : table->tensors[t].consumers) {
        if (position[c] >= 0 && (first < 0 || position[c] < position[first])) first = c;
      }
    }
    if (first < 0) continue;
    // What depends on n, by data and control edges.
    std::vector<int> stack = {n};
    mark[n] = n;
    while (!stack.empty()) {
      const int m = stack.back();
      stack.pop_back();
      auto visit = [&](int s) {
        if (mark[s] != n) {
          mark[s] = n;
          stack.push_back(s);
        }
      };
      for (int t : table->nodes[m].outputs) {
        for (int c : table->tensors[t].consumers) visit(c);
      }
      for (int c : control_out[m]) visit(c);
    }
    int wait_for = -1;
    ForEachFanin(*table, first, [&](int p) {
      if (p == n || mark[p] == n || at_start[p] || position[p] <= position[n] ||
          !MayBeWaitedFor(*table, flow, p)) {
        return;
      }
      if (wait_for < 0 || position[p] > position[wait_for]) wait_for = p;
    });
    if (wait_for < 0) continue;
    edit->SaveControlInputs(*table, n);
    table->nodes[n].control_inputs.push_back(wait_for);
    control_out[wait_for].push_back(n);
    pinned->edges.push_back({wait_for, n});
  }
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
    ForEachFanin(*table, s, consider);
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
  std::map<std::string, int64_t> choices_before, eager_before;
  absl::Status status =
      WorstPeaks(*table, flow, options.simulation, &choices_before, &eager_before);
  if (!status.ok()) return status;
  result->worst_peak_before_bytes = choices_before;
  result->worst_peak_after_bytes = choices_before;
  result->eager_start_peak_before_bytes = eager_before;
  result->eager_start_peak_after_bytes = eager_before;
  const bool choices_decide = OrderDecidesPeak(choices_before, planned, options.budget_bytes,
                                               options.pin_only_over_budget);
  const bool eager_decides = OrderDecidesPeak(eager_before, planned, options.budget_bytes,
                                              options.pin_only_over_budget);
  if (!choices_decide && !eager_decides) return absl::OkStatus();
  // Nodes that may run at the start wait for their readers' other inputs; the order
  // that makes is the target, if it raises no device's peak.
  TableEdit deferral;
  deferral.Begin(*table);
  PinnedOrder deferred;
  DeferStartNodes(table, flow, order, options.defer_min_bytes, &deferral, &deferred);
  std::vector<int> target = order;
  if (!deferred.edges.empty()) {
    std::vector<int> later;
    std::map<std::string, int64_t> later_peaks;
    status = ExecutorOrder(*table, &later, InlineChoice::kNearestUpdate);
    if (status.ok()) status = AddPeaks(*table, later, options.simulation, &later_peaks);
    if (!status.ok()) return status;
    bool raises = false;
    for (const DeviceTimeline& was : planned.devices) {
      auto peak = later_peaks.find(was.device);
      raises |= peak != later_peaks.end() && peak->second > PredictedPeak(was);
    }
    if (raises) {
      deferral.Undo(table);
      deferred.edges.clear();
    } else {
      target = std::move(later);
    }
  }
  if (!choices_decide && deferred.edges.empty()) return absl::OkStatus();
  // Pinning may stop incomplete; its edges are kept only if they lower some device's
  // worst peak, so `edit` records them to take back.
  TableEdit edit;
  edit.Begin(*table);
  PinnedOrder ready_sets, pinned;
  WaitForPredecessors(table, flow, target, &edit, &ready_sets);
  std::vector<int> pinned_order;
  const std::vector<InlineChoice> choices(std::begin(kChoices), std::end(kChoices));
  status = PinOrder(table, flow, target, options.max_edges, &edit, &pinned, &pinned_order,
                    choices);
  if (!status.ok()) return status;
  pinned.edges.insert(pinned.edges.begin(), ready_sets.edges.begin(), ready_sets.edges.end());
  pinned.edges.insert(pinned.edges.begin(), deferred.edges.begin(), deferred.edges.end());
  std::map<std::string, int64_t> choices_after, eager_after;
  status = WorstPeaks(*table, flow, options.simulation, &choices_after, &eager_after);
  if (!status.ok()) return status;
  result->complete = pinned.complete;
  if (!pinned.complete && !Lowers(Higher(choices_after, eager_after),
                                  Higher(choices_before, eager_before))) {
    edit.Undo(table);
    deferral.Undo(table);
    return absl::OkStatus();
  }
  result->worst_peak_after_bytes = choices_after;
  result->eager_start_peak_after_bytes = eager_after;
  result->deferred = static_cast<int>(deferred.edges.size());
  result->edges = PinnedEdgeNames(*table, pinned);
  return absl::OkStatus();
}

}  // namespace tfmemopt
