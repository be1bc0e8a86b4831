#include "grappler/plan/schedule.h"

#include <algorithm>
#include <climits>
#include <deque>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/plan/memory_planner.h"
#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {
namespace {

// Largest buffers live at a target step that are looked at, and nodes that free
// one of them that are tried as the point to wait for.
constexpr int kLiveBuffersTried = 6;
constexpr int kFreersTried = 2;
// Nodes visited when walking up an independent branch to its first node.
constexpr int kBranchWalkLimit = 200;

bool Schedulable(const TensorTable& table, const ControlFlowInfo& flow, int n) {
  const NodeInfo& node = table.nodes[n];
  const tensorflow::NodeDef& def = *node.def;
  if (node.stateful || flow.Under(n)) return false;
  if (tensorflow::grappler::IsControlFlow(def) || tensorflow::grappler::IsConstant(def)) {
    return false;
  }
  const std::string& op = def.op();
  if (op == "_Arg" || op == "_Retval" || op == "Placeholder" ||
      op == "PlaceholderWithDefault" || op == "NoOp") {
    return false;
  }
  return !absl::StartsWith(def.name(), "TfMemOpt/");
}

// What a candidate order is judged by, per device: the peak, and the peak of the
// backward pass's transient bytes (which neither swap nor recompute removes).
struct Score {
  std::vector<int64_t> peak, backward;
};

Score ScoreOf(const SimulationResult& simulation, bool allocator) {
  Score score;
  for (const DeviceTimeline& t : simulation.devices) {
    score.peak.push_back(allocator ? PredictedPeak(t) : t.peak_bytes);
    int64_t backward = 0;
    for (int64_t bytes : t.gradient_bytes) backward = std::max(backward, bytes);
    score.backward.push_back(backward);
  }
  return score;
}

// Neither figure rises on any device, and one drops by at least `min_gain` bytes
// somewhere (an edge that saves less is not worth constraining the executor).
bool Lowers(const Score& after, const Score& before, int64_t min_gain) {
  bool lower = false;
  for (size_t d = 0; d < before.peak.size(); ++d) {
    if (after.peak[d] > before.peak[d] || after.backward[d] > before.backward[d]) return false;
    lower = lower || before.peak[d] - after.peak[d] >= min_gain ||
            before.backward[d] - after.backward[d] >= min_gain;
  }
  return lower;
}

// Bytes saved: the peak first, the backward peak second.
std::pair<int64_t, int64_t> Gain(const Score& after, const Score& before) {
  int64_t peak = 0, backward = 0;
  for (size_t d = 0; d < before.peak.size(); ++d) {
    peak += before.peak[d] - after.peak[d];
    backward += before.backward[d] - after.backward[d];
  }
  return {peak, backward};
}

class Scheduler {
 public:
  Scheduler(const TensorTable& table, const ControlFlowInfo& flow,
            const ScheduleOptions& options, Schedule* schedule)
      : work_(table), flow_(flow), options_(options), schedule_(schedule) {
    const int n = static_cast<int>(table.nodes.size());
    successors_.resize(n);
    predecessors_.resize(n);
    for (int i = 0; i < n; ++i) {
      for (int t : table.nodes[i].inputs) AddAdjacency(table.tensors[t].node, i);
      for (int c : table.nodes[i].control_inputs) AddAdjacency(c, i);
    }
    tensors_of_buffer_.resize(table.buffers.size());
    for (size_t t = 0; t < table.tensors.size(); ++t) {
      tensors_of_buffer_[table.tensors[t].buffer].push_back(static_cast<int>(t));
    }
    fetched_.assign(table.buffers.size(), false);
    for (int t : table.fetch_tensors) fetched_[table.tensors[t].buffer] = true;
    for (int i = 0; i < n; ++i) {
      if (table.nodes[i].def->op() == "AddN" && table.nodes[i].inputs.size() >= 3) {
        addn_.push_back(i);
      }
    }
  }

  absl::Status Run(const SimulationResult& before) {
    order_ = before.order;
    full_ = ScoreOf(before, true);
    schedule_->peak_before = full_.peak;
    absl::Status status = Simulate(work_, order_, SimulationOptions(), &cheap_);
    if (!status.ok()) return status;
    schedule_->backward_peak_before = full_.backward;
    signature_ = AddNSignature(order_);
    schedule_->simulation = before;
    while (static_cast<int>(schedule_->edges.size()) < options_.max_edges &&
           schedule_->simulations < options_.max_simulations) {
      bool kept = false;
      status = Step(&kept);
      if (!status.ok()) return status;
      if (!kept) break;
    }
    status = Prune();
    if (!status.ok()) return status;
    schedule_->order = order_;
    schedule_->peak_after = full_.peak;
    schedule_->backward_peak_after = full_.backward;
    return absl::OkStatus();
  }

