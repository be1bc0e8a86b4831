#include "grappler/plan/recompute_planner.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

// Bytes of a value whose contents are plain memory; the rest (handles, variants,
// strings) cannot be cloned by value safely.
bool PlainType(tensorflow::DataType dtype) {
  return dtype != tensorflow::DT_RESOURCE && dtype != tensorflow::DT_VARIANT &&
         dtype != tensorflow::DT_STRING && dtype != tensorflow::DT_INVALID &&
         !tensorflow::IsRefType(dtype);
}

bool MatchesAnyScope(const std::string& name, const std::vector<std::string>& scopes) {
  for (const std::string& scope : scopes) {
    if (InScope(name, scope)) return true;
  }
  return false;
}

bool MatchesAnyType(const std::string& op, const std::vector<std::string>& types) {
  return std::find(types.begin(), types.end(), op) != types.end();
}

// Why a forward node may not be recomputed, or "" if it may.
std::string NotRecomputableReason(const TensorTable& table, const ControlFlowInfo& flow,
                                  const RecomputePlannerOptions& options, int n) {
  const NodeInfo& node = table.nodes[n];
  const NodeDef& def = *node.def;
  if (node.stateful) return "stateful";
  if (flow.Under(n)) return "control_flow";
  if (tensorflow::grappler::IsControlFlow(def) || def.op() == "_Arg" ||
      def.op() == "Placeholder" || def.op() == "PlaceholderWithDefault" ||
      tensorflow::grappler::IsConstant(def) || def.op() == "_Retval" ||
      def.op() == "NoOp" || node.outputs.empty()) {
    return "input_or_structural";
  }
  for (int t : node.inputs) {
    if (!PlainType(table.tensors[t].dtype)) return "non_plain_dtype";
  }
  for (int t : node.outputs) {
    const TensorInfo& tensor = table.tensors[t];
    if (!PlainType(tensor.dtype)) return "non_plain_dtype";
    if (!tensor.size_known) return "unknown_size";
    if (table.buffers[tensor.buffer].persistent) return "persistent";
  }
  if (MatchesAnyScope(def.name(), options.exclude_scopes) ||
      MatchesAnyType(def.op(), options.exclude_op_types)) {
    return "excluded";
  }
  if ((!options.include_scopes.empty() &&
       !MatchesAnyScope(def.name(), options.include_scopes)) ||
      (!options.include_op_types.empty() &&
       !MatchesAnyType(def.op(), options.include_op_types))) {
    return "not_included";
  }
  return "";
}

int64_t Excess(const SimulationResult& simulation, const std::vector<int64_t>& budget,
               int* worst_device) {
  int64_t excess = INT64_MIN;
  *worst_device = -1;
  for (size_t d = 0; d < simulation.devices.size() && d < budget.size(); ++d) {
    if (budget[d] <= 0) continue;
    const int64_t over = PredictedPeak(simulation.devices[d]) - budget[d];
    if (over > excess) {
      excess = over;
      *worst_device = static_cast<int>(d);
    }
  }
  return *worst_device < 0 ? 0 : excess;
}

// How far a simulated plan is from fitting: the live bytes above the budget summed
// over all steps, plus the peak's excess counted once per step. The sum keeps
// guiding the search when several steps share the peak and dropping a tensor
// lowers only some of them.
double Overshoot(const SimulationResult& simulation, const std::vector<int64_t>& budget) {
  double total = 0;
  for (size_t d = 0; d < simulation.devices.size() && d < budget.size(); ++d) {
    if (budget[d] <= 0) continue;
    const DeviceTimeline& t = simulation.devices[d];
    for (size_t s = 0; s < t.activation_bytes.size(); ++s) {
      const int64_t live = t.persistent_bytes + t.activation_bytes[s] + t.gradient_bytes[s];
      if (live > budget[d]) total += static_cast<double>(live - budget[d]);
    }
    const int64_t over = PredictedPeak(t) - budget[d];
    if (over > 0) total += static_cast<double>(over) * t.activation_bytes.size();
  }
  return total;
}

// One planning state: a node set, its rewrite and its simulation.
struct Evaluated {
  std::vector<int> nodes;
  RecomputeRewrite rewrite;
  SimulationResult simulation;
  int64_t excess = 0;
  double overshoot = 0;
  int worst_device = -1;
  double seconds = 0;
};

