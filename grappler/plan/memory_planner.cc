#include "grappler/plan/memory_planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <queue>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/plan/loop_candidates.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

using tensorflow::DataType;
using tensorflow::NodeDef;

// Bytes of a value whose contents are plain memory; the rest (handles, variants,
// strings) cannot be cloned or copied by value safely.
bool PlainType(DataType dtype) {
  return dtype != tensorflow::DT_RESOURCE && dtype != tensorflow::DT_VARIANT &&
         dtype != tensorflow::DT_STRING && dtype != tensorflow::DT_INVALID &&
         !tensorflow::IsRefType(dtype);
}

// The types TfMemSwapOut/TfMemSwapIn take (grappler/ops/swap_ops.cc).
bool SwappableType(DataType dtype) {
  switch (dtype) {
    case tensorflow::DT_BOOL: case tensorflow::DT_INT8: case tensorflow::DT_INT16:
    case tensorflow::DT_INT32: case tensorflow::DT_INT64: case tensorflow::DT_UINT8:
    case tensorflow::DT_UINT16: case tensorflow::DT_UINT32: case tensorflow::DT_UINT64:
    case tensorflow::DT_HALF: case tensorflow::DT_BFLOAT16: case tensorflow::DT_FLOAT:
    case tensorflow::DT_DOUBLE: case tensorflow::DT_COMPLEX64: case tensorflow::DT_COMPLEX128:
      return true;
    default:
      return false;
  }
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

// Whether the user's include/exclude lists let the planner touch `def`; "" if so.
std::string FilterReason(const NodeDef& def, const MemoryPlannerOptions& options) {
  if (MatchesAnyScope(def.name(), options.exclude_scopes) ||
      MatchesAnyType(def.op(), options.exclude_op_types)) {
    return "excluded";
  }
  if ((!options.include_scopes.empty() && !MatchesAnyScope(def.name(), options.include_scopes)) ||
      (!options.include_op_types.empty() && !MatchesAnyType(def.op(), options.include_op_types))) {
    return "not_included";
  }
  return "";
}

}  // namespace

std::string NotRecomputableReason(const TensorTable& table, const ControlFlowInfo& flow,
                                  const MemoryPlannerOptions& options, int n) {
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
  return FilterReason(def, options);
}

