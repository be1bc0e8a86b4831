#include "grappler/plan/recompute_choice.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {

using tensorflow::NodeDef;

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
    // A read of a tf.compat.v1 reference variable (VariableV2 through its Identity
    // `read`) shares the variable's buffer, which the optimizer updates in place: a
    // clone run later could see the updated weights.
    const int owner = table.buffers[table.tensors[t].buffer].owner;
    if (owner >= 0 && tensorflow::IsRefType(table.tensors[owner].dtype)) {
      return "reads_reference_variable";
    }
  }
  for (int t : node.outputs) {
    const TensorInfo& tensor = table.tensors[t];
    if (!PlainType(tensor.dtype)) return "non_plain_dtype";
    if (!tensor.size_known) return "unknown_size";
    if (table.buffers[tensor.buffer].persistent) return "persistent";
  }
  return FilterReason(def, options);
}

RecomputeChoice::RecomputeChoice(const PlanContext& context, MemoryPlan* plan)
    : ctx_(context), plan_(plan) {
  const TensorTable& table = ctx_.table;
  const int n = static_cast<int>(table.nodes.size());
  recomputable_.assign(n, false);
  for (int i = 0; i < n; ++i) {
    if (table.nodes[i].backward) continue;
    std::string reason = NotRecomputableReason(table, ctx_.flow, ctx_.options, i);
    if (reason.empty() && ctx_.FeedsAddN(i)) reason = "feeds_addn";
    if (reason.empty()) {
      recomputable_[i] = true;
    } else if (reason != "input_or_structural") {
      ++plan->left_alone[reason];
    }
  }
  chosen_.assign(n, false);
  in_closure_.assign(n, false);
  direct_.assign(n, false);
}

absl::Status RecomputeChoice::Apply(TensorTable* work, const std::vector<int>& order,
                                    const std::vector<int>& items, bool variant) {
  return RecomputeInPlace(work, order, ctx_.flow, items, &applied_, &edit_,
                          variant ? ClonePlacement::kEarlier : ClonePlacement::kAtReaderInput);
}

absl::Status RecomputeChoice::ApplyPinned(TensorTable* work, const std::vector<int>& order,
                                          const std::vector<int>& items, int readers_from) {
  return RecomputeInPlace(work, order, ctx_.flow, items, &applied_, &edit_,
                          ClonePlacement::kBeforeReader, readers_from);
}

void RecomputeChoice::BeginProposals(const std::vector<int>& items) {
  std::fill(chosen_.begin(), chosen_.end(), false);
  for (int r : items) chosen_[r] = true;
}

bool RecomputeChoice::Covers(int buffer) const {
  const TensorTable& table = ctx_.table;
  return chosen_[table.tensors[table.buffers[buffer].owner].node];
}

void RecomputeChoice::Propose(const PeakView& view, const Holding& holding, int self,
                              std::vector<Candidate>* out) {
  const TensorTable& table = ctx_.table;
  const MemoryPlannerOptions& options = ctx_.options;
  if (!options.enable_recompute) return;
  for (int p : holding.producers) {
    if (!recomputable_[p] || chosen_[p]) return;
  }
  Candidate candidate;
  candidate.mechanism = self;
  candidate.owner = holding.owner_node;
  candidate.gain = table.buffers[holding.buffer].bytes;
  std::vector<int> work = holding.producers;
  for (int p : holding.producers) in_closure_[p] = true;
  std::set<int> kept_alive;
  for (size_t i = 0; i < work.size(); ++i) {
    for (int u : table.nodes[work[i]].inputs) {
      const int p = table.tensors[u].node;
      if (in_closure_[p] || chosen_[p]) continue;
      const int ub = table.tensors[u].buffer;
      if (table.buffers[ub].persistent) continue;
      if (view.live[ub]) {
        candidate.anchors.push_back(p);
        continue;
      }
      if (recomputable_[p] && table.tensors[u].bytes >= options.min_tensor_bytes &&
          work.size() < 64) {
        in_closure_[p] = true;
        work.push_back(p);
      } else if (ctx_.pinned[ub]) {
        candidate.gain = 0;  // would keep an AddN input alive: not a candidate
      } else if (kept_alive.insert(ub).second) {
        candidate.gain -= table.buffers[ub].bytes;
      }
    }
  }
  for (int p : work) in_closure_[p] = false;
  if (candidate.gain <= 0) return;
  for (int p : work) candidate.seconds += table.nodes[p].compute_seconds + 1e-7;
  candidate.nodes = work;
  candidate.items = std::move(work);
  out->push_back(std::move(candidate));
}

double RecomputeChoice::ItemSeconds(int item) const {
  return ctx_.table.nodes[item].compute_seconds;
}

bool RecomputeChoice::ExactItems(int limit, std::vector<int>* items) {
  // Recomputable forward nodes whose clone a backward op would read, directly or
  // through the clone of a candidate they feed (RecomputeInPlace skips the
  // others), in some placement. Visited consumers first.
  const TensorTable& table = ctx_.table;
  const int n = static_cast<int>(table.nodes.size());
  items->clear();
  std::vector<bool> candidate(n, false);
  std::fill(direct_.begin(), direct_.end(), false);
  for (auto it = ctx_.order.rbegin(); it != ctx_.order.rend(); ++it) {
    const int node = *it;
    if (!recomputable_[node] || ctx_.ReadsAddNInputEarly(node)) continue;
    bool big = false, read = false;
    for (int t : table.nodes[node].outputs) {
      big = big || table.tensors[t].bytes >= ctx_.options.min_tensor_bytes;
      for (int c : table.tensors[t].consumers) {
        if (candidate[c]) read = true;
        // A backward reader that only the pinned placement serves (ReadsClonesWhenPinned)
        // counts: the planner simulates small graphs' plans pinned too.
        if (ReadsClonesWhenPinned(table, ctx_.flow, c)) direct_[node] = read = true;
      }
    }
    if (!big || !read) continue;
    candidate[node] = true;
    items->push_back(node);
    if (static_cast<int>(items->size()) > limit) return false;
  }
  return true;
}

