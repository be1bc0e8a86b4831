// Plan: the search over plans, for any list of mechanisms (plan/mechanism.h).
//
//  * Evaluate: a choice is applied to one working table in place (mechanism by
//    mechanism), ordered as the executor would run it, simulated, and taken back.
//    Where a mechanism has an alternative placement, both are simulated on small
//    graphs and the better kept.
//  * Descend: the greedy descent. At the simulated peak, every holding (a buffer
//    live there only for later backward readers) gets a candidate from each
//    mechanism, and each mechanism may add candidates of its own that are no
//    holding's (Mechanism::ProposeAtPeak: a loop's accumulators); candidates are
//    taken by bytes saved per second added, first several at once (until their
//    savings cover the excess), else one at a time
//    (the leading few simulated alone, the best kept), until the peak fits or
//    nothing lowers it. Choices the budget turns out not to need are given back at
//    the end, most expensive first.
//  * ExactSearch: on small graphs, every set of the mechanisms' exact items,
//    cheapest first, until one fits.
// The search runs on live bytes first and switches the allocator model on (when
// the simulation options have one) once those fit or cannot.
#ifndef TFMEMOPT_GRAPPLER_PLAN_DESCENT_H_
#define TFMEMOPT_GRAPPLER_PLAN_DESCENT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "grappler/plan/mechanism.h"
#include "grappler/plan/objective.h"
#include "grappler/plan/pin_order.h"

namespace tfmemopt {

// One planning state: a choice, simulated. (The planner applies choices to one
// working table in place and takes them back, so a state keeps no table.)
struct Evaluated {
  Choice choice;
  std::vector<int> order;  // the simulated order of the applied choice
  SimulationResult simulation;
  // The simulation judged (plan/objective.h): worst device's predicted peak above
  // its budget, how far from fitting, and which device.
  int64_t excess = 0;
  double overshoot = 0;
  int worst_device = -1;
  Focus focus = Focus::kLivePeak;
  double seconds = 0;  // predicted added time
  // The allocator model replayed every history (not the worst so far alone), so
  // Planner::OnEveryHistory has nothing to add.
  bool every_history = false;

  Objective objective() const {
    Objective o;
    o.excess = excess;
    o.overshoot = overshoot;
    o.worst_device = worst_device;
    o.focus = focus;
    return o;
  }
};

// Choices that the final cleanup may take back, one group at a time.
struct Group {
  int mechanism = 0;
  std::vector<int> items;
  double seconds = 0;
};

class Planner {
 public:
  // `mechanisms` in the order they apply (each on top of the previous one's table).
  Planner(const PlanContext& context, std::vector<Mechanism*> mechanisms, MemoryPlan* plan);

  int num_mechanisms() const { return static_cast<int>(mechanisms_.size()); }
  // Starts a search of its own: max_simulations more simulations from here, on
  // live bytes first (the allocator model switched off until they fit or cannot),
  // as a planner made afresh would run it.
  void BeginSearch();
  // A choice with no items, shaped for this planner.
  Choice EmptyChoice() const;

  // Simulates `choice` (with the alternative placement too where it may help).
  absl::Status Evaluate(Choice choice, Evaluated* out);
  // With the allocator model on, replaying every allocator history.
  absl::Status EvaluateWithAllocator(Choice choice, Evaluated* out);
  // Re-simulates `state` with the allocator model, once, if there is one.
  absl::Status UseAllocatorModel(Evaluated* state);
  // Re-simulates `state`'s own choice replaying every allocator history: the search
  // judges a plan that does not fit on the worst history so far alone, and two such
  // plans compare only when judged on the same histories. A state already judged on
  // every history is left as it is.
  absl::Status OnEveryHistory(Evaluated* state);

  // Greedy descent from `fixed` plus `groups`; only the mechanisms marked in
  // `proposing` propose candidates. Groups the budget turns out not to need are
  // dropped at the end.
  absl::Status Descend(const Choice& fixed, std::vector<Group> groups,
                       const std::vector<bool>& proposing, Evaluated* best);
  // Makes Descend give up once the time its choice adds exceeds `seconds` (a plan
  // that fits at a fraction of that is in hand); 0: no bound.
  void set_cost_bound(double seconds) { cost_bound_ = seconds; }
  double cost_bound() const { return cost_bound_; }
  // Makes Descend take only choices that lower the peak (not those that lower
  // just the live bytes above the budget at other steps).
  void set_peak_only(bool peak_only) { peak_only_ = peak_only; }

  // On small graphs: the cheapest set of the mechanisms' exact items (by added
  // seconds) whose simulated peak fits the budget, if one costs less than
  // `bound`. Sets *complete when the search proved that (it found the cheapest,
  // or that none cheaper than `bound` fits); false when it was not run (too many
  // items, too big a graph) or ran out of simulations.
  absl::Status ExactSearch(double bound, Evaluated* found, bool* complete);

  double rewrite_seconds() const { return rewrite_seconds_; }
  double simulate_seconds() const { return simulate_seconds_; }

 private:
  bool HasAllocatorModel() const;
  // Whether the search replays the worst allocator history alone (an allocator is
  // modelled, with more than one history to replay).
  bool ReplaysOneHistory() const;
  absl::Status EvaluateAs(Choice choice, Evaluated* out);
  // The base node at (or, for an added node, last before) the step where `state`
  // goes wrong (TargetOf), or -1.
  int BaseNodeAtTarget(const Evaluated& state) const;
  absl::Status Apply(const Choice& choice);
  void Unapply();
  absl::Status Candidates(const Evaluated& state, const std::vector<bool>& proposing,
                          std::vector<Candidate>* out);
  // At an allocator refusal (plan/steer.cc): takes the candidates whose buffers'
  // chunks, freed together, would give BFC a chunk of the refused size, if that
  // brings the plan closer to fitting. `candidates` are Candidates' at the refusal.
  absl::Status SteerAroundRefusal(const Evaluated& state,
                                  const std::vector<Candidate>& candidates, Evaluated* next,
                                  std::vector<Group>* taken, bool* steered);

  const PlanContext& ctx_;
  std::vector<Mechanism*> mechanisms_;
  MemoryPlan* plan_;
  bool allocator_ = false;
  bool peak_only_ = false;
  int simulation_limit_ = 0;  // Descend stops here (BeginSearch)
  double cost_bound_ = 0;
  // The base table, with the choice being evaluated applied in place.
  TensorTable work_;
  int applied_ = 0;  // mechanisms applied to work_ (Unapply takes them back)
  bool pins_applied_ = false;  // work_ holds pinning edges (pin_edit_ takes them back)
  TableEdit pin_edit_;
  PinnedOrder pinned_;
  std::vector<int> pinned_order_;
  double rewrite_seconds_ = 0, simulate_seconds_ = 0;
  // The allocator history (SimulationOptions::allocator_histories) that was worst at
  // the last plan that fitted it: the search replays it alone, and every history
  // only for a plan that fits it (EvaluateAs).
  ResidentHistory worst_history_ = ResidentHistory::kGraphOrder;
  bool every_history_ = false;  // EvaluateAs replays them all
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_DESCENT_H_