class Planner {
 public:
  Planner(const TensorTable& table, const std::vector<int>& order, const ControlFlowInfo& flow,
          const RecomputePlannerOptions& options, RecomputePlan* plan)
      : table_(table), order_(order), flow_(flow), options_(options), plan_(plan) {
    const int n = static_cast<int>(table.nodes.size());
    eligible_.assign(n, false);
    for (int i = 0; i < n; ++i) {
      if (table.nodes[i].backward) continue;
      const std::string reason = NotRecomputableReason(table, flow, options, i);
      if (reason.empty()) {
        eligible_[i] = true;
      } else if (reason != "input_or_structural") {
        ++plan->left_alone[reason];
      }
    }
    tensors_of_buffer_.resize(table.buffers.size());
    for (size_t t = 0; t < table.tensors.size(); ++t) {
      tensors_of_buffer_[table.tensors[t].buffer].push_back(static_cast<int>(t));
    }
  }

  absl::Status Evaluate(std::vector<int> nodes, Evaluated* out) {
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    out->nodes = std::move(nodes);
    absl::Status status =
        BuildRecomputeRewrite(table_, order_, flow_, out->nodes, &out->rewrite);
    if (!status.ok()) return status;
    status = Simulate(out->rewrite.table, out->rewrite.order, options_.simulation,
                      &out->simulation);
    if (!status.ok()) return status;
    ++plan_->simulations;
    out->excess = Excess(out->simulation, options_.budget_bytes, &out->worst_device);
    out->overshoot = Overshoot(out->simulation, options_.budget_bytes);
    out->seconds = out->rewrite.added_seconds;
    return absl::OkStatus();
  }

  absl::Status PlanAuto(Evaluated* best);
  absl::Status PlanSqrt(Evaluated* best);
  absl::Status PlanManual(Evaluated* best);

 private:
  struct Candidate {
    std::vector<int> nodes;    // the closure to recompute
    std::vector<int> anchors;  // producers of the live tensors it is recomputed from
    int64_t gain = 0;
    double seconds = 0;
    int owner = 0;  // tie-break
  };
  void Candidates(const Evaluated& state, std::vector<Candidate>* out) const;

  const TensorTable& table_;
  const std::vector<int>& order_;
  const ControlFlowInfo& flow_;
  const RecomputePlannerOptions& options_;
  RecomputePlan* plan_;
  std::vector<bool> eligible_;
  std::vector<std::vector<int>> tensors_of_buffer_;
};

