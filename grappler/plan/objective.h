// Plan: what the search over plans (plan/descent.h) minimizes, and how two plans
// are compared: in one place, so that the descent, the exact search and the
// choice among candidate plans (plan/memory_planner.cc) judge plans alike.
//
// A plan fits when on every device with a budget its predicted peak
// (PredictedPeak: the allocator model's chunk-level peak where it ran, else the
// live bytes) is within the budget, and the allocator model (where it ran) placed
// every allocation. TF's BFC allocator can run out of memory below its limit: a
// tensor must fit in one free chunk of one region (regions start at 2 MiB, double,
// and are never merged), so a plan whose peak fits can still fail. A refusal counts
// as the bytes missing from the largest chunk BFC could have offered (the largest
// free chunk, or what it could still add as a region) on top of any excess of the
// peak, so that the search keeps going until the allocator places everything, and
// is guided by how close it gets.
//
// Where the search looks for what to take off the device (Target) follows what is
// wrong: the live peak's step, the allocator peak's step (chunk-level bytes, which
// count the unsplit rest of a chunk, can peak elsewhere), or the refusal's.
#ifndef TFMEMOPT_GRAPPLER_PLAN_OBJECTIVE_H_
#define TFMEMOPT_GRAPPLER_PLAN_OBJECTIVE_H_

#include <cstdint>
#include <vector>

#include "grappler/simulate/liveness_simulator.h"

namespace tfmemopt {

// What keeps the worst device from fitting.
enum class Focus {
  kLivePeak,       // the live bytes' peak is over the budget (or nothing is wrong)
  kAllocatorPeak,  // the allocator's chunk-level peak is, and is the higher
  kRefusal,        // the peak fits, but the allocator model refused an allocation
};

struct Objective {
  // Worst device's predicted peak above its budget (may be negative: room left),
  // plus its refusal's missing bytes, and that device (-1: no device has a budget).
  int64_t excess = 0;
  int worst_device = -1;
  Focus focus = Focus::kLivePeak;
  // How far the plan is from fitting: the live bytes above the budget summed over
  // all steps, plus the peak's excess counted once per step. The sum keeps guiding
  // the search when several steps share the peak and a choice lowers only some.
  double overshoot = 0;

  bool fits() const { return excess <= 0; }
};

// Judges a simulation against per-device budgets (0: no budget there).
Objective Judge(const SimulationResult& simulation, const std::vector<int64_t>& budget);

// Bytes missing at a device's first refusal (0: none): the request, rounded as BFC
// rounds it, less the largest chunk BFC could have offered.
int64_t RefusalDeficit(const DeviceTimeline& timeline);

// Where to look for what to take off the device: a step of the simulated order,
// the buffers live there, and whether it is a refusal's.
struct Target {
  int device = -1;
  int step = -1;
  const std::vector<int>* live = nullptr;
  bool refusal = false;
};
Target TargetOf(const Objective& objective, const SimulationResult& simulation);

// The descent's step rule: `next` is closer to fitting than `now` (its excess is
// lower; with peak_only false, also an equal excess and a lower overshoot).
bool CloserToFitting(const Objective& next, const Objective& now, bool peak_only);

// Which of two plans to keep: one that fits over one that does not; of two that
// fit, the one that adds less time; of two that do not, the one closer to fitting.
// Ties keep `b`.
bool BetterPlan(const Objective& a, double a_seconds, const Objective& b, double b_seconds);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_OBJECTIVE_H_
