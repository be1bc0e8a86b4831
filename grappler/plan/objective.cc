#include "grappler/plan/objective.h"

#include <climits>

#include "grappler/plan/memory_planner.h"

namespace tfmemopt {

Objective Judge(const SimulationResult& simulation, const std::vector<int64_t>& budget) {
  Objective out;
  int64_t excess = INT64_MIN;
  for (size_t d = 0; d < simulation.devices.size() && d < budget.size(); ++d) {
    if (budget[d] <= 0) continue;
    const DeviceTimeline& t = simulation.devices[d];
    const int64_t over = PredictedPeak(t) - budget[d];
    if (over > excess) {
      excess = over;
      out.worst_device = static_cast<int>(d);
    }
    for (size_t s = 0; s < t.activation_bytes.size(); ++s) {
      const int64_t live = t.persistent_bytes + t.activation_bytes[s] + t.gradient_bytes[s];
      if (live > budget[d]) out.overshoot += static_cast<double>(live - budget[d]);
    }
    if (over > 0) out.overshoot += static_cast<double>(over) * t.activation_bytes.size();
  }
  out.excess = out.worst_device < 0 ? 0 : excess;
  return out;
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