void Planner::Candidates(const Evaluated& state, std::vector<Candidate>* out) const {
  out->clear();
  const int d = state.worst_device;
  const DeviceTimeline& timeline = state.simulation.devices[d];
  const int peak_step = timeline.peak_step;
  if (peak_step < 0) return;
  const TensorTable& now = state.rewrite.table;
  std::vector<int> position(now.nodes.size(), -1);
  for (size_t s = 0; s < state.rewrite.order.size(); ++s) {
    position[state.rewrite.order[s]] = static_cast<int>(s);
  }
  std::vector<bool> live(now.buffers.size(), false);
  for (int b : timeline.live_at_peak) live[b] = true;
  std::vector<bool> chosen(table_.nodes.size(), false);
  for (int r : state.nodes) chosen[r] = true;
  const int base_buffers = static_cast<int>(table_.buffers.size());

  std::vector<bool> in_closure(table_.nodes.size(), false);
  for (int b : timeline.live_at_peak) {
    if (b >= base_buffers || table_.buffers[b].persistent) continue;
    const int owner_node = table_.tensors[table_.buffers[b].owner].node;
    if (chosen[owner_node] || !eligible_[owner_node] ||
        table_.buffers[b].bytes < options_.min_tensor_bytes ||
        position[owner_node] >= peak_step) {
      continue;
    }
    // Held at the peak only for backward readers (or clones) that run later?
    bool held_for_backward = false, needed_anyway = false;
    std::vector<int> producers = {owner_node};
    for (int t : tensors_of_buffer_[b]) {
      bool backward_reader = false;
      for (int c : now.tensors[t].consumers) {
        if (position[c] < peak_step) continue;
        if (c >= static_cast<int>(table_.nodes.size())) {
          backward_reader = true;  // a clone reading it as a checkpoint
        } else if (ReadsRecomputedValues(table_, flow_, c)) {
          backward_reader = true;
        } else {
          needed_anyway = true;
        }
      }
      if (backward_reader) {
        held_for_backward = true;
        const int producer = table_.tensors[t].node;
        if (producer != owner_node) producers.push_back(producer);
      }
    }
    for (int t : table_.fetch_tensors) {
      if (table_.tensors[t].buffer == b) needed_anyway = true;
    }
    if (VLOG_IS_ON(3)) {
      VLOG(3) << "  live " << table_.TensorName(table_.buffers[b].owner) << " held_for_backward "
              << held_for_backward << " needed_anyway " << needed_anyway;
      for (int t : tensors_of_buffer_[b]) {
        for (int c : now.tensors[t].consumers) {
          VLOG(3) << "    reader " << now.nodes[c].def->name() << " at " << position[c]
                  << (c < static_cast<int>(table_.nodes.size()) &&
                              ReadsRecomputedValues(table_, flow_, c)
                          ? " rewirable"
                          : "");
        }
      }
    }
    if (!held_for_backward || needed_anyway) continue;

    Candidate candidate;
    candidate.owner = owner_node;
    candidate.gain = table_.buffers[b].bytes;
    bool ok = true;
    for (int p : producers) {
      if (!eligible_[p] || chosen[p]) ok = false;
    }
    if (!ok) continue;
    std::vector<int> work = producers;
    for (int p : producers) in_closure[p] = true;
    std::set<int> kept_alive;
    for (size_t i = 0; i < work.size() && ok; ++i) {
      for (int u : table_.nodes[work[i]].inputs) {
        const int p = table_.tensors[u].node;
        if (in_closure[p] || chosen[p]) continue;
        const int ub = table_.tensors[u].buffer;
        if (table_.buffers[ub].persistent) continue;
        if (live[ub]) {
          candidate.anchors.push_back(p);
          continue;
        }
        if (eligible_[p] && table_.tensors[u].bytes >= options_.min_tensor_bytes &&
            work.size() < 64) {
          in_closure[p] = true;
          work.push_back(p);
        } else if (kept_alive.insert(ub).second) {
          candidate.gain -= table_.buffers[ub].bytes;
        }
      }
    }
    for (int p : work) in_closure[p] = false;
    if (candidate.gain <= 0) continue;
    for (int p : work) candidate.seconds += table_.nodes[p].compute_seconds + 1e-7;
    candidate.nodes = std::move(work);
    out->push_back(std::move(candidate));
  }
  std::sort(out->begin(), out->end(), [](const Candidate& a, const Candidate& b) {
    const double sa = a.gain / a.seconds, sb = b.gain / b.seconds;
    if (sa != sb) return sa > sb;
    return a.owner < b.owner;
  });
}