 private:
  struct Candidate {
    int from, to;
    Score score;
    std::vector<int> order;
  };

  void AddAdjacency(int from, int to) {
    successors_[from].push_back(to);
    predecessors_[to].push_back(from);
  }

  // Nodes reachable from `start` along `edges` (start included).
  std::vector<char> Reach(const std::vector<std::vector<int>>& edges, int start) const {
    std::vector<char> seen(edges.size(), 0);
    std::vector<int> stack = {start};
    seen[start] = 1;
    while (!stack.empty()) {
      const int n = stack.back();
      stack.pop_back();
      for (int next : edges[n]) {
        if (!seen[next]) {
          seen[next] = 1;
          stack.push_back(next);
        }
      }
    }
    return seen;
  }

  // For every input of every multi-input AddN: whether the AddN is the last reader
  // of its buffer in `order` (then TF's AddN may sum into it).
  std::vector<char> AddNSignature(const std::vector<int>& order) const {
    std::vector<int> position(work_.nodes.size());
    for (size_t s = 0; s < order.size(); ++s) position[order[s]] = static_cast<int>(s);
    std::vector<char> signature;
    for (int a : addn_) {
      for (int t : work_.nodes[a].inputs) {
        const int b = work_.tensors[t].buffer;
        bool last = !fetched_[b] && !work_.buffers[b].persistent && !work_.buffers[b].external;
        for (int other : tensors_of_buffer_[b]) {
          for (int consumer : work_.tensors[other].consumers) {
            last = last && (consumer == a || position[consumer] < position[a]);
          }
        }
        signature.push_back(last);
      }
    }
    return signature;
  }

  // Buffers on `device` live at `step` of the current order, largest first: made at
  // or before the step and read at or after it; with `gradients_only`, those of the
  // backward pass's own tensors (what the backward peak counts: at a ResNet's
  // projection block the forward activations kept for the gradient are as large
  // as the gradients, and would crowd them out of the kLiveBuffersTried).
  std::vector<int> LiveBuffers(int step, const std::string& device,
                               const std::vector<int>& position, bool gradients_only,
                               std::vector<int>* last_reader) const {
    std::vector<int> live;
    last_reader->assign(work_.buffers.size(), -1);
    for (size_t b = 0; b < work_.buffers.size(); ++b) {
      const BufferInfo& buffer = work_.buffers[b];
      if (buffer.persistent || buffer.external || buffer.released_by >= 0 || buffer.bytes == 0 ||
          buffer.device != device ||
          (gradients_only && work_.tensors[buffer.owner].role != TensorRole::kGradient)) {
        continue;
      }
      const int producer = work_.tensors[buffer.owner].node;
      if (position[producer] > step) continue;
      int last = -1;
      for (int t : tensors_of_buffer_[b]) {
        for (int consumer : work_.tensors[t].consumers) {
          if (position[consumer] > position[producer] &&
              (last < 0 || position[consumer] > position[last])) {
            last = consumer;
          }
        }
      }
      (*last_reader)[b] = last;
      if (fetched_[b] || (last >= 0 && position[last] >= step)) live.push_back(b);
    }
    std::sort(live.begin(), live.end(), [&](int a, int b) {
      if (work_.buffers[a].bytes != work_.buffers[b].bytes) {
        return work_.buffers[a].bytes > work_.buffers[b].bytes;
      }
      return a < b;
    });
    if (live.size() > kLiveBuffersTried) live.resize(kLiveBuffersTried);
    return live;
  }

  // The first node (in `position`) of the branch that `node` is on, walking up
  // through nodes that `anchor` does not depend on, of the same pass and device.
  int BranchStart(int node, const std::vector<char>& ancestors_of_anchor,
                  const std::vector<int>& position) const {
    int first = node;
    std::vector<char> seen(work_.nodes.size(), 0);
    std::deque<int> queue = {node};
    seen[node] = 1;
    int visited = 0;
    while (!queue.empty() && visited++ < kBranchWalkLimit) {
      const int n = queue.front();
      queue.pop_front();
      if (position[n] < position[first]) first = n;
      for (int p : predecessors_[n]) {
        if (seen[p] || ancestors_of_anchor[p] || !Schedulable(work_, flow_, p) ||
            work_.nodes[p].backward != work_.nodes[node].backward ||
            work_.nodes[p].device != work_.nodes[node].device) {
          continue;
        }
        seen[p] = 1;
        queue.push_back(p);
      }
    }
    return first;
  }

