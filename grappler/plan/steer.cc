// Plan: steering the descent around the allocator model's refusals (see
// Planner::SteerAroundRefusal in plan/descent.h).
//
// At a refusal, TF's BFC allocator has no free chunk of the request's size in any
// region (a tensor must fit in one chunk of one region, and regions never merge),
// although the bytes in use are below its limit. A chunk that large exists once the
// chunks next to each other in some region large enough are all free: a window. A
// window is reachable when every chunk in use in it belongs to a buffer that a
// mechanism can take off the device at the refusal's step (a holding with a
// candidate). The windows are ranked by the bytes their chunks in use hold (what
// taking them costs in memory moved, and roughly in time), and the candidates of
// the cheapest few are simulated, each window as one batch. Placement in BFC is not
// stable under a change of plan (the freed chunks may be taken by other tensors
// first), so a window is kept only if the simulation says the plan came closer to
// fitting.
#include <algorithm>
#include <set>

#include "grappler/plan/descent.h"
#include "grappler/simulate/bfc_allocator_model.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

// Windows tried per refusal.
constexpr int kWindowsTried = 3;

struct Window {
  int64_t held = 0;          // bytes of the chunks in use in it
  std::vector<int> buffers;  // their buffers, in address order
};

// Reachable windows of at least `need` bytes, cheapest first.
std::vector<Window> Windows(const std::vector<std::vector<DeviceTimeline::RegionChunk>>& regions,
                            int64_t need, const std::set<int>& takeable) {
  std::vector<Window> windows;
  for (const auto& chunks : regions) {
    const int k = static_cast<int>(chunks.size());
    auto blocked = [&](int i) {
      return chunks[i].buffer != -1 && takeable.count(chunks[i].buffer) == 0;
    };
    for (int lo = 0; lo < k;) {
      if (blocked(lo)) {
        ++lo;
        continue;
      }
      int hi = lo;
      while (hi < k && !blocked(hi)) ++hi;
      // Two pointers over [lo, hi): for each start, the shortest window that is
      // large enough.
      int64_t total = 0, held = 0;
      int j = lo;
      for (int i = lo; i < hi; ++i) {
        while (j < hi && total < need) {
          total += chunks[j].bytes;
          if (chunks[j].buffer >= 0) held += chunks[j].bytes;
          ++j;
        }
        if (total < need) break;
        Window window;
        window.held = held;
        for (int c = i; c < j; ++c) {
          const int b = chunks[c].buffer;
          if (b >= 0 && std::find(window.buffers.begin(), window.buffers.end(), b) ==
                            window.buffers.end()) {
            window.buffers.push_back(b);
          }
        }
        if (!window.buffers.empty()) windows.push_back(std::move(window));
        total -= chunks[i].bytes;
        if (chunks[i].buffer >= 0) held -= chunks[i].bytes;
      }
      lo = hi;
    }
  }
  std::stable_sort(windows.begin(), windows.end(),
                   [](const Window& a, const Window& b) { return a.held < b.held; });
  return windows;
}

}  // namespace

absl::Status Planner::SteerAroundRefusal(const Evaluated& state,
                                         const std::vector<Candidate>& candidates,
                                         Evaluated* next, std::vector<Group>* taken,
                                         bool* steered) {
  *steered = false;
  const Target target = TargetOf(state.objective(), state.simulation);
  if (!target.refusal) return absl::OkStatus();
  const DeviceTimeline& t = state.simulation.devices[target.device];
  // The best candidate of each buffer (candidates come sorted, best first).
  std::map<int, int> best_of_buffer;
  std::set<int> takeable;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].buffer >= 0 && best_of_buffer.emplace(candidates[i].buffer, i).second) {
      takeable.insert(candidates[i].buffer);
    }
  }
  const std::vector<Window> windows =
      Windows(t.allocator_regions_at_refusal,
              BfcAllocatorModel::RoundedBytes(t.allocator_refused_bytes), takeable);
  std::set<std::vector<int>> tried;
  const int n = static_cast<int>(ctx_.table.nodes.size());
  for (const Window& window : windows) {
    if (static_cast<int>(tried.size()) >= kWindowsTried ||
        plan_->simulations >= simulation_limit_) {
      break;
    }
    std::vector<int> members = window.buffers;
    std::sort(members.begin(), members.end());
    if (!tried.insert(members).second) continue;
    // The window's candidates as one batch: none takes a node twice or one that
    // another anchors, and each mechanism stays within its room.
    Choice choice = state.choice;
    std::vector<bool> used(n, false), anchored(n, false);
    std::vector<int64_t> room(mechanisms_.size());
    for (size_t m = 0; m < mechanisms_.size(); ++m) {
      room[m] = mechanisms_[m]->Room(state.choice.items[m]);
    }
    std::vector<Group> groups;
    bool complete = true;
    for (int b : window.buffers) {
      const Candidate& c = candidates[best_of_buffer.at(b)];
      bool conflicts = room[c.mechanism] != INT64_MAX &&
                       static_cast<int64_t>(c.items.size()) > room[c.mechanism];
      for (int p : c.nodes) conflicts = conflicts || used[p] || anchored[p];
      for (int p : c.anchors) conflicts = conflicts || used[p];
      if (conflicts) {
        complete = false;
        break;
      }
      if (room[c.mechanism] != INT64_MAX) room[c.mechanism] -= c.items.size();
      for (int p : c.nodes) used[p] = true;
      for (int p : c.anchors) anchored[p] = true;
      std::vector<int>& into = choice.items[c.mechanism];
      into.insert(into.end(), c.items.begin(), c.items.end());
      groups.push_back(Group{c.mechanism, c.items, c.seconds});
    }
    if (!complete) continue;
    Evaluated trial;
    absl::Status status = Evaluate(std::move(choice), &trial);
    if (!status.ok()) return status;
    VLOG(2) << "  window of " << window.buffers.size() << " buffers holding " << window.held
            << " bytes at the refusal of " << t.allocator_refused_bytes << ": excess "
            << trial.excess << " (was " << state.excess << ")";
    if (!CloserToFitting(trial.objective(), state.objective(), false)) continue;
    *next = std::move(trial);
    *taken = std::move(groups);
    *steered = true;
    ++plan_->allocator_windows;
    for (int b : window.buffers) plan_->steered_buffers.push_back(b);
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
