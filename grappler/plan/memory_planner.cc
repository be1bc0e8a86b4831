#include "grappler/plan/memory_planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "grappler/plan/descent.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

// The planner's mechanisms, in the order they apply.
enum MechanismIndex { kRecompute = 0, kSwap = 1, kLoopSwap = 2 };

CandidatePlan CandidatePlanOf(const std::string& name, const Evaluated& state) {
  CandidatePlan out;
  out.name = name;
  out.fits = state.excess <= 0;
  out.added_seconds = state.seconds;
  out.recomputed = static_cast<int>(state.choice.items[kRecompute].size());
  out.swapped = static_cast<int>(state.choice.items[kSwap].size());
  for (const DeviceTimeline& timeline : state.simulation.devices) {
    out.peak_bytes.push_back(PredictedPeak(timeline));
  }
  return out;
}

// One greedy search with the mechanisms marked in `proposing`: the descent from
// `fixed`, and, when recomputation proposes and the budget is not met, once more
// from SQRT's segments. The result is simulated with the allocator model where
// there is one.
absl::Status Search(Planner* planner, RecomputeChoice* recompute, const Choice& fixed,
                    const std::vector<bool>& proposing, MemoryPlan* plan, Evaluated* best) {
  absl::Status status = planner->Descend(fixed, {}, proposing, best);
  if (!status.ok()) return status;
  const bool given_up = planner->cost_bound() > 0 && best->seconds > planner->cost_bound();
  if (proposing[kRecompute] && best->excess > 0 && !given_up) {
    // The greedy descent can get stuck where only a coordinated change helps (long
    // chains: dropping one more checkpoint alone lowers nothing). Start again from
    // SQRT's segments, and let the cleanup give back the segments not needed.
    const size_t checkpoints = plan->checkpoints.size();
    std::vector<std::vector<int>> segments;
    recompute->SqrtSegments(&segments);
    plan->checkpoints.resize(checkpoints);  // AUTO reports no SQRT checkpoints
    std::vector<Group> groups;
    for (std::vector<int>& segment : segments) {
      double seconds = 0;
      for (int node : segment) seconds += recompute->ItemSeconds(node);
      groups.push_back(Group{kRecompute, std::move(segment), seconds});
    }
    Evaluated from_sqrt;
    status = planner->Descend(fixed, std::move(groups), proposing, &from_sqrt);
    if (!status.ok()) return status;
    const bool better = from_sqrt.excess <= 0
                            ? (best->excess > 0 || from_sqrt.seconds < best->seconds)
                            : from_sqrt.excess < best->excess;
    if (better) *best = std::move(from_sqrt);
  }
  return planner->UseAllocatorModel(best);
}

}  // namespace

int64_t PredictedPeak(const DeviceTimeline& timeline) {
  return std::max(timeline.allocator_peak_bytes, timeline.peak_bytes);
}