  // Candidate edges at `step` of the current order, for buffers on `device` (only
  // the backward pass's own with `gradients_only`).
  void CandidatesAt(int step, const std::string& device, const std::vector<int>& position,
                    bool gradients_only, std::set<std::pair<int, int>>* edges) const {
    const int anchor = order_[step];
    const std::vector<char> ancestors = Reach(predecessors_, anchor);
    const std::vector<char> descendants = Reach(successors_, anchor);
    std::vector<int> last_reader;
    const std::vector<int> live =
        LiveBuffers(step, device, position, gradients_only, &last_reader);
    auto usable = [&](int n) {
      return Schedulable(work_, flow_, n) && work_.nodes[n].device == device;
    };
    if (VLOG_IS_ON(2)) {
      for (int b : live) {
        const int producer = work_.tensors[work_.buffers[b].owner].node;
        VLOG(2) << "  live at " << work_.nodes[anchor].def->name() << ": "
                << work_.buffers[b].bytes << " " << work_.nodes[producer].def->name()
                << (ancestors[producer] ? " (ancestor)" : " (independent)") << " last "
                << (last_reader[b] >= 0 ? work_.nodes[last_reader[b]].def->name() : "-")
                << " at +" << (last_reader[b] >= 0 ? position[last_reader[b]] - step : 0)
                << (last_reader[b] >= 0 && descendants[last_reader[b]] ? " (descendant)" : "");
      }
    }
    // Nodes that free a buffer the anchor's side of the graph holds.
    std::vector<int> waits = {anchor};
    for (int b : live) {
      const int producer = work_.tensors[work_.buffers[b].owner].node;
      const int last = last_reader[b];
      if (!ancestors[producer] || last < 0 || last == anchor || position[last] < step ||
          !usable(last)) {
        continue;
      }
      if (std::find(waits.begin(), waits.end(), last) == waits.end() &&
          static_cast<int>(waits.size()) <= kFreersTried) {
        waits.push_back(last);
      }
    }
    for (int b : live) {
      const int producer = work_.tensors[work_.buffers[b].owner].node;
      // Delay the independent branch that made the buffer.
      if (!ancestors[producer]) {
        for (int target : {producer, BranchStart(producer, ancestors, position)}) {
          if (!usable(target)) continue;
          const std::vector<char> below = Reach(successors_, target);
          for (int wait : waits) {
            if (usable(wait) && !below[wait] && position[wait] > position[target]) {
              edges->insert({wait, target});
            }
          }
        }
      }
      // Free the buffer before the step: the anchor waits for its last reader.
      const int last = last_reader[b];
      if (last >= 0 && position[last] > step && !descendants[last] && usable(last) &&
          usable(anchor)) {
        edges->insert({last, anchor});
      }
    }
  }

  absl::Status Evaluate(int from, int to, Candidate* candidate, bool* valid) {
    *valid = false;
    std::vector<int>& controls = work_.nodes[to].control_inputs;
    controls.push_back(from);
    std::vector<int> order;
    // An edge that makes a loop wait for what needs the loop's result closes a
    // cycle through the loop's barriers (ExecutorOrder): not a candidate.
    absl::Status status = ExecutorOrder(work_, &order);
    if (!status.ok()) {
      controls.pop_back();
      return absl::OkStatus();
    }
    SimulationResult simulation;
    if (AddNSignature(order) == signature_) {
      ++schedule_->simulations;
      status = Simulate(work_, order, SimulationOptions(), &simulation);
      *valid = status.ok();
    }
    controls.pop_back();
    if (!status.ok()) return status;
    if (*valid) {
      candidate->from = from;
      candidate->to = to;
      candidate->score = ScoreOf(simulation, false);
      candidate->order = std::move(order);
    }
    return absl::OkStatus();
  }

