// Plan: what the search over plans (plan/descent.h) minimizes, and how two plans
// are compared: in one place, so that the descent, the exact search and the
// choice among candidate plans (plan/memory_planner.cc) judge plans alike.
//
// A plan fits when on every device with a budget its predicted peak
// (PredictedPeak: the allocator model's chunk-level peak where it ran, else the
// live bytes) is within the budget.
#ifndef TFMEMOPT_GRAPPLER_PLAN_OBJECTIVE_H_
#define TFMEMOPT_GRAPPLER_PLAN_OBJECTIVE_H_

#include <cstdint>
#include <vector>

#include "grappler/simulate/liveness_simulator.h"

namespace tfmemopt {

struct Objective {
  // Worst device's predicted peak above its budget (may be negative: room left),
  // and that device (-1: no device has a budget).
  int64_t excess = 0;
  int worst_device = -1;
  // How far the plan is from fitting: the live bytes above the budget summed over
  // all steps, plus the peak's excess counted once per step. The sum keeps guiding
  // the search when several steps share the peak and a choice lowers only some.
  double overshoot = 0;

  bool fits() const { return excess <= 0; }
};

// Judges a simulation against per-device budgets (0: no budget there).
Objective Judge(const SimulationResult& simulation, const std::vector<int64_t>& budget);

// The descent's step rule: `next` is closer to fitting than `now` (its excess is
// lower; with peak_only false, also an equal excess and a lower overshoot).
bool CloserToFitting(const Objective& next, const Objective& now, bool peak_only);

// Which of two plans to keep: one that fits over one that does not; of two that
// fit, the one that adds less time; of two that do not, the one closer to fitting.
// Ties keep `b`.
bool BetterPlan(const Objective& a, double a_seconds, const Objective& b, double b_seconds);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_OBJECTIVE_H_
