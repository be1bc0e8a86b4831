#include "grappler/plan/descent.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <queue>

#include "grappler/plan/memory_planner.h"
#include "grappler/plan/objective.h"
#include "grappler/rewrite/recompute_pass.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {

Planner::Planner(const PlanContext& context, std::vector<Mechanism*> mechanisms,
                 MemoryPlan* plan)
    : ctx_(context),
      mechanisms_(std::move(mechanisms)),
      plan_(plan),
      work_(context.table),
      simulation_limit_(plan->simulations + context.options.max_simulations) {}

void Planner::BeginSearch() {
  allocator_ = false;
  simulation_limit_ = plan_->simulations + ctx_.options.max_simulations;
}

Choice Planner::EmptyChoice() const {
  Choice choice;
  choice.items.resize(mechanisms_.size());
  return choice;
}

bool Planner::HasAllocatorModel() const {
  for (int64_t limit : ctx_.options.simulation.bfc_memory_limit) {
    if (limit > 0) return true;
  }
  return false;
}

absl::Status Planner::UseAllocatorModel(Evaluated* state) {
  if (allocator_ || !HasAllocatorModel()) return absl::OkStatus();
  allocator_ = true;
  Evaluated again;
  absl::Status status = Evaluate(state->choice, &again);
  if (status.ok()) *state = std::move(again);
  return status;
}

absl::Status Planner::EvaluateWithAllocator(Choice choice, Evaluated* out) {
  allocator_ = true;
  every_history_ = true;
  absl::Status status = Evaluate(std::move(choice), out);
  every_history_ = false;
  return status;
}

bool Planner::ReplaysOneHistory() const {
  return allocator_ && HasAllocatorModel() &&
         ctx_.options.simulation.allocator_histories.size() > 1;
}

absl::Status Planner::OnEveryHistory(Evaluated* state) {
  if (!ReplaysOneHistory() || state->every_history) return absl::OkStatus();
  every_history_ = true;
  Evaluated again;
  absl::Status status = EvaluateAs(state->choice, &again);
  every_history_ = false;
  if (status.ok()) *state = std::move(again);
  return status;
}

absl::Status Planner::Apply(const Choice& choice) {
  applied_ = 0;
  pins_applied_ = false;
  const std::vector<int>* order = &ctx_.order;
  for (size_t m = 0; m < mechanisms_.size(); ++m) {
    absl::Status status =
        choice.pinned ? mechanisms_[m]->ApplyPinned(&work_, *order, choice.items[m],
                                                    choice.clone_readers_from)
                      : mechanisms_[m]->Apply(&work_, *order, choice.items[m], choice.variant);
    applied_ = static_cast<int>(m) + 1;
    if (!status.ok()) return status;
    order = &mechanisms_[m]->order();
  }
  if (!choice.pinned) return absl::OkStatus();
  pin_edit_.Begin(work_);
  pins_applied_ = true;
  const int added = static_cast<int>(work_.nodes.size() - ctx_.table.nodes.size());
  return PinOrder(&work_, ctx_.flow, *order, PinEdgeLimit(added), &pin_edit_, &pinned_,
                  &pinned_order_);
}

void Planner::Unapply() {
  if (pins_applied_) pin_edit_.Undo(&work_);
  pins_applied_ = false;
  for (int m = applied_ - 1; m >= 0; --m) mechanisms_[m]->Undo(&work_);
  applied_ = 0;
}