  // Tries the candidates at the current peaks; keeps the best one that the
  // allocator model confirms.
  absl::Status Step(bool* kept) {
    *kept = false;
    std::vector<int> position(work_.nodes.size());
    for (size_t s = 0; s < order_.size(); ++s) position[order_[s]] = static_cast<int>(s);
    std::set<std::pair<int, int>> edges;
    for (const DeviceTimeline& t : cheap_.devices) {
      if (t.peak_step >= 0) CandidatesAt(t.peak_step, t.device, position, false, &edges);
      const auto top = std::max_element(t.gradient_bytes.begin(), t.gradient_bytes.end());
      if (top != t.gradient_bytes.end() && *top > 0) {
        CandidatesAt(static_cast<int>(top - t.gradient_bytes.begin()), t.device, position,
                     true, &edges);
      }
    }
    VLOG(1) << "schedule: " << edges.size() << " candidate edges after "
            << schedule_->edges.size() << " kept";
    const Score current = ScoreOf(cheap_, false);
    std::vector<Candidate> better;
    for (const auto& [from, to] : edges) {
      if (schedule_->simulations >= options_.max_simulations) break;
      Candidate candidate;
      bool valid = false;
      absl::Status status = Evaluate(from, to, &candidate, &valid);
      if (!status.ok()) return status;
      if (valid && Lowers(candidate.score, current, std::max<int64_t>(options_.min_gain_bytes, 1))) better.push_back(std::move(candidate));
    }
    std::stable_sort(better.begin(), better.end(), [&](const Candidate& a, const Candidate& b) {
      return Gain(a.score, current) > Gain(b.score, current);
    });
    // The allocator model has the last word: the predicted peak must not rise.
    for (Candidate& candidate : better) {
      work_.nodes[candidate.to].control_inputs.push_back(candidate.from);
      SimulationResult full;
      absl::Status status = Simulate(work_, candidate.order, options_.simulation, &full);
      if (!status.ok()) return status;
      const Score full_score = ScoreOf(full, true);
      bool rises = false;
      for (size_t d = 0; d < full_score.peak.size(); ++d) {
        rises = rises || full_score.peak[d] > full_.peak[d];
      }
      if (rises) {
        work_.nodes[candidate.to].control_inputs.pop_back();
        continue;
      }
      AddAdjacency(candidate.from, candidate.to);
      schedule_->edges.push_back({candidate.from, candidate.to});
      order_ = std::move(candidate.order);
      full_ = full_score;
      schedule_->simulation = std::move(full);
      status = Simulate(work_, order_, SimulationOptions(), &cheap_);
      if (!status.ok()) return status;
      *kept = true;
      return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  // Drops the edges the others make unnecessary (a later edge can subsume an
  // earlier one), oldest first: an edge goes if the order without it scores no
  // worse, with the allocator model.
  absl::Status Prune() {
    const Score kept_score = ScoreOf(schedule_->simulation, true);
    for (size_t i = 0; i < schedule_->edges.size();) {
      const auto [from, to] = schedule_->edges[i];
      std::vector<int>& controls = work_.nodes[to].control_inputs;
      const auto it = std::find(controls.begin(), controls.end(), from);
      const int slot = static_cast<int>(it - controls.begin());
      controls.erase(it);
      std::vector<int> order;
      absl::Status status = ExecutorOrder(work_, &order);
      if (!status.ok()) return status;
      SimulationResult full;
      bool drop = AddNSignature(order) == signature_;
      if (drop) {
        ++schedule_->simulations;
        status = Simulate(work_, order, options_.simulation, &full);
        if (!status.ok()) return status;
        const Score score = ScoreOf(full, true);
        for (size_t d = 0; d < score.peak.size(); ++d) {
          drop = drop && score.peak[d] <= kept_score.peak[d] &&
                 score.backward[d] <= kept_score.backward[d];
        }
      }
      if (!drop) {
        controls.insert(controls.begin() + slot, from);
        ++i;
        continue;
      }
      schedule_->edges.erase(schedule_->edges.begin() + i);
      order_ = std::move(order);
      full_ = ScoreOf(full, true);
      schedule_->simulation = std::move(full);
    }
    return absl::OkStatus();
  }

  TensorTable work_;  // the table with the kept edges as control inputs
  const ControlFlowInfo& flow_;
  const ScheduleOptions& options_;
  Schedule* schedule_;
  std::vector<std::vector<int>> successors_, predecessors_;
  std::vector<std::vector<int>> tensors_of_buffer_;
  std::vector<bool> fetched_;
  std::vector<int> addn_;
  std::vector<char> signature_;
  std::vector<int> order_;
  SimulationResult cheap_;  // live bytes only, for the current order
  Score full_;              // with the allocator model, for the current order
};

}  // namespace

absl::Status PlanSchedule(const TensorTable& table, const ControlFlowInfo& flow,
                          const SimulationResult& before, const ScheduleOptions& options,
                          Schedule* schedule) {
  *schedule = Schedule();
  Scheduler scheduler(table, flow, options, schedule);
  return scheduler.Run(before);
}

absl::Status ApplySchedule(const TensorTable& table, const Schedule& schedule,
                           tensorflow::GraphDef* graph) {
  for (const auto& [from, to] : schedule.edges) {
    if (to < 0 || to >= graph->node_size() || from < 0 || from >= graph->node_size()) {
      return absl::InternalError("schedule: edge out of range");
    }
    tensorflow::NodeDef* node = graph->mutable_node(to);
    const std::string& from_name = graph->node(from).name();
    if (node->name() != table.nodes[to].def->name() ||
        from_name != table.nodes[from].def->name()) {
      return absl::InternalError(
          absl::StrCat("schedule: graph and table disagree at ", node->name()));
    }
    node->add_input(absl::StrCat("^", from_name));
    (*node->mutable_attr())[kScheduledAttr].set_b(true);
  }
  return absl::OkStatus();
}

bool HasScheduledNodes(const tensorflow::GraphDef& graph) {
  for (const tensorflow::NodeDef& node : graph.node()) {
    if (node.attr().count(kScheduledAttr)) return true;
  }
  return false;
}

}  // namespace tfmemopt