absl::Status Planner::PlanAuto(Evaluated* best) {
  Evaluated state;
  absl::Status status = Evaluate({}, &state);
  if (!status.ok()) return status;
  std::vector<std::vector<int>> groups;  // accepted closures, in order
  std::vector<Candidate> candidates;
  auto improves = [](const Evaluated& next, const Evaluated& now) {
    return next.excess < now.excess ||
           (next.excess == now.excess && next.overshoot < now.overshoot);
  };
  while (state.excess > 0 && plan_->simulations < options_.max_simulations) {
    Candidates(state, &candidates);
    VLOG(2) << "TfMemOpt recompute: " << state.nodes.size() << " nodes, excess "
            << state.excess << ", overshoot " << state.overshoot << ", peak step "
            << state.simulation.devices[state.worst_device].peak_step << ", "
            << candidates.size() << " candidates";
    if (candidates.empty()) break;
    // First try several at once: the best candidates until their estimated savings
    // cover the excess. Each estimate assumes its anchors stay, so a batch never
    // drops another member's anchor.
    std::vector<bool> taken(table_.nodes.size(), false), anchored(table_.nodes.size(), false);
    std::vector<int> nodes = state.nodes;
    std::vector<int> batch;
    int64_t saved = 0;
    for (size_t i = 0; i < candidates.size() && batch.size() < 8; ++i) {
      const Candidate& c = candidates[i];
      bool conflicts = false;
      for (int p : c.nodes) conflicts = conflicts || taken[p] || anchored[p];
      for (int p : c.anchors) conflicts = conflicts || taken[p];
      if (conflicts) continue;
      for (int p : c.nodes) taken[p] = true;
      for (int p : c.anchors) anchored[p] = true;
      nodes.insert(nodes.end(), c.nodes.begin(), c.nodes.end());
      batch.push_back(static_cast<int>(i));
      saved += c.gain;
      if (saved >= state.excess) break;
    }
    Evaluated next;
    if (batch.size() > 1) {
      status = Evaluate(std::move(nodes), &next);
      if (!status.ok()) return status;
      if (improves(next, state)) {
        for (int i : batch) groups.push_back(candidates[i].nodes);
        state = std::move(next);
        continue;
      }
    }
    // Then one at a time: simulate the leading candidates alone and keep the one
    // that lowers the overshoot most per second of recompute.
    int chosen = -1;
    double chosen_score = 0;
    Evaluated chosen_state;
    for (size_t i = 0; i < candidates.size() && i < 6 &&
                       plan_->simulations < options_.max_simulations;
         ++i) {
      std::vector<int> trial_nodes = state.nodes;
      trial_nodes.insert(trial_nodes.end(), candidates[i].nodes.begin(),
                         candidates[i].nodes.end());
      Evaluated trial;
      status = Evaluate(std::move(trial_nodes), &trial);
      if (!status.ok()) return status;
      VLOG(2) << "  trial " << table_.nodes[candidates[i].owner].def->name() << " gain "
              << candidates[i].gain << " closure " << candidates[i].nodes.size() << " cost "
              << candidates[i].seconds << ": excess " << trial.excess << ", overshoot "
              << trial.overshoot;
      if (!improves(trial, state)) continue;
      const double lowered = static_cast<double>(state.excess - trial.excess) *
                                 state.simulation.devices[0].activation_bytes.size() +
                             (state.overshoot - trial.overshoot);
      const double score = lowered / (candidates[i].seconds + 1e-9);
      if (chosen < 0 || score > chosen_score) {
        chosen = static_cast<int>(i);
        chosen_score = score;
        chosen_state = std::move(trial);
      }
    }
    if (chosen < 0) break;  // a local minimum: nothing lowers the peak any more
    groups.push_back(candidates[chosen].nodes);
    state = std::move(chosen_state);
  }
  *best = std::move(state);

  // Drop groups the budget does not need, most expensive first.
  if (best->excess <= 0 && !groups.empty()) {
    std::vector<int> by_cost(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) by_cost[g] = static_cast<int>(g);
    auto group_seconds = [&](int g) {
      double s = 0;
      for (int p : groups[g]) s += table_.nodes[p].compute_seconds;
      return s;
    };
    std::stable_sort(by_cost.begin(), by_cost.end(),
                     [&](int a, int b) { return group_seconds(a) > group_seconds(b); });
    std::vector<bool> dropped(groups.size(), false);
    const int cleanup_limit = plan_->simulations + std::min<int>(64, groups.size());
    for (int g : by_cost) {
      if (plan_->simulations >= cleanup_limit ||
          plan_->simulations >= options_.max_simulations + 64) {
        break;
      }
      dropped[g] = true;
      std::vector<int> nodes;
      for (size_t h = 0; h < groups.size(); ++h) {
        if (!dropped[h]) nodes.insert(nodes.end(), groups[h].begin(), groups[h].end());
      }
      Evaluated trial;
      status = Evaluate(std::move(nodes), &trial);
      if (!status.ok()) return status;
      if (trial.excess <= 0 && trial.seconds <= best->seconds) {
        *best = std::move(trial);
      } else {
        dropped[g] = false;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Planner::PlanSqrt(Evaluated* best) {
  // Forward tensors big enough to matter, with the span of their forward readers.
  const int n = static_cast<int>(table_.nodes.size());
  std::vector<int> position(n, -1);
  for (int s = 0; s < n; ++s) position[order_[s]] = s;
  std::vector<int> forward_order;
  for (int node : order_) {
    if (!table_.nodes[node].backward) forward_order.push_back(node);
  }
  const int f = static_cast<int>(forward_order.size());
  std::vector<int> rank(n, -1);
  for (int i = 0; i < f; ++i) rank[forward_order[i]] = i;
  // open_count[i]: big tensors produced at rank <= i and read at rank > i; their
  // index sum identifies the tensor when exactly one is open.
  std::vector<int64_t> open_count(f + 1, 0), open_sum(f + 1, 0);
  for (size_t t = 0; t < table_.tensors.size(); ++t) {
    const TensorInfo& tensor = table_.tensors[t];
    const int p = rank[tensor.node];
    if (p < 0 || table_.buffers[tensor.buffer].persistent ||
        tensor.bytes < options_.min_tensor_bytes) {
      continue;
    }
    int last = -1;
    for (int c : tensor.consumers) last = std::max(last, rank[c]);
    if (last <= p) continue;
    open_count[p] += 1;
    open_count[last] -= 1;
    open_sum[p] += static_cast<int64_t>(t);
    open_sum[last] -= static_cast<int64_t>(t);
  }
  std::vector<int> bottlenecks;
  int64_t count = 0, sum = 0;
  for (int i = 0; i < f; ++i) {
    count += open_count[i];
    sum += open_sum[i];
    if (count != 1) continue;
    const int t = static_cast<int>(sum);
    if (table_.tensors[t].node == forward_order[i]) bottlenecks.push_back(forward_order[i]);
  }
  std::vector<bool> checkpoint(n, false);
  if (!bottlenecks.empty()) {
    const int step = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(bottlenecks.size()))));
    for (size_t i = step - 1; i < bottlenecks.size(); i += step) {
      checkpoint[bottlenecks[i]] = true;
      plan_->checkpoints.push_back(bottlenecks[i]);
    }
  }
  std::vector<int> nodes;
  for (int node : forward_order) {
    if (!eligible_[node] || checkpoint[node]) continue;
    bool big = false;
    for (int t : table_.nodes[node].outputs) big |= table_.tensors[t].bytes >= options_.min_tensor_bytes;
    if (big) nodes.push_back(node);
  }
  return Evaluate(std::move(nodes), best);
}

absl::Status Planner::PlanManual(Evaluated* best) {
  std::vector<int> nodes;
  for (size_t i = 0; i < table_.nodes.size(); ++i) {
    const NodeDef& def = *table_.nodes[i].def;
    const bool hinted = def.attr().count("_recompute_hint") > 0 ||
                        def.attr().count("_tfmemopt_recompute") > 0 ||
                        MatchesAnyScope(def.name(), options_.hint_scopes);
    if (!hinted) continue;
    if (table_.nodes[i].backward) {
      plan_->hinted_but_not_recomputable.push_back(absl::StrCat(def.name(), " (backward)"));
      continue;
    }
    const std::string reason = NotRecomputableReason(table_, flow_, options_, static_cast<int>(i));
    if (!reason.empty()) {
      if (reason != "input_or_structural" || !tensorflow::grappler::IsConstant(def)) {
        plan_->hinted_but_not_recomputable.push_back(absl::StrCat(def.name(), " (", reason, ")"));
      }
      continue;
    }
    nodes.push_back(static_cast<int>(i));
  }
  return Evaluate(std::move(nodes), best);
}

}  // namespace