absl::Status PlanMemory(const TensorTable& table, const std::vector<int>& order,
                        const ControlFlowInfo& flow, const MemoryPlannerOptions& options,
                        MemoryPlan* plan, PlannedRewrite* rewrite, SimulationResult* simulation) {
  *plan = MemoryPlan();
  const PlanContext context(table, order, flow, options);
  RecomputeChoice recompute(context, plan);
  SwapChoice swap(context);
  LoopSwapChoice loop_swap(context);
  Planner planner(context, {&recompute, &swap, &loop_swap}, plan);
  Choice fixed = planner.EmptyChoice();
  absl::Status status;
  if (options.enable_recompute && options.policy == RecomputePolicy::kSqrt) {
    std::vector<std::vector<int>> segments;
    recompute.SqrtSegments(&segments);
    for (const std::vector<int>& segment : segments) {
      fixed.items[kRecompute].insert(fixed.items[kRecompute].end(), segment.begin(),
                                     segment.end());
    }
  } else if (options.enable_recompute && options.policy == RecomputePolicy::kManual) {
    recompute.ManualItems(&fixed.items[kRecompute]);
  }
  if (!fixed.items[kRecompute].empty()) {
    // SQRT and MANUAL recompute what they are told; never at a higher peak than no
    // plan at all (then the graph's own schedule is better, and is kept).
    Evaluated none, told;
    status = planner.EvaluateWithAllocator(planner.EmptyChoice(), &none);
    if (status.ok()) status = planner.EvaluateWithAllocator(fixed, &told);
    if (!status.ok()) return status;
    for (size_t d = 0; d < none.simulation.devices.size(); ++d) {
      const int64_t before = PredictedPeak(none.simulation.devices[d]);
      const int64_t after = PredictedPeak(told.simulation.devices[d]);
      if (after > before) {
        plan->note = absl::StrCat(RecomputePolicyName(options.policy), " plan not applied: it ",
                                  "would raise the predicted peak on ",
                                  none.simulation.devices[d].device, " from ", before,
                                  " to ", after, " bytes");
        fixed.items[kRecompute].clear();
        plan->checkpoints.clear();
        break;
      }
    }
  }
  Evaluated best;
  const bool auto_recompute = options.enable_recompute && options.policy == RecomputePolicy::kAuto;
  std::vector<bool> proposing(planner.num_mechanisms(), true);
  proposing[kRecompute] = auto_recompute;
  if (auto_recompute || options.enable_swap) {
    status = Search(&planner, &recompute, fixed, proposing, plan, &best);
    if (!status.ok()) return status;
    if (auto_recompute && options.enable_swap) {
      // The joint search is greedy: the candidates it takes first (by bytes saved
      // per second) can lead it away from what one mechanism alone would reach
      // (e.g. cheap clones that block the swaps that would lower the peak). Each
      // mechanism alone is searched as well, exactly as a configuration with the
      // other one disabled would search it, and the best plan is kept: AUTO is
      // never worse than swap only or recompute only.
      // A search that does not fit judged its plan on the worst allocator history it
      // had met, which differs from search to search: plans that do not fit are
      // compared on every history, the figure the report gives for the one applied.
      if (best.excess > 0) status = planner.OnEveryHistory(&best);
      if (!status.ok()) return status;
      plan->candidate_plans.push_back(CandidatePlanOf("joint", best));
      plan->candidate_plans.back().simulations = plan->simulations;
      int chosen = 0;
      for (int alone : {kSwap, kRecompute}) {
        std::vector<bool> only(planner.num_mechanisms(), false);
        only[alone] = true;
        // Swapping alone includes the loops' accumulators (enable_swap governs both).
        if (alone == kSwap) only[kLoopSwap] = true;
        planner.BeginSearch();
        // A search whose choice already adds 1.5 times the time of a plan in hand
        // that fits is given up: its final cleanup (which gives back what the budget
        // does not need) would have to take a third off to do better.
        planner.set_cost_bound(best.excess <= 0 ? 1.5 * best.seconds : 0);
        const int simulations = plan->simulations;
        Evaluated single;
        status = Search(&planner, &recompute, fixed, only, plan, &single);
        planner.set_cost_bound(0);
        if (status.ok() && single.excess > 0) status = planner.OnEveryHistory(&single);
        if (!status.ok()) return status;
        plan->candidate_plans.push_back(
            CandidatePlanOf(alone == kSwap ? "swap_only" : "recompute_only", single));
        plan->candidate_plans.back().simulations = plan->simulations - simulations;
        if (BetterPlan(single.objective(), single.seconds, best.objective(), best.seconds)) {
          best = std::move(single);
          chosen = static_cast<int>(plan->candidate_plans.size()) - 1;
        }
      }
      plan->chosen_plan = plan->candidate_plans[chosen].name;
    }
    if (auto_recompute) {
      // Small graphs: the exact search, bounded by the greedy plan's cost when that
      // fits, on the allocator model where there is one (the greedy plan's was).
      // Swaps are the greedy descent's alone (the swap mechanism offers the search
      // no items); its plan stands unless a cheaper recompute-only plan fits.
      status = planner.UseAllocatorModel(&best);
      if (!status.ok()) return status;
      Evaluated exact;
      bool complete = false;
      status = planner.ExactSearch(best.excess <= 0 ? best.seconds : INFINITY, &exact,
                                   &complete);
      if (!status.ok()) return status;
      plan->search = complete ? "exact" : "greedy";
      if (exact.excess <= 0) {
        best = std::move(exact);
        if (!plan->chosen_plan.empty()) plan->chosen_plan = "exact";
      }
    }
    if (status.ok() && best.excess > 0 &&
        (!best.choice.items[kRecompute].empty() || !best.choice.items[kSwap].empty() ||
         !best.choice.items[kLoopSwap].empty())) {
      // Out of reach: the best plan is applied only if it lowers some device's
      // peak; added compute or copies for the same peak help nobody.
      Evaluated none;
      status = planner.EvaluateWithAllocator(fixed, &none);
      if (status.ok()) status = planner.OnEveryHistory(&best);
      if (!status.ok()) return status;
      auto lowers = [&none](const Evaluated& plan) {
        bool lower = false;
        for (size_t d = 0; d < none.simulation.devices.size(); ++d) {
          lower = lower || PredictedPeak(plan.simulation.devices[d]) <
                               PredictedPeak(none.simulation.devices[d]);
        }
        return lower;
      };
      if (!lowers(best)) {
        // The descent follows the live bytes above the budget over all steps, and
        // can settle on cheap choices that lower those but not the peak (a clone
        // made at the peak's own step), which then block the ones that lower it.
        // Descend once more taking only choices that lower the peak.
        planner.set_peak_only(true);
        Evaluated lower;
        status = planner.Descend(fixed, {}, proposing, &lower);
        planner.set_peak_only(false);
        if (status.ok()) status = planner.OnEveryHistory(&lower);
        if (!status.ok()) return status;
        if (lowers(lower)) best = std::move(lower);
      }
      if (!lowers(best)) {
        plan->note = fixed.items[kRecompute].empty()
                         ? "no plan lowers the predicted peak (it is set by what cannot be "
                           "recomputed or swapped); the graph is kept as it is"
                         : absl::StrCat("no swap lowers the predicted peak below what the ",
                                        RecomputePolicyName(options.policy),
                                        " plan reaches; that plan is applied as told");
        best = std::move(none);
      }
    }
  } else {
    status = planner.EvaluateWithAllocator(std::move(fixed), &best);
  }
  // A plan that fits was judged on every history; one that does not, on the worst so
  // far alone (and the report's figures are every history's).
  if (status.ok() && best.excess > 0) status = planner.OnEveryHistory(&best);
  if (!status.ok()) return status;
  VLOG(1) << "TfMemOpt plan: " << plan->simulations << " simulations, building rewrites "
          << planner.rewrite_seconds() << " s, simulating " << planner.simulate_seconds()
          << " s";
  const ClonePlacement placement = best.choice.pinned    ? ClonePlacement::kBeforeReader
                                   : best.choice.variant ? ClonePlacement::kEarlier
                                                         : ClonePlacement::kAtReaderInput;
  status = BuildRecomputeRewrite(table, order, flow, best.choice.items[kRecompute],
                                 &rewrite->recompute, placement,
                                 best.choice.pinned ? best.choice.clone_readers_from : -1);
  if (!status.ok()) return status;
  status = BuildSwapRewrite(std::move(rewrite->recompute.table), rewrite->recompute.order, flow,
                            best.choice.items[kSwap], swap.options(), &rewrite->swap);
  if (!status.ok()) return status;
  status = BuildLoopSwapRewrite(std::move(rewrite->swap.table), rewrite->swap.order,
                                best.choice.items[kLoopSwap], loop_swap.bandwidth(),
                                &rewrite->loop_swap);
  if (!status.ok()) return status;
  rewrite->pin_edges.clear();
  if (best.choice.pinned) {
    // The same edges the planner simulated (Planner::Apply pins the same target).
    PinnedOrder pinned;
    std::vector<int> pinned_order;
    const int added =
        static_cast<int>(rewrite->loop_swap.table.nodes.size() - table.nodes.size());
    status = PinOrder(&rewrite->loop_swap.table, flow, rewrite->loop_swap.order,
                      PinEdgeLimit(added), nullptr, &pinned, &pinned_order);
    if (!status.ok()) return status;
    rewrite->pin_edges = PinnedEdgeNames(rewrite->loop_swap.table, pinned);
  }
  plan->recompute_nodes = rewrite->recompute.cloned;
  plan->swap_tensors = rewrite->swap.swapped;
  plan->loop_swap_lists = rewrite->loop_swap.swapped;
  {
    // The buffers taken to free a chunk at a refusal that the applied plan keeps.
    std::vector<bool> taken(table.buffers.size(), false);
    for (int t : plan->swap_tensors) taken[table.tensors[t].buffer] = true;
    for (int r : plan->recompute_nodes) {
      for (int t : table.nodes[r].outputs) taken[table.tensors[t].buffer] = true;
    }
    std::sort(plan->steered_buffers.begin(), plan->steered_buffers.end());
    plan->steered_buffers.erase(
        std::unique(plan->steered_buffers.begin(), plan->steered_buffers.end()),
        plan->steered_buffers.end());
    for (int b : plan->steered_buffers) {
      if (taken[b]) plan->steered_tensors.push_back(table.TensorName(table.buffers[b].owner));
    }
  }
  plan->feasible = best.excess <= 0;
  plan->added_seconds = best.seconds;
  for (const DeviceTimeline& timeline : best.simulation.devices) {
    plan->peak_bytes.push_back(PredictedPeak(timeline));
  }
  *simulation = std::move(best.simulation);
  return absl::OkStatus();
}

absl::Status ApplyPlannedRewrite(const PlannedRewrite& rewrite, tensorflow::GraphDef* graph) {
  absl::Status status = ApplyRecomputeRewrite(rewrite.recompute, graph);
  if (!status.ok()) return status;
  status = ApplySwapRewrite(rewrite.swap, graph);
  if (!status.ok()) return status;
  status = ApplyLoopSwapRewrite(rewrite.loop_swap, graph);
  if (!status.ok()) return status;
  return ApplyPinnedEdges(rewrite.pin_edges, graph);
}

}  // namespace tfmemopt