// Simulates `choice` with each placement and keeps the best: where the executor's
// order runs a clone decides whether it lowers the peak. The usual placement first;
// if it does not fit, the order pinned with each clone right before its reader
// (Checkmate's placement, plan/pin_order.h), then the alternative placement. (The
// planner asks no more of a plan than that it fits: once one does, the others are
// not simulated. Graphs past exact_max_nodes get the usual placement only: there a
// simulation costs milliseconds, and the plan time of a big graph is bounded by the
// number of simulations.)
absl::Status Planner::Evaluate(Choice choice, Evaluated* out) {
  choice.items.resize(mechanisms_.size());
  choice.variant = false;
  choice.pinned = false;
  bool variant = false, adds = false;
  for (size_t m = 0; m < mechanisms_.size(); ++m) {
    variant = variant || mechanisms_[m]->HasVariant(choice.items[m]);
    adds = adds || !choice.items[m].empty();
  }
  if (!adds || static_cast<int>(ctx_.table.nodes.size()) > ctx_.options.exact_max_nodes) {
    return EvaluateAs(std::move(choice), out);
  }
  std::vector<Choice> others;
  Choice pinned = choice;
  pinned.pinned = true;
  others.push_back(pinned);
  if (variant) {
    Choice other = choice;
    other.variant = true;
    others.push_back(std::move(other));
  }
  absl::Status status = EvaluateAs(std::move(choice), out);
  for (Choice& other : others) {
    if (!status.ok() || out->excess <= 0) break;
    Evaluated trial;
    status = EvaluateAs(std::move(other), &trial);
    if (status.ok() && CloserToFitting(trial.objective(), out->objective(), false)) {
      *out = std::move(trial);
    }
  }
  if (!status.ok() || out->excess <= 0) return status;
  // Still over: pinned again, with the clones serving only the backward readers from
  // the best placement's peak on (Choice::clone_readers_from).
  pinned.clone_readers_from = BaseNodeAtTarget(*out);
  if (pinned.clone_readers_from < 0) return status;
  Evaluated trial;
  status = EvaluateAs(std::move(pinned), &trial);
  if (status.ok() && CloserToFitting(trial.objective(), out->objective(), false)) {
    *out = std::move(trial);
  }
  return status;
}

int Planner::BaseNodeAtTarget(const Evaluated& state) const {
  const Target target = TargetOf(state.objective(), state.simulation);
  const int base_nodes = static_cast<int>(ctx_.table.nodes.size());
  for (int s = std::min<int>(target.step, static_cast<int>(state.order.size()) - 1); s >= 0;
       --s) {
    // Nodes a mechanism added are not in the base order: the base node before them.
    if (state.order[s] < base_nodes) return state.order[s];
  }
  return -1;
}

absl::Status Planner::EvaluateAs(Choice choice, Evaluated* out) {
  const auto start = std::chrono::steady_clock::now();
  choice.items.resize(mechanisms_.size());
  for (std::vector<int>& v : choice.items) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
  }
  out->choice = std::move(choice);
  absl::Status status = Apply(out->choice);
  if (!status.ok()) {
    Unapply();
    return status;
  }
  // Simulated in the order the verify stage gives the rewritten graph (the
  // executor's, emulated), not the order the rewrite was built around.
  status = ExecutorOrder(work_, &out->order);
  if (!status.ok()) {
    Unapply();
    return status;
  }
  const auto built = std::chrono::steady_clock::now();
  // Replaying every allocator history for every candidate would cost the search one
  // replay per history; the worst one so far stands for them until a plan fits it.
  // Then the plan is judged on all of them, so that a plan the search takes as
  // fitting fits every history, as the report will say.
  SimulationOptions live_bytes_only;
  live_bytes_only.inter_op_threads = ctx_.options.simulation.inter_op_threads;
  const SimulationOptions& all = allocator_ ? ctx_.options.simulation : live_bytes_only;
  const bool one_first = ReplaysOneHistory() && !every_history_;
  SimulationOptions one = all;
  if (one_first) one.allocator_histories = {worst_history_};
  status = Simulate(work_, out->order, one, &out->simulation);
  out->every_history = allocator_ && HasAllocatorModel() && !one_first;
  if (status.ok() && one_first && Judge(out->simulation, ctx_.options.budget_bytes).fits()) {
    status = Simulate(work_, out->order, all, &out->simulation);
    out->every_history = true;
    const int worst = Judge(out->simulation, ctx_.options.budget_bytes).worst_device;
    if (status.ok() && worst >= 0) {
      worst_history_ = out->simulation.devices[worst].allocator_history;
    }
  }
  Unapply();
  if (!status.ok()) return status;
  ++plan_->simulations;
  rewrite_seconds_ += std::chrono::duration<double>(built - start).count();
  simulate_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - built).count();
  const Objective objective = Judge(out->simulation, ctx_.options.budget_bytes);
  out->excess = objective.excess;
  out->overshoot = objective.overshoot;
  out->worst_device = objective.worst_device;
  out->focus = objective.focus;
  out->seconds = 0;
  for (const Mechanism* mechanism : mechanisms_) out->seconds = mechanism->AddSeconds(out->seconds);
  return absl::OkStatus();
}