bool InScope(const std::string& name, const std::string& scope) {
  if (scope.empty()) return false;
  const std::string trimmed = scope.back() == '/' ? scope.substr(0, scope.size() - 1) : scope;
  return name == trimmed || absl::StartsWith(name, absl::StrCat(trimmed, "/"));
}

int64_t PredictedPeak(const DeviceTimeline& timeline) {
  // The allocator model refuses what exceeds its memory limit, so past the limit
  // its peak stops growing; the live bytes then tell how far beyond it the graph is.
  return std::max(timeline.allocator_peak_bytes, timeline.peak_bytes);
}

absl::Status PlanRecompute(const TensorTable& table, const std::vector<int>& order,
                           const ControlFlowInfo& flow,
                           const RecomputePlannerOptions& options, RecomputePlan* plan,
                           RecomputeRewrite* rewrite, SimulationResult* simulation) {
  *plan = RecomputePlan();
  Planner planner(table, order, flow, options, plan);
  Evaluated best;
  absl::Status status;
  switch (options.policy) {
    case RecomputePolicy::kAuto: status = planner.PlanAuto(&best); break;
    case RecomputePolicy::kSqrt: status = planner.PlanSqrt(&best); break;
    case RecomputePolicy::kManual: status = planner.PlanManual(&best); break;
  }
  if (!status.ok()) return status;
  plan->nodes = best.rewrite.cloned;
  plan->feasible = best.excess <= 0;
  for (const DeviceTimeline& timeline : best.simulation.devices) {
    plan->peak_bytes.push_back(PredictedPeak(timeline));
  }
  *rewrite = std::move(best.rewrite);
  *simulation = std::move(best.simulation);
  return absl::OkStatus();
}

}  // namespace tfmemopt
