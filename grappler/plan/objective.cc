#include "grappler/plan/objective.h"

#include <algorithm>
#include <climits>

#include "grappler/plan/memory_planner.h"
#include "grappler/simulate/bfc_allocator_model.h"

namespace tfmemopt {

int64_t RefusalDeficit(const DeviceTimeline& t) {
  if (t.allocator_refused_bytes <= 0) return 0;
  const int64_t offered = std::max(t.allocator_largest_free_bytes, t.allocator_unallocated_bytes);
  return std::max<int64_t>(
      1, BfcAllocatorModel::RoundedBytes(t.allocator_refused_bytes) - offered);
}

Objective Judge(const SimulationResult& simulation, const std::vector<int64_t>& budget) {
  Objective out;
  int64_t excess = INT64_MIN;
  for (size_t d = 0; d < simulation.devices.size() && d < budget.size(); ++d) {
    if (budget[d] <= 0) continue;
    const DeviceTimeline& t = simulation.devices[d];
    const int64_t over = PredictedPeak(t) - budget[d];
    const int64_t deficit = RefusalDeficit(t);
    const int64_t judged = deficit > 0 ? std::max<int64_t>(over, 0) + deficit : over;
    if (judged > excess) {
      excess = judged;
      out.worst_device = static_cast<int>(d);
      out.focus = over <= 0 && deficit > 0 ? Focus::kRefusal
                  : t.allocator_peak_bytes > t.peak_bytes ? Focus::kAllocatorPeak
                                                          : Focus::kLivePeak;
    }
    const double steps = static_cast<double>(t.activation_bytes.size());
    for (size_t s = 0; s < t.activation_bytes.size(); ++s) {
      const int64_t live = t.persistent_bytes + t.activation_bytes[s] + t.gradient_bytes[s];
      if (live > budget[d]) out.overshoot += static_cast<double>(live - budget[d]);
    }
    if (over > 0) out.overshoot += static_cast<double>(over) * steps;
    out.overshoot += static_cast<double>(deficit) * steps;
  }
  out.excess = out.worst_device < 0 ? 0 : excess;
  return out;
}

Target TargetOf(const Objective& objective, const SimulationResult& simulation) {
  Target target;
  if (objective.worst_device < 0) return target;
  const DeviceTimeline& t = simulation.devices[objective.worst_device];
  target.device = objective.worst_device;
  target.step = t.peak_step;
  target.live = &t.live_at_peak;
  if (objective.focus == Focus::kRefusal && t.allocator_refused_step >= 0) {
    target.step = t.allocator_refused_step;
    target.live = &t.live_at_refusal;
    target.refusal = true;
  } else if (objective.focus == Focus::kAllocatorPeak && t.allocator_peak_step >= 0) {
    target.step = t.allocator_peak_step;
    target.live = &t.live_at_allocator_peak;
  }
  return target;
}

bool CloserToFitting(const Objective& next, const Objective& now, bool peak_only) {
  return next.excess < now.excess ||
         (!peak_only && next.excess == now.excess && next.overshoot < now.overshoot);
}

bool BetterPlan(const Objective& a, double a_seconds, const Objective& b, double b_seconds) {
  if (a.fits() != b.fits()) return a.fits();
  if (a.fits()) return a_seconds < b_seconds;
  return CloserToFitting(a, b, /*peak_only=*/false);
}

}  // namespace tfmemopt