absl::Status Planner::Candidates(const Evaluated& state, const std::vector<bool>& proposing,
                                 std::vector<Candidate>* out) {
  out->clear();
  // At the step where the plan goes wrong (objective.h: the live peak, the
  // allocator's peak, or its refusal).
  const Target target = TargetOf(state.objective(), state.simulation);
  if (target.device < 0) return absl::OkStatus();
  const int peak_step = target.step;
  if (peak_step < 0) return absl::OkStatus();
  absl::Status status = Apply(state.choice);
  if (!status.ok()) {
    Unapply();
    return status;
  }
  const TensorTable& table = ctx_.table;
  const TensorTable& now = work_;
  std::vector<int> position(now.nodes.size(), -1);
  for (size_t s = 0; s < state.order.size(); ++s) position[state.order[s]] = static_cast<int>(s);
  std::vector<bool> live(now.buffers.size(), false);
  for (int b : *target.live) live[b] = true;
  for (size_t m = 0; m < mechanisms_.size(); ++m) {
    mechanisms_[m]->BeginProposals(state.choice.items[m]);
  }
  const PeakView view{now, position, live};
  for (size_t m = 0; m < mechanisms_.size(); ++m) {
    if (proposing[m]) mechanisms_[m]->ProposeAtPeak(view, static_cast<int>(m), out);
  }
  const int base_nodes = static_cast<int>(table.nodes.size());
  const int base_buffers = static_cast<int>(table.buffers.size());
  auto covered = [&](int b) {
    for (const Mechanism* mechanism : mechanisms_) {
      if (mechanism->Covers(b)) return true;
    }
    return false;
  };
  auto early_reader = [&](const NodeInfo& added) {
    for (const Mechanism* mechanism : mechanisms_) {
      if (mechanism->EarlyReader(added)) return true;
    }
    return false;
  };

  for (int b : *target.live) {
    if (b >= base_buffers || table.buffers[b].persistent) continue;
    const int owner_node = table.tensors[table.buffers[b].owner].node;
    if (table.nodes[owner_node].backward || table.buffers[b].bytes < ctx_.options.min_tensor_bytes ||
        position[owner_node] >= peak_step || covered(b)) {
      continue;
    }
    // Held at the peak only for backward readers (or clones) that run later?
    Holding holding;
    holding.buffer = b;
    holding.owner_node = owner_node;
    holding.producers = {owner_node};
    bool held_for_backward = false, needed_anyway = false;
    for (int t : ctx_.tensors_of_buffer[b]) {
      bool late_reader = false;
      for (int c : now.tensors[t].consumers) {
        if (position[c] < peak_step) continue;
        if (c < base_nodes ? ReadsRecomputedValues(table, ctx_.flow, c)
                           : now.nodes[c].backward && !early_reader(now.nodes[c])) {
          late_reader = true;
        } else {
          needed_anyway = true;
        }
      }
      if (late_reader) {
        held_for_backward = true;
        holding.late_tensors.push_back(t);
        const int producer = table.tensors[t].node;
        if (producer != owner_node) holding.producers.push_back(producer);
      }
    }
    for (int t : table.fetch_tensors) {
      if (table.tensors[t].buffer == b) needed_anyway = true;
    }
    if (!held_for_backward || needed_anyway) continue;
    // Later mechanisms are asked first: candidates are listed in the order the
    // planner listed them before mechanisms had a shape of their own (swap, then
    // recompute), which the sort below, not being stable, depends on.
    const size_t proposed = out->size();
    for (int m = static_cast<int>(mechanisms_.size()) - 1; m >= 0; --m) {
      if (proposing[m]) mechanisms_[m]->Propose(view, holding, m, out);
    }
    for (size_t c = proposed; c < out->size(); ++c) (*out)[c].buffer = b;
  }
  Unapply();
  std::sort(out->begin(), out->end(), [](const Candidate& a, const Candidate& b) {
    const double sa = a.gain / a.seconds, sb = b.gain / b.seconds;
    if (sa != sb) return sa > sb;
    if (a.owner != b.owner) return a.owner < b.owner;
    return a.mechanism < b.mechanism;
  });
  return absl::OkStatus();
}

