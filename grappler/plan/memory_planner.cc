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
    status = planner.Descend(fixed, {}, proposing, &best);
    if (!status.ok()) return status;
    if (auto_recompute && best.excess > 0) {
      // The greedy descent can get stuck where only a coordinated change helps (long
      // chains: dropping one more checkpoint alone lowers nothing). Start again from
      // SQRT's segments, and let the cleanup give back the segments not needed.
      const size_t checkpoints = plan->checkpoints.size();
      std::vector<std::vector<int>> segments;
      recompute.SqrtSegments(&segments);
      plan->checkpoints.resize(checkpoints);  // AUTO reports no SQRT checkpoints
      std::vector<Group> groups;
      for (std::vector<int>& segment : segments) {
        double seconds = 0;
        for (int node : segment) seconds += recompute.ItemSeconds(node);
        groups.push_back(Group{kRecompute, std::move(segment), seconds});
      }
      Evaluated from_sqrt;
      status = planner.Descend(fixed, std::move(groups), proposing, &from_sqrt);
      if (!status.ok()) return status;
      const bool better = from_sqrt.excess <= 0
                              ? (best.excess > 0 || from_sqrt.seconds < best.seconds)
                              : from_sqrt.excess < best.excess;
      if (better) best = std::move(from_sqrt);
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
      if (exact.excess <= 0) best = std::move(exact);
    }
    if (status.ok() && best.excess > 0 &&
        (!best.choice.items[kRecompute].empty() || !best.choice.items[kSwap].empty() ||
         !best.choice.items[kLoopSwap].empty())) {
      // Out of reach: the best plan is applied only if it lowers some device's
      // peak; added compute or copies for the same peak help nobody.
      Evaluated none;
      status = planner.EvaluateWithAllocator(fixed, &none);
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
  if (!status.ok()) return status;
  VLOG(1) << "TfMemOpt plan: " << plan->simulations << " simulations, building rewrites "
          << planner.rewrite_seconds() << " s, simulating " << planner.simulate_seconds()
          << " s";
  status = BuildRecomputeRewrite(table, order, flow, best.choice.items[kRecompute],
                                 &rewrite->recompute, best.choice.variant);
  if (!status.ok()) return status;
  status = BuildSwapRewrite(std::move(rewrite->recompute.table), rewrite->recompute.order, flow,
                            best.choice.items[kSwap], swap.options(), &rewrite->swap);
  if (!status.ok()) return status;
  status = BuildLoopSwapRewrite(std::move(rewrite->swap.table), rewrite->swap.order,
                                best.choice.items[kLoopSwap], loop_swap.bandwidth(),
                                &rewrite->loop_swap);
  if (!status.ok()) return status;
  plan->recompute_nodes = rewrite->recompute.cloned;
  plan->swap_tensors = rewrite->swap.swapped;
  plan->loop_swap_lists = rewrite->loop_swap.swapped;
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
  return ApplyLoopSwapRewrite(rewrite.loop_swap, graph);
}

}  // namespace tfmemopt