std::function<bool(uint64_t)> RecomputeChoice::ExactFilter(
    const std::vector<std::pair<int, int>>& items, int self) const {
  // A set some member of which nobody would read from a clone plans the same as
  // the set without it, which costs no more and is enumerated too. `readers[i]`:
  // the items that read item i (later in the order: items were found consumers
  // first, so `by_order` lists them from the last).
  const TensorTable& table = ctx_.table;
  const int k = static_cast<int>(items.size());
  std::vector<int> slot(table.nodes.size(), -1);
  for (int i = 0; i < k; ++i) {
    if (items[i].first == self) slot[items[i].second] = i;
  }
  std::vector<int> by_order;
  for (auto it = ctx_.order.rbegin(); it != ctx_.order.rend(); ++it) {
    if (slot[*it] >= 0) by_order.push_back(slot[*it]);
  }
  std::vector<uint64_t> readers(k, 0);
  std::vector<bool> direct(k, false);
  for (int i = 0; i < k; ++i) {
    if (items[i].first != self) continue;
    direct[i] = direct_[items[i].second];
    for (int t : table.nodes[items[i].second].outputs) {
      for (int c : table.tensors[t].consumers) {
        if (slot[c] >= 0) readers[i] |= uint64_t{1} << slot[c];
      }
    }
  }
  return [by_order = std::move(by_order), readers = std::move(readers),
          direct = std::move(direct)](uint64_t set) {
    uint64_t read = 0;
    for (int i : by_order) {
      if (!(set >> i & 1)) continue;
      if (!direct[i] && !(readers[i] & read)) return false;
      read |= uint64_t{1} << i;
    }
    return true;
  };
}

void RecomputeChoice::SqrtSegments(std::vector<std::vector<int>>* segments) {
  // Forward tensors big enough to matter, with the span of their forward readers.
  const TensorTable& table = ctx_.table;
  const int n = static_cast<int>(table.nodes.size());
  std::vector<int> forward_order;
  for (int node : ctx_.order) {
    if (!table.nodes[node].backward) forward_order.push_back(node);
  }
  const int f = static_cast<int>(forward_order.size());
  std::vector<int> rank(n, -1);
  for (int i = 0; i < f; ++i) rank[forward_order[i]] = i;
  // open_count[i]: big tensors produced at rank <= i and read at rank > i; their
  // index sum identifies the tensor when exactly one is open.
  std::vector<int64_t> open_count(f + 1, 0), open_sum(f + 1, 0);
  for (size_t t = 0; t < table.tensors.size(); ++t) {
    const TensorInfo& tensor = table.tensors[t];
    const int p = rank[tensor.node];
    if (p < 0 || table.buffers[tensor.buffer].persistent ||
        tensor.bytes < ctx_.options.min_tensor_bytes) {
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
    if (table.tensors[t].node == forward_order[i]) bottlenecks.push_back(forward_order[i]);
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
  std::vector<int> segment;
  for (int node : forward_order) {
    if (checkpoint[node] && !segment.empty()) {
      segments->push_back(std::move(segment));
      segment.clear();
    }
    if (!recomputable_[node] || checkpoint[node] || ctx_.ReadsAddNInputEarly(node)) continue;
    bool big = false;
    for (int t : table.nodes[node].outputs) {
      big = big || table.tensors[t].bytes >= ctx_.options.min_tensor_bytes;
    }
    if (!big) continue;
    segment.push_back(node);
  }
  if (!segment.empty()) segments->push_back(std::move(segment));
}

void RecomputeChoice::ManualItems(std::vector<int>* items) {
  const TensorTable& table = ctx_.table;
  for (size_t i = 0; i < table.nodes.size(); ++i) {
    const NodeDef& def = *table.nodes[i].def;
    const bool hinted = def.attr().count("_recompute_hint") > 0 ||
                        def.attr().count("_tfmemopt_recompute") > 0 ||
                        MatchesAnyScope(def.name(), ctx_.options.hint_scopes);
    if (!hinted) continue;
    if (table.nodes[i].backward) {
      plan_->hinted_but_not_recomputable.push_back(absl::StrCat(def.name(), " (backward)"));
      continue;
    }
    const int node = static_cast<int>(i);
    std::string reason = NotRecomputableReason(table, ctx_.flow, ctx_.options, node);
    if (reason.empty() && ctx_.FeedsAddN(node)) reason = "feeds_addn";
    if (reason.empty() && ctx_.ReadsAddNInputEarly(node)) reason = "reads_addn_input";
    if (!reason.empty()) {
      plan_->hinted_but_not_recomputable.push_back(absl::StrCat(def.name(), " (", reason, ")"));
      continue;
    }
    items->push_back(node);
  }
}

}  // namespace tfmemopt