absl::Status Planner::Descend(const Choice& fixed_in, std::vector<Group> groups,
                              const std::vector<bool>& proposing, Evaluated* best) {
  Choice fixed = fixed_in;
  fixed.items.resize(mechanisms_.size());
  auto combined = [&](const std::vector<bool>* dropped) {
    Choice choice = fixed;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (dropped != nullptr && (*dropped)[g]) continue;
      std::vector<int>& into = choice.items[groups[g].mechanism];
      into.insert(into.end(), groups[g].items.begin(), groups[g].items.end());
    }
    return choice;
  };
  Evaluated state;
  absl::Status status = Evaluate(combined(nullptr), &state);
  if (!status.ok()) return status;
  std::vector<Candidate> candidates;
  auto improves = [this](const Evaluated& next, const Evaluated& now) {
    return CloserToFitting(next.objective(), now.objective(), peak_only_);
  };
  auto with = [](const Choice& base, const Candidate& c) {
    Choice next = base;
    std::vector<int>& into = next.items[c.mechanism];
    into.insert(into.end(), c.items.begin(), c.items.end());
    return next;
  };
  auto group_of = [](const Candidate& c) { return Group{c.mechanism, c.items, c.seconds}; };
  const int n = static_cast<int>(ctx_.table.nodes.size());
  while (plan_->simulations < simulation_limit_) {
    if (cost_bound_ > 0 && state.seconds > cost_bound_) break;
    if (state.excess <= 0) {
      if (allocator_ || !HasAllocatorModel()) break;
      status = UseAllocatorModel(&state);
      if (!status.ok()) return status;
      continue;
    }
    status = Candidates(state, proposing, &candidates);
    if (!status.ok()) return status;
    if (VLOG_IS_ON(2)) {
      std::string chosen;
      for (size_t m = 0; m < mechanisms_.size(); ++m) {
        chosen += absl::StrCat(state.choice.items[m].size(), " ", mechanisms_[m]->name(), ", ");
      }
      VLOG(2) << "TfMemOpt plan: " << chosen << "excess " << state.excess << ", overshoot "
              << state.overshoot << ", " << candidates.size() << " candidates";
    }
    if (candidates.empty()) break;
    if (state.focus == Focus::kRefusal) {
      // The allocator refuses although the peak fits: first free a chunk that large.
      Evaluated steered_state;
      std::vector<Group> steered_groups;
      bool steered = false;
      status = SteerAroundRefusal(state, candidates, &steered_state, &steered_groups, &steered);
      if (!status.ok()) return status;
      if (steered) {
        groups.insert(groups.end(), steered_groups.begin(), steered_groups.end());
        state = std::move(steered_state);
        continue;
      }
    }
    // First several at once: the best until their estimated savings cover the
    // excess. Each estimate assumes its anchors stay, so a batch never drops
    // another member's anchor.
    std::vector<bool> taken(n, false), anchored(n, false);
    Choice next_choice = state.choice;
    std::vector<int> batch;
    int64_t saved = 0;
    std::vector<int64_t> room(mechanisms_.size());
    for (size_t m = 0; m < mechanisms_.size(); ++m) {
      room[m] = mechanisms_[m]->Room(state.choice.items[m]);
    }
    for (size_t i = 0; i < candidates.size() && batch.size() < 64; ++i) {
      const Candidate& c = candidates[i];
      if (room[c.mechanism] != INT64_MAX) {
        if (static_cast<int64_t>(c.items.size()) > room[c.mechanism]) continue;
        room[c.mechanism] -= static_cast<int64_t>(c.items.size());
      }
      bool conflicts = false;
      for (int p : c.nodes) conflicts = conflicts || taken[p] || anchored[p];
      for (int p : c.anchors) conflicts = conflicts || taken[p];
      if (conflicts) continue;
      for (int p : c.nodes) taken[p] = true;
      for (int p : c.anchors) anchored[p] = true;
      next_choice = with(next_choice, c);
      batch.push_back(static_cast<int>(i));
      saved += c.gain;
      if (saved >= state.excess) break;
    }
    if (batch.size() > 1) {
      Evaluated next;
      status = Evaluate(std::move(next_choice), &next);
      if (!status.ok()) return status;
      if (improves(next, state)) {
        for (int i : batch) groups.push_back(group_of(candidates[i]));
        state = std::move(next);
        continue;
      }
    }
    // Then one at a time: simulate the leading candidates alone and keep the one
    // that lowers the overshoot most per second added.
    int chosen = -1;
    double chosen_score = 0;
    Evaluated chosen_state;
    const double steps = static_cast<double>(
        state.simulation.devices[state.worst_device].activation_bytes.size());
    for (size_t i = 0; i < candidates.size() && i < 6 && plan_->simulations < simulation_limit_;
         ++i) {
      const Candidate& c = candidates[i];
      if (static_cast<int64_t>(c.items.size()) >
          mechanisms_[c.mechanism]->Room(state.choice.items[c.mechanism])) {
        continue;
      }
      Evaluated trial;
      status = Evaluate(with(state.choice, c), &trial);
      if (!status.ok()) return status;
      VLOG(2) << "  trial " << mechanisms_[c.mechanism]->name() << " "
              << ctx_.table.nodes[c.owner].def->name() << " gain " << c.gain << " seconds "
              << c.seconds << ": excess " << trial.excess << ", overshoot " << trial.overshoot;
      if (!improves(trial, state)) continue;
      const double lowered = static_cast<double>(state.excess - trial.excess) * steps +
                             (state.overshoot - trial.overshoot);
      const double score = lowered / c.seconds;
      if (chosen < 0 || score > chosen_score) {
        chosen = static_cast<int>(i);
        chosen_score = score;
        chosen_state = std::move(trial);
      }
    }
    if (chosen < 0) break;  // a local minimum: nothing lowers the peak any more
    groups.push_back(group_of(candidates[chosen]));
    state = std::move(chosen_state);
  }
  status = UseAllocatorModel(&state);
  if (!status.ok()) return status;

  // Drop choices the budget does not need, most expensive first: whole groups,
  // then single items of what is left (of mechanisms whose items stand alone).
  if (state.excess <= 0 && !groups.empty()) {
    std::vector<int> by_cost(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) by_cost[g] = static_cast<int>(g);
    std::stable_sort(by_cost.begin(), by_cost.end(),
                     [&](int a, int b) { return groups[a].seconds > groups[b].seconds; });
    std::vector<bool> dropped(groups.size(), false);
    const int group_limit = plan_->simulations + std::min<int>(64, groups.size());
    for (int g : by_cost) {
      if (plan_->simulations >= group_limit) break;
      dropped[g] = true;
      Evaluated trial;
      status = Evaluate(combined(&dropped), &trial);
      if (!status.ok()) return status;
      if (trial.excess <= 0 && trial.seconds <= state.seconds) {
        state = std::move(trial);
      } else {
        dropped[g] = false;
      }
    }
    std::vector<std::pair<int, int>> singles;  // (group, item), most expensive first
    for (size_t g = 0; g < groups.size(); ++g) {
      if (dropped[g] || !mechanisms_[groups[g].mechanism]->Divisible() ||
          groups[g].items.size() < 2) {
        continue;
      }
      for (int item : groups[g].items) singles.push_back({static_cast<int>(g), item});
    }
    auto item_seconds = [&](const std::pair<int, int>& single) {
      return mechanisms_[groups[single.first].mechanism]->ItemSeconds(single.second);
    };
    std::stable_sort(singles.begin(), singles.end(), [&](const auto& a, const auto& b) {
      return item_seconds(a) > item_seconds(b);
    });
    const int single_limit = plan_->simulations + 32;
    for (const auto& [g, item] : singles) {
      if (plan_->simulations >= single_limit) break;
      std::vector<int>& items = groups[g].items;
      auto it = std::find(items.begin(), items.end(), item);
      if (it == items.end()) continue;
      items.erase(it);
      Evaluated trial;
      status = Evaluate(combined(&dropped), &trial);
      if (!status.ok()) return status;
      if (trial.excess <= 0 && trial.seconds < state.seconds) {
        state = std::move(trial);
      } else {
        items.push_back(item);
      }
    }
  }
  *best = std::move(state);
  return absl::OkStatus();
}