namespace {

bool Swappable(const TensorTable& table, const ControlFlowInfo& flow,
               const MemoryPlannerOptions& options, int tensor) {
  const TensorInfo& t = table.tensors[tensor];
  const NodeInfo& producer = table.nodes[t.node];
  // A graph input's buffer belongs to the caller, who keeps it: swapping frees nothing.
  const std::string& op = producer.def->op();
  if (op == "_Arg" || op == "Placeholder" || op == "PlaceholderWithDefault") return false;
  return !producer.backward && !flow.Under(t.node) && SwappableType(t.dtype) && t.size_known &&
         !table.buffers[t.buffer].persistent && !table.buffers[t.buffer].external &&
         FilterReason(*producer.def, options).empty();
}

// Fraction of a swap's copy time the device cannot hide behind compute.
double CopyExposure(const std::string& device) {
  return absl::StartsWith(device, "GPU") ? 0.1 : 1.0;
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
// guiding the search when several steps share the peak and a choice lowers only
// some of them.
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

struct Choice {
  std::vector<int> recompute;  // base node indices
  std::vector<int> swap;       // base tensor indices
  std::vector<int> loop_swap;  // TensorTable::loops.lists indices (plan/loop_candidates.h)
  bool early_triggers = false;  // RecomputeInPlace's; Evaluate picks the better
};

// One planning state: a choice, simulated. (The planner applies choices to one
// working table in place and takes them back, so a state keeps no table.)
struct Evaluated {
  Choice choice;
  std::vector<int> order;    // the simulated order of the applied choice
  std::vector<int> cloned;   // nodes that got a clone
  std::vector<int> swapped;  // tensors that are swapped
  SimulationResult simulation;
  int64_t excess = 0;
  double overshoot = 0;
  int worst_device = -1;
  double seconds = 0;  // predicted added time
};

class Planner {
 public:
  Planner(const TensorTable& table, const std::vector<int>& order, const ControlFlowInfo& flow,
          const MemoryPlannerOptions& options, MemoryPlan* plan)
      : table_(table), work_(table), order_(order), flow_(flow), options_(options), plan_(plan) {
    const int n = static_cast<int>(table.nodes.size());
    tensors_of_buffer_.resize(table.buffers.size());
    for (size_t t = 0; t < table.tensors.size(); ++t) {
      tensors_of_buffer_[table.tensors[t].buffer].push_back(static_cast<int>(t));
    }
    // TF's AddN sums into the first input buffer it may reuse (one whose last reader
    // it is) and moves that input to the front: with three or more inputs, which
    // buffers are reusable decides the order of the sum, and so its last bits. A
    // plan must not change that: an AddN's input is never recomputed or swapped
    // (its late readers would move to the copy), and no clone keeps one alive that
    // had no reader after the AddN.
    pinned_.assign(table.buffers.size(), false);
    for (const NodeInfo& node : table.nodes) {
      if (node.def->op() != "AddN" || node.inputs.size() < 3) continue;
      for (int t : node.inputs) pinned_[table.tensors[t].buffer] = true;
    }
    recomputable_.assign(n, false);
    for (int i = 0; i < n; ++i) {
      if (table.nodes[i].backward) continue;
      std::string reason = NotRecomputableReason(table, flow, options, i);
      if (reason.empty() && FeedsAddN(i)) reason = "feeds_addn";
      if (reason.empty()) {
        recomputable_[i] = true;
      } else if (reason != "input_or_structural") {
        ++plan->left_alone[reason];
      }
    }
  }

  bool FeedsAddN(int node) const {
    for (int t : table_.nodes[node].outputs) {
      if (pinned_[table_.tensors[t].buffer]) return true;
    }
    return false;
  }

  // Whether a clone of `node` reading its original inputs would keep an AddN input
  // alive past the AddN, which today frees (or reuses) it.
  bool ReadsAddNInputEarly(int node) const {
    for (int u : table_.nodes[node].inputs) {
      const int b = table_.tensors[u].buffer;
      if (!pinned_[b]) continue;
      bool late = false;
      for (int t : tensors_of_buffer_[b]) {
        for (int c : table_.tensors[t].consumers) late = late || ReadsRecomputedValues(table_, flow_, c);
      }
      if (!late) return true;
    }
    return false;
  }

  // Applies `choice` to the working table; Unapply() takes it back.
  absl::Status Apply(const Choice& choice) {
    absl::Status status = RecomputeInPlace(&work_, order_, flow_, choice.recompute,
                                           &applied_recompute_, &recompute_edit_,
                                           choice.early_triggers);
    if (!status.ok()) return status;
    status = SwapInPlace(&work_, applied_recompute_.order, flow_, choice.swap, SwapOptionsFor(),
                         &applied_swap_, &swap_edit_);
    if (!status.ok()) return status;
    return LoopSwapInPlace(&work_, applied_swap_.order, choice.loop_swap,
                           SwapOptionsFor().bandwidth_bytes_per_sec, &applied_loop_swap_,
                           &loop_swap_edit_);
  }
  void Unapply() {
    loop_swap_edit_.Undo(&work_);
    swap_edit_.Undo(&work_);
    recompute_edit_.Undo(&work_);
  }

  // Simulates `choice` with both trigger placements and keeps the better: where
  // the executor's order runs a clone decides whether it lowers the peak.
  // (If the usual placement fits, the other is not simulated: the planner asks
  // no more of a plan than that it fits. Graphs past exact_max_nodes get the usual
  // placement only: there a simulation costs milliseconds, and the plan time of
  // a big graph is bounded by the number of simulations.)
  absl::Status Evaluate(Choice choice, Evaluated* out) {
    choice.early_triggers = false;
    if (choice.recompute.empty() ||
        static_cast<int>(table_.nodes.size()) > options_.exact_max_nodes) {
      return EvaluateAs(std::move(choice), out);
    }
    Evaluated late, early;
    Choice early_choice = choice;
    early_choice.early_triggers = true;
    absl::Status status = EvaluateAs(std::move(choice), &late);
    if (!status.ok()) return status;
    if (late.excess <= 0) {
      *out = std::move(late);
      return absl::OkStatus();
    }
    status = EvaluateAs(std::move(early_choice), &early);
    if (!status.ok()) return status;
    const bool better = early.excess < late.excess ||
                        (early.excess == late.excess && early.overshoot < late.overshoot);
    *out = std::move(better ? early : late);
    return absl::OkStatus();
  }

  absl::Status EvaluateAs(Choice choice, Evaluated* out) {
    const auto start = std::chrono::steady_clock::now();
    for (std::vector<int>* v : {&choice.recompute, &choice.swap, &choice.loop_swap}) {
      std::sort(v->begin(), v->end());
      v->erase(std::unique(v->begin(), v->end()), v->end());
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
    status = Simulate(work_, out->order,
                      allocator_ ? options_.simulation : SimulationOptions(), &out->simulation);
    Unapply();
    if (!status.ok()) return status;
    ++plan_->simulations;
    rewrite_seconds_ += std::chrono::duration<double>(built - start).count();
    simulate_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - built).count();
    out->cloned = applied_recompute_.cloned;
    out->swapped = applied_swap_.swapped;
    out->excess = Excess(out->simulation, options_.budget_bytes, &out->worst_device);
    out->overshoot = Overshoot(out->simulation, options_.budget_bytes);
    out->seconds = applied_recompute_.added_seconds;
    for (int t : out->swapped) out->seconds += SwapSeconds(t);
    out->seconds += applied_loop_swap_.copy_seconds * LoopCopyExposure();
    return absl::OkStatus();
  }

  enum class Kind { kRecompute, kSwap, kLoopSwap };
  // Choices that the final cleanup may take back, one group at a time.
  struct Group {
    Kind kind;
    std::vector<int> items;  // nodes to recompute, or tensors to swap
    double seconds;
  };

  // Greedy descent from `fixed` plus `groups`; recompute candidates only if
  // `recompute`. Groups the budget turns out not to need are dropped at the end.
  absl::Status Descend(const Choice& fixed, std::vector<Group> groups, bool recompute,
                       Evaluated* best);
  // Makes Descend take only choices that lower the peak (not those that lower
  // just the live bytes above the budget at other steps).
  void set_peak_only(bool peak_only) { peak_only_ = peak_only; }

  // The allocator model costs as much as the rest of a simulation, so the search
  // runs on live bytes first and turns it on once those fit (or cannot).
  bool HasAllocatorModel() const {
    for (int64_t limit : options_.simulation.bfc_memory_limit) {
      if (limit > 0) return true;
    }
    return false;
  }
  absl::Status UseAllocatorModel(Evaluated* state) {
    if (allocator_ || !HasAllocatorModel()) return absl::OkStatus();
    allocator_ = true;
    Evaluated again;
    absl::Status status = Evaluate(state->choice, &again);
    if (status.ok()) *state = std::move(again);
    return status;
  }
  absl::Status EvaluateWithAllocator(Choice choice, Evaluated* out) {
    allocator_ = true;
    return Evaluate(std::move(choice), out);
  }
  // AUTO on small graphs: the cheapest set of recompute candidates (by added
  // seconds) whose simulated peak fits the budget, if one costs less than
  // `bound`. Sets *complete when the search proved that (it found the cheapest,
  // or that none cheaper than `bound` fits); false when it was not run (too many
  // candidates, too big a graph) or ran out of simulations.
  absl::Status ExactSearch(double bound, Evaluated* found, bool* complete);
  // SQRT's recompute set, one group per segment between checkpoints.
  absl::Status SqrtChoice(std::vector<Group>* segments);
  absl::Status ManualChoice(Choice* choice);

 private:
  struct Candidate {
    Kind kind = Kind::kRecompute;
    std::vector<int> nodes;    // the closure to recompute, or the swapped tensor's producer
    std::vector<int> tensors;  // swapped tensors
    std::vector<int> anchors;  // producers of the live tensors a closure starts from
    int64_t gain = 0;
    double seconds = 0;
    int owner = 0;  // tie-break
  };
  absl::Status Candidates(const Evaluated& state, bool recompute, std::vector<Candidate>* out);


 public:
  SwapOptions SwapOptionsFor() const {
    SwapOptions swap = options_.swap;
    if (swap.bandwidth_bytes_per_sec <= 0) {
      // One bandwidth per plan; a graph on a GPU copies at the GPU's.
      bool gpu = false;
      for (const std::string& device : table_.devices) gpu |= absl::StartsWith(device, "GPU");
      swap.bandwidth_bytes_per_sec = DefaultHostBandwidth(gpu ? "GPU:0" : "CPU:0");
    }
    return swap;
  }

 private:
  // One exposure for a plan's loop copies: the first device's (loops run where
  // their lists are).
  double LoopCopyExposure() const {
    return CopyExposure(table_.devices.empty() ? std::string() : table_.devices.front());
  }
  double SwapSeconds(int tensor) const {
    const TensorInfo& t = table_.tensors[tensor];
    const std::string& device = table_.nodes[t.node].device;
    return 2.0 * static_cast<double>(t.bytes) / SwapOptionsFor().bandwidth_bytes_per_sec *
           CopyExposure(device);
  }

  const TensorTable& table_;
  const std::vector<int>& order_;
  const ControlFlowInfo& flow_;
  const MemoryPlannerOptions& options_;
  MemoryPlan* plan_;
  std::vector<bool> recomputable_;
  std::vector<bool> pinned_;  // per buffer: an input of an AddN of 3+ inputs
  std::vector<std::vector<int>> tensors_of_buffer_;
  bool allocator_ = false;
  bool peak_only_ = false;
  // The base table, with the choice being evaluated applied in place.
  TensorTable work_;
  RecomputeRewrite applied_recompute_;
  SwapRewrite applied_swap_;
  LoopSwapRewrite applied_loop_swap_;
  TableEdit recompute_edit_, swap_edit_, loop_swap_edit_;

 public:
  double rewrite_seconds_ = 0, simulate_seconds_ = 0;
};

absl::Status Planner::Candidates(const Evaluated& state, bool recompute,
                                 std::vector<Candidate>* out) {
  out->clear();
  if (state.worst_device < 0) return absl::OkStatus();
  const DeviceTimeline& timeline = state.simulation.devices[state.worst_device];
  const int peak_step = timeline.peak_step;
  if (peak_step < 0) return absl::OkStatus();
  absl::Status status = Apply(state.choice);
  if (!status.ok()) {
    Unapply();
    return status;
  }
  const TensorTable& now = work_;
  std::vector<int> position(now.nodes.size(), -1);
  for (size_t s = 0; s < state.order.size(); ++s) position[state.order[s]] = static_cast<int>(s);
  std::vector<bool> live(now.buffers.size(), false);
  for (int b : timeline.live_at_peak) live[b] = true;
  std::vector<bool> chosen(table_.nodes.size(), false);
  for (int r : state.choice.recompute) chosen[r] = true;
  std::vector<bool> swapped(table_.tensors.size(), false);
  for (int t : state.choice.swap) swapped[t] = true;
  const bool can_swap =
      options_.enable_swap && (options_.max_swapped_tensors <= 0 ||
                               static_cast<int64_t>(state.choice.swap.size()) <
                                   options_.max_swapped_tensors);
  const int base_nodes = static_cast<int>(table_.nodes.size());
  const int base_buffers = static_cast<int>(table_.buffers.size());

  if (options_.enable_swap) {
    // The loops' accumulators (plan/loop_candidates.h).
    for (const LoopSwapCandidate& c :
         LoopSwapCandidates(table_, timeline.live_at_peak, state.choice.loop_swap,
                            options_.min_tensor_bytes, SwapOptionsFor().bandwidth_bytes_per_sec,
                            LoopCopyExposure())) {
      Candidate swap;
      swap.kind = Kind::kLoopSwap;
      swap.owner = table_.loops.lists[c.list].enter;
      swap.tensors = {c.list};
      swap.gain = c.gain;
      swap.seconds = c.seconds;
      out->push_back(std::move(swap));
    }
  }
  std::vector<bool> in_closure(table_.nodes.size(), false);
  for (int b : timeline.live_at_peak) {
    if (b >= base_buffers || table_.buffers[b].persistent) continue;
    const int owner_node = table_.tensors[table_.buffers[b].owner].node;
    if (chosen[owner_node] || table_.nodes[owner_node].backward ||
        table_.buffers[b].bytes < options_.min_tensor_bytes || position[owner_node] >= peak_step) {
      continue;
    }
    // Held at the peak only for backward readers (or clones) that run later?
    bool held_for_backward = false, needed_anyway = false, already_swapped = false;
    std::vector<int> producers = {owner_node};
    std::vector<int> late_tensors;
    for (int t : tensors_of_buffer_[b]) {
      already_swapped = already_swapped || swapped[t];
      bool late_reader = false;
      for (int c : now.tensors[t].consumers) {
        if (position[c] < peak_step) continue;
        if (c < base_nodes ? ReadsRecomputedValues(table_, flow_, c)
                           : now.nodes[c].backward && !absl::StartsWith(now.nodes[c].def->name(),
                                                                         kSwapOutScope)) {
          late_reader = true;
        } else {
          needed_anyway = true;
        }
      }
      if (late_reader) {
        held_for_backward = true;
        late_tensors.push_back(t);
        const int producer = table_.tensors[t].node;
        if (producer != owner_node) producers.push_back(producer);
      }
    }
    for (int t : table_.fetch_tensors) {
      if (table_.tensors[t].buffer == b) needed_anyway = true;
    }
    if (!held_for_backward || needed_anyway || already_swapped) continue;

    if (can_swap) {
      bool ok = true;
      for (int t : late_tensors) ok = ok && Swappable(table_, flow_, options_, t);
      ok = ok && !pinned_[b];
      if (ok) {
        Candidate swap;
        swap.kind = Kind::kSwap;
        swap.owner = owner_node;
        swap.nodes = {owner_node};
        swap.tensors = late_tensors;
        swap.gain = table_.buffers[b].bytes;
        for (int t : late_tensors) swap.seconds += SwapSeconds(t);
        swap.seconds += 1e-7;
        out->push_back(std::move(swap));
      }
    }

    if (!recompute || !options_.enable_recompute) continue;
    bool ok = true;
    for (int p : producers) ok = ok && recomputable_[p] && !chosen[p];
    if (!ok) continue;
    Candidate candidate;
    candidate.owner = owner_node;
    candidate.gain = table_.buffers[b].bytes;
    std::vector<int> work = producers;
    for (int p : producers) in_closure[p] = true;
    std::set<int> kept_alive;
    for (size_t i = 0; i < work.size(); ++i) {
      for (int u : table_.nodes[work[i]].inputs) {
        const int p = table_.tensors[u].node;
        if (in_closure[p] || chosen[p]) continue;
        const int ub = table_.tensors[u].buffer;
        if (table_.buffers[ub].persistent) continue;
        if (live[ub]) {
          candidate.anchors.push_back(p);
          continue;
        }
        if (recomputable_[p] && table_.tensors[u].bytes >= options_.min_tensor_bytes &&
            work.size() < 64) {
          in_closure[p] = true;
          work.push_back(p);
        } else if (pinned_[ub]) {
          candidate.gain = 0;  // would keep an AddN input alive: not a candidate
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
  Unapply();
  std::sort(out->begin(), out->end(), [](const Candidate& a, const Candidate& b) {
    const double sa = a.gain / a.seconds, sb = b.gain / b.seconds;
    if (sa != sb) return sa > sb;
    if (a.owner != b.owner) return a.owner < b.owner;
    return a.kind < b.kind;
  });
  return absl::OkStatus();
}

absl::Status Planner::Descend(const Choice& fixed, std::vector<Group> groups, bool recompute,
                              Evaluated* best) {
  auto combined = [&](const std::vector<bool>* dropped) {
    Choice choice = fixed;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (dropped != nullptr && (*dropped)[g]) continue;
      std::vector<int>& into = groups[g].kind == Kind::kSwap       ? choice.swap
                               : groups[g].kind == Kind::kLoopSwap ? choice.loop_swap
                                                                   : choice.recompute;
      into.insert(into.end(), groups[g].items.begin(), groups[g].items.end());
    }
    return choice;
  };
  Evaluated state;
  absl::Status status = Evaluate(combined(nullptr), &state);
  if (!status.ok()) return status;
  std::vector<Candidate> candidates;
  auto improves = [this](const Evaluated& next, const Evaluated& now) {
    return next.excess < now.excess ||
           (!peak_only_ && next.excess == now.excess && next.overshoot < now.overshoot);
  };
  auto with = [](const Choice& base, const Candidate& c) {
    Choice next = base;
    std::vector<int>& into = c.kind == Kind::kSwap       ? next.swap
                             : c.kind == Kind::kLoopSwap ? next.loop_swap
                                                         : next.recompute;
    const std::vector<int>& items = c.kind == Kind::kRecompute ? c.nodes : c.tensors;
    into.insert(into.end(), items.begin(), items.end());
    return next;
  };
  auto group_of = [](const Candidate& c) {
    return Group{c.kind, c.kind == Kind::kRecompute ? c.nodes : c.tensors, c.seconds};
  };
  while (plan_->simulations < options_.max_simulations) {
    if (state.excess <= 0) {
      if (allocator_ || !HasAllocatorModel()) break;
      status = UseAllocatorModel(&state);
      if (!status.ok()) return status;
      continue;
    }
    status = Candidates(state, recompute, &candidates);
    if (!status.ok()) return status;
    VLOG(2) << "TfMemOpt plan: " << state.choice.recompute.size() << " recomputed, "
            << state.choice.swap.size() << " swapped, excess " << state.excess
            << ", overshoot " << state.overshoot << ", " << candidates.size() << " candidates";
    if (candidates.empty()) break;
    // First several at once: the best until their estimated savings cover the
    // excess. Each estimate assumes its anchors stay, so a batch never drops
    // another member's anchor.
    std::vector<bool> taken(table_.nodes.size(), false), anchored(table_.nodes.size(), false);
    Choice next_choice = state.choice;
    std::vector<int> batch;
    int64_t saved = 0;
    int64_t swaps_left = options_.max_swapped_tensors > 0
                             ? options_.max_swapped_tensors -
                                   static_cast<int64_t>(state.choice.swap.size())
                             : INT64_MAX;
    for (size_t i = 0; i < candidates.size() && batch.size() < 64; ++i) {
      const Candidate& c = candidates[i];
      if (c.kind == Kind::kSwap) {
        if (static_cast<int64_t>(c.tensors.size()) > swaps_left) continue;
        swaps_left -= static_cast<int64_t>(c.tensors.size());
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
    for (size_t i = 0; i < candidates.size() && i < 6 &&
                       plan_->simulations < options_.max_simulations;
         ++i) {
      if (candidates[i].kind == Kind::kSwap && options_.max_swapped_tensors > 0 &&
          static_cast<int64_t>(state.choice.swap.size() + candidates[i].tensors.size()) >
              options_.max_swapped_tensors) {
        continue;
      }
      Evaluated trial;
      status = Evaluate(with(state.choice, candidates[i]), &trial);
      if (!status.ok()) return status;
      VLOG(2) << "  trial " << (candidates[i].kind == Kind::kSwap ? "swap " : "recompute ")
              << table_.nodes[candidates[i].owner].def->name() << " gain " << candidates[i].gain
              << " seconds " << candidates[i].seconds << ": excess " << trial.excess
              << ", overshoot " << trial.overshoot;
      if (!improves(trial, state)) continue;
      const double lowered = static_cast<double>(state.excess - trial.excess) * steps +
                             (state.overshoot - trial.overshoot);
      const double score = lowered / candidates[i].seconds;
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
  // then single recomputed nodes of what is left.
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
    std::vector<std::pair<int, int>> singles;  // (group, node), most expensive first
    for (size_t g = 0; g < groups.size(); ++g) {
      if (dropped[g] || groups[g].kind != Kind::kRecompute || groups[g].items.size() < 2) continue;
      for (int node : groups[g].items) singles.push_back({static_cast<int>(g), node});
    }
    std::stable_sort(singles.begin(), singles.end(), [&](const auto& a, const auto& b) {
      return table_.nodes[a.second].compute_seconds > table_.nodes[b.second].compute_seconds;
    });
    const int single_limit = plan_->simulations + 32;
    for (const auto& [g, node] : singles) {
      if (plan_->simulations >= single_limit) break;
      std::vector<int>& items = groups[g].items;
      auto it = std::find(items.begin(), items.end(), node);
      if (it == items.end()) continue;
      items.erase(it);
      Evaluated trial;
      status = Evaluate(combined(&dropped), &trial);
      if (!status.ok()) return status;
      if (trial.excess <= 0 && trial.seconds < state.seconds) {
        state = std::move(trial);
      } else {
        items.push_back(node);
      }
    }
  }
  *best = std::move(state);
  return absl::OkStatus();
}

absl::Status Planner::ExactSearch(double bound, Evaluated* found, bool* complete) {
  *complete = false;
  found->excess = 1;  // nothing found yet
  const int n = static_cast<int>(table_.nodes.size());
  if (options_.exact_max_candidates <= 0 || n > options_.exact_max_nodes) {
    return absl::OkStatus();
  }
  // Candidates: recomputable forward nodes whose clone a backward op would read,
  // directly or through the clone of a candidate they feed (RecomputeInPlace skips
  // the others). Visited consumers first.
  std::vector<bool> candidate(n, false), direct(n, false);
  std::vector<int> items;
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    const int node = *it;
    if (!recomputable_[node] || ReadsAddNInputEarly(node)) continue;
    bool big = false, read = false;
    for (int t : table_.nodes[node].outputs) {
      big = big || table_.tensors[t].bytes >= options_.min_tensor_bytes;
      for (int c : table_.tensors[t].consumers) {
        if (candidate[c]) read = true;
        if (ReadsRecomputedValues(table_, flow_, c)) direct[node] = read = true;
      }
    }
    if (!big || !read) continue;
    candidate[node] = true;
    items.push_back(node);
    // (At most 30: sets are bit masks, and 2^30 of them is past any useful effort.)
    if (static_cast<int>(items.size()) > std::min(options_.exact_max_candidates, 30)) {
      return absl::OkStatus();
    }
  }
  plan_->exact_candidates = static_cast<int>(items.size());
  if (items.empty()) {
    *complete = true;
    return absl::OkStatus();
  }
  // Cheapest first; ties by node index, so the search is deterministic.
  std::sort(items.begin(), items.end(), [&](int a, int b) {
    const double ca = table_.nodes[a].compute_seconds, cb = table_.nodes[b].compute_seconds;
    return ca != cb ? ca < cb : a < b;
  });
  const int k = static_cast<int>(items.size());
  auto cost_of = [&](uint64_t set) {
    double cost = 0;
    for (int i = 0; i < k; ++i) {
      if (set >> i & 1) cost += table_.nodes[items[i]].compute_seconds;
    }
    return cost;
  };
  // A set some member of which nobody would read from a clone plans the same as
  // the set without it, which costs no more and is enumerated too. `readers[i]`:
  // the items that read item i (later in the order: items were found consumers
  // first, so `by_order` lists them from the last).
  std::vector<int> slot(n, -1);
  for (int i = 0; i < k; ++i) slot[items[i]] = i;
  std::vector<int> by_order;
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    if (slot[*it] >= 0) by_order.push_back(slot[*it]);
  }
  std::vector<uint64_t> readers(k, 0);
  for (int i = 0; i < k; ++i) {
    for (int t : table_.nodes[items[i]].outputs) {
      for (int c : table_.tensors[t].consumers) {
        if (slot[c] >= 0) readers[i] |= uint64_t{1} << slot[c];
      }
    }
  }
  auto all_read = [&](uint64_t set) {
    uint64_t read = 0;
    for (int i : by_order) {
      if (!(set >> i & 1)) continue;
      if (!direct[items[i]] && !(readers[i] & read)) return false;
      read |= uint64_t{1} << i;
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
  const int64_t allowed = std::min<int64_t>(options_.exact_max_simulations,
                                            options_.exact_max_node_steps / n);
  const int64_t limit = plan_->simulations + allowed;
  for (int64_t popped = 0; !queue.empty(); ++popped) {
    // Sets skipped unsimulated cost little, but not nothing.
    if (popped >= 64 * allowed) return absl::OkStatus();
    const Entry e = queue.top();
    queue.pop();
    if (e.cost >= bound) break;  // nothing cheaper than the plan in hand is left
    if (e.last + 1 < k) {
      const uint64_t next = uint64_t{1} << (e.last + 1);
      queue.push({cost_of(e.set | next), e.set | next, e.last + 1});
      const uint64_t swapped = (e.set & ~(uint64_t{1} << e.last)) | next;
      queue.push({cost_of(swapped), swapped, e.last + 1});
    }
    if (!all_read(e.set)) continue;
    if (plan_->simulations >= limit) return absl::OkStatus();
    Choice choice;
    for (int i = 0; i < k; ++i) {
      if (e.set >> i & 1) choice.recompute.push_back(items[i]);
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

absl::Status Planner::SqrtChoice(std::vector<Group>* segments) {
  // Forward tensors big enough to matter, with the span of their forward readers.
  const int n = static_cast<int>(table_.nodes.size());
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
    const size_t step = static_cast<size_t>(
        std::ceil(std::sqrt(static_cast<double>(bottlenecks.size()))));
    for (size_t i = step - 1; i < bottlenecks.size(); i += step) {
      checkpoint[bottlenecks[i]] = true;
      plan_->checkpoints.push_back(bottlenecks[i]);
    }
  }
  segments->clear();
  Group segment{Kind::kRecompute, {}, 0};
  for (int node : forward_order) {
    if (checkpoint[node] && !segment.items.empty()) {
      segments->push_back(std::move(segment));
      segment = Group{Kind::kRecompute, {}, 0};
    }
    if (!recomputable_[node] || checkpoint[node] || ReadsAddNInputEarly(node)) continue;
    bool big = false;
    for (int t : table_.nodes[node].outputs) {
      big = big || table_.tensors[t].bytes >= options_.min_tensor_bytes;
    }
    if (!big) continue;
    segment.items.push_back(node);
    segment.seconds += table_.nodes[node].compute_seconds;
  }
  if (!segment.items.empty()) segments->push_back(std::move(segment));
  return absl::OkStatus();
}

absl::Status Planner::ManualChoice(Choice* choice) {
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
    std::string reason = NotRecomputableReason(table_, flow_, options_, static_cast<int>(i));
    if (reason.empty() && FeedsAddN(static_cast<int>(i))) reason = "feeds_addn";
    if (reason.empty() && ReadsAddNInputEarly(static_cast<int>(i))) reason = "reads_addn_input";
    if (!reason.empty()) {
      plan_->hinted_but_not_recomputable.push_back(absl::StrCat(def.name(), " (", reason, ")"));
      continue;
    }
    choice->recompute.push_back(static_cast<int>(i));
  }
  return absl::OkStatus();
}

}  // namespace

bool InScope(const std::string& name, const std::string& scope) {
  if (scope.empty()) return false;
  const std::string trimmed = scope.back() == '/' ? scope.substr(0, scope.size() - 1) : scope;
  return name == trimmed || absl::StartsWith(name, absl::StrCat(trimmed, "/"));
}

int64_t PredictedPeak(const DeviceTimeline& timeline) {
  return std::max(timeline.allocator_peak_bytes, timeline.peak_bytes);
}

double DefaultHostBandwidth(const std::string& device) {
  // CPU test bed: TfMemSwapOut/In at 128 MiB, median of warm runs, the slower
  // direction (python benchmarks/host_bandwidth.py). GPUs: an assumed effective
  // PCIe 3.0 x16 rate; set host_bandwidth_bytes_per_sec for your machine.
  return absl::StartsWith(device, "GPU") ? 12e9 : 3.65e9;
}

absl::Status PlanMemory(const TensorTable& table, const std::vector<int>& order,
                        const ControlFlowInfo& flow, const MemoryPlannerOptions& options,
                        MemoryPlan* plan, PlannedRewrite* rewrite, SimulationResult* simulation) {
  *plan = MemoryPlan();
  Planner planner(table, order, flow, options, plan);
  Choice fixed;
  std::vector<Planner::Group> groups;
  absl::Status status;
  if (options.enable_recompute && options.policy == RecomputePolicy::kSqrt) {
    std::vector<Planner::Group> segments;
    status = planner.SqrtChoice(&segments);
    for (const Planner::Group& segment : segments) {
      fixed.recompute.insert(fixed.recompute.end(), segment.items.begin(), segment.items.end());
    }
  } else if (options.enable_recompute && options.policy == RecomputePolicy::kManual) {
    status = planner.ManualChoice(&fixed);
  }
  if (!status.ok()) return status;
  if (!fixed.recompute.empty()) {
    // SQRT and MANUAL recompute what they are told; never at a higher peak than no
    // plan at all (then the graph's own schedule is better, and is kept).
    Evaluated none, told;
    status = planner.EvaluateWithAllocator(Choice(), &none);
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
        fixed.recompute.clear();
        plan->checkpoints.clear();
        break;
      }
    }
  }
  Evaluated best;
  const bool auto_recompute = options.enable_recompute && options.policy == RecomputePolicy::kAuto;
  if (auto_recompute || options.enable_swap) {
    status = planner.Descend(fixed, {}, auto_recompute, &best);
    if (!status.ok()) return status;
    if (auto_recompute && best.excess > 0) {
      // The greedy descent can get stuck where only a coordinated change helps (long
      // chains: dropping one more checkpoint alone lowers nothing). Start again from
      // SQRT's segments, and let the cleanup give back the segments not needed.
      const size_t checkpoints = plan->checkpoints.size();
      std::vector<Planner::Group> segments;
      status = planner.SqrtChoice(&segments);
      if (!status.ok()) return status;
      plan->checkpoints.resize(checkpoints);  // AUTO reports no SQRT checkpoints
      Evaluated from_sqrt;
      status = planner.Descend(fixed, std::move(segments), true, &from_sqrt);
      if (!status.ok()) return status;
      const bool better = from_sqrt.excess <= 0
                              ? (best.excess > 0 || from_sqrt.seconds < best.seconds)
                              : from_sqrt.excess < best.excess;
      if (better) best = std::move(from_sqrt);
    }
    if (auto_recompute) {
      // Small graphs: the exact search, bounded by the greedy plan's cost when that
      // fits, on the allocator model where there is one (the greedy plan's was).
      // Swaps are the greedy descent's alone; its plan stands unless a cheaper
      // recompute-only plan fits.
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
        (!best.choice.recompute.empty() || !best.choice.swap.empty() ||
         !best.choice.loop_swap.empty())) {
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
        status = planner.Descend(fixed, {}, auto_recompute, &lower);
        planner.set_peak_only(false);
        if (!status.ok()) return status;
        if (lowers(lower)) best = std::move(lower);
      }
      if (!lowers(best)) {
        plan->note = fixed.recompute.empty()
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
          << planner.rewrite_seconds_ << " s, simulating " << planner.simulate_seconds_ << " s";
  status = BuildRecomputeRewrite(table, order, flow, best.choice.recompute, &rewrite->recompute,
                                 best.choice.early_triggers);
  if (!status.ok()) return status;
  status = BuildSwapRewrite(std::move(rewrite->recompute.table), rewrite->recompute.order, flow,
                            best.choice.swap, planner.SwapOptionsFor(), &rewrite->swap);
  if (!status.ok()) return status;
  status = BuildLoopSwapRewrite(std::move(rewrite->swap.table), rewrite->swap.order,
                                best.choice.loop_swap,
                                planner.SwapOptionsFor().bandwidth_bytes_per_sec,
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