absl::Status Planner::ExactSearch(double bound, Evaluated* found, bool* complete) {
  *complete = false;
  found->excess = 1;  // nothing found yet
  const int n = static_cast<int>(ctx_.table.nodes.size());
  if (ctx_.options.exact_max_candidates <= 0 || n > ctx_.options.exact_max_nodes) {
    return absl::OkStatus();
  }
  // (At most 30 items: sets are bit masks, and 2^30 of them is past any useful
  // effort.)
  const int limit = std::min(ctx_.options.exact_max_candidates, 30);
  std::vector<std::pair<int, int>> items;  // (mechanism, item)
  for (size_t m = 0; m < mechanisms_.size(); ++m) {
    std::vector<int> own;
    if (!mechanisms_[m]->ExactItems(limit - static_cast<int>(items.size()), &own)) {
      return absl::OkStatus();
    }
    for (int item : own) items.push_back({static_cast<int>(m), item});
  }
  plan_->exact_candidates = static_cast<int>(items.size());
  if (items.empty()) {
    *complete = true;
    return absl::OkStatus();
  }
  auto seconds_of = [&](const std::pair<int, int>& item) {
    return mechanisms_[item.first]->ItemSeconds(item.second);
  };
  // Cheapest first; ties by mechanism and item, so the search is deterministic.
  std::sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
    const double ca = seconds_of(a), cb = seconds_of(b);
    return ca != cb ? ca < cb : a < b;
  });
  const int k = static_cast<int>(items.size());
  auto cost_of = [&](uint64_t set) {
    double cost = 0;
    for (int i = 0; i < k; ++i) {
      if (set >> i & 1) cost += seconds_of(items[i]);
    }
    return cost;
  };
  std::vector<std::function<bool(uint64_t)>> filters;
  for (size_t m = 0; m < mechanisms_.size(); ++m) {
    filters.push_back(mechanisms_[m]->ExactFilter(items, static_cast<int>(m)));
  }
  auto useful = [&](uint64_t set) {
    for (const auto& filter : filters) {
      if (!filter(set)) return false;
    }
    return true;
  };
  // Every non-empty subset once, in order of cost (sum of its items' seconds):
  // from the set whose highest item is j, add item j + 1, or replace j by j + 1.
  // The first set that fits is the cheapest. Ties pop in order of the bit mask.
  struct Entry {
    double cost;
    uint64_t set;
    int last;
    bool operator>(const Entry& o) const {
      return cost != o.cost ? cost > o.cost : set > o.set;
    }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  queue.push({cost_of(1), 1, 0});
  const int64_t allowed = std::min<int64_t>(ctx_.options.exact_max_simulations,
                                            ctx_.options.exact_max_node_steps / n);
  const int64_t stop = plan_->simulations + allowed;
  for (int64_t popped = 0; !queue.empty(); ++popped) {
    // Sets skipped unsimulated cost little, but not nothing.
    if (popped >= 64 * allowed) return absl::OkStatus();
    const Entry e = queue.top();
    queue.pop();
    if (e.cost >= bound) break;  // nothing cheaper than the plan in hand is left
    if (e.last + 1 < k) {
      const uint64_t next = uint64_t{1} << (e.last + 1);
      queue.push({cost_of(e.set | next), e.set | next, e.last + 1});
      const uint64_t moved = (e.set & ~(uint64_t{1} << e.last)) | next;
      queue.push({cost_of(moved), moved, e.last + 1});
    }
    if (!useful(e.set)) continue;
    if (plan_->simulations >= stop) return absl::OkStatus();
    Choice choice = EmptyChoice();
    for (int i = 0; i < k; ++i) {
      if (e.set >> i & 1) choice.items[items[i].first].push_back(items[i].second);
    }
    Evaluated trial;
    absl::Status status = Evaluate(std::move(choice), &trial);
    if (!status.ok()) return status;
    if (trial.excess <= 0) {
      *found = std::move(trial);
      break;
    }
  }
  *complete = true;
  return absl::OkStatus();
}

}  // namespace tfmemopt
