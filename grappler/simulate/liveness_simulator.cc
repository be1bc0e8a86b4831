#include "grappler/simulate/liveness_simulator.h"

#include "grappler/simulate/execution_order.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "grappler/simulate/bfc_allocator_model.h"
#include "grappler/simulate/execution_order.h"
#include "tensorflow/core/graph/tensor_id.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/grappler/utils/topological_sort.h"
#include "tensorflow/core/platform/logging.h"
#include "tsl/platform/cpu_info.h"

namespace tfmemopt {
namespace {

// Kernels that TF's executor always runs inline, without a thread-pool task:
// they override OpKernel::IsExpensive() to return false (constants, identities,
// variable reads, shape queries, loop plumbing).
bool AlwaysInexpensive(const std::string& op) {
  static const auto* ops = new absl::flat_hash_set<std::string>{
      "Const", "HostConst", "Identity", "IdentityN", "NoOp", "Shape", "ShapeN", "Size",
      "Rank", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "ReadVariableOp",
      "VarHandleOp", "VariableShape", "_Arg", "_Retval", "Enter", "RefEnter", "Exit",
      "RefExit", "Merge", "RefMerge", "Switch", "RefSwitch", "NextIteration",
      "RefNextIteration", "LoopCond", "ControlTrigger"};
  return ops->count(op) > 0;
}

// A kernel that reads and writes less than this runs in under TF's
// kOpIsExpensiveThresholdCycles (8000 cycles, a few microseconds), and the
// executor's cost model marks it inexpensive after the first step.
constexpr int64_t kExpensiveKernelBytes = 64 << 10;

}  // namespace

bool IsExpensiveKernel(const TensorTable& table, int n) {
  const NodeInfo& node = table.nodes[n];
  if (AlwaysInexpensive(node.def->op())) return false;
  int64_t bytes = 0;
  for (int t : node.inputs) bytes += table.tensors[t].bytes;
  for (int t : node.outputs) bytes += table.tensors[t].bytes;
  return bytes >= kExpensiveKernelBytes;
}

std::vector<std::vector<int64_t>> StartedBeside(const TensorTable& table,
                                                const std::vector<int>& order,
                                                const std::vector<int>& position,
                                                int inter_op_threads) {
  std::vector<std::vector<int64_t>> beside(order.size());
  if (inter_op_threads < 2) return beside;
  // The step of the kernel whose end makes `n` ready: its inputs' latest producer.
  auto readied_by = [&](int n) {
    int latest = -1;
    for (int t : table.nodes[n].inputs) latest = std::max(latest, position[table.tensors[t].node]);
    for (int c : table.nodes[n].control_inputs) latest = std::max(latest, position[c]);
    return latest;
  };
  auto eligible = [&](int n) {
    return LoopOf(table, n) < 0 && IsExpensiveKernel(table, n);
  };
  // Per readying step, the expensive kernels it makes ready, in the order's order.
  absl::flat_hash_map<int, std::vector<int>> readied;
  for (size_t s = 0; s < order.size(); ++s) {
    const int n = order[s];
    const int when = readied_by(n);
    if (when >= 0 && eligible(n)) readied[when].push_back(static_cast<int>(s));
  }
  for (const auto& [when, steps] : readied) {
    // The first runs inline; the next starts at once on another thread (the
    // emulated order runs it after the first one's inline successors).
    if (steps.size() < 2) continue;
    const int first = order[steps[0]], second = order[steps[1]];
    if (table.nodes[first].device != table.nodes[second].device) continue;
    if (table.nodes[first].temp_bytes <= 0 && table.nodes[second].temp_bytes <= 0) continue;
    std::vector<int64_t>& chunks = beside[steps[0]];
    for (int t : table.nodes[second].outputs) {
      if (table.tensors[t].bytes > 0 && table.buffers[table.tensors[t].buffer].owner == t) {
        chunks.push_back(table.tensors[t].bytes);
      }
    }
    if (table.nodes[second].temp_bytes > 0) chunks.push_back(table.nodes[second].temp_bytes);
  }
  return beside;
}

namespace {

int64_t OutputBytes(const TensorTable& table, int n) {
  int64_t bytes = 0;
  for (int t : table.nodes[n].outputs) bytes += table.tensors[t].bytes;
  return bytes;
}

// What a replay reports as it runs; the timeline, the peak's live set and the
// allocator model are each one listener.
class Listener {
 public:
  virtual ~Listener() = default;
  virtual void Allocated(int buffer) {}
  virtual void Freed(int buffer) {}
  // In-place reuse: buffer `to` now holds what buffer `from` held the memory of.
  virtual void Reused(int from, int to) {}
  // A variable is copied before an in-place update (copy-on-write); the copy
  // becomes the variable's buffer.
  virtual void VariableCopied(int buffer) {}
  // The last read of the variable's old buffers is done.
  virtual void OldCopiesFreed(int buffer) {}
  // Called once per step, between the step's allocations and its releases.
  virtual void Step(size_t step) {}
};

// Replays an order, buffer by buffer.
class Replay {
 public:
  Replay(const TensorTable& table, const std::vector<int>& order,
         const std::vector<int>& position, const std::vector<int>& device_of_buffer,
         int num_devices)
      : table_(table),
        order_(order),
        position_(position),
        device_of_buffer_(device_of_buffer),
        num_devices_(num_devices) {
    for (size_t b = 0; b < table.buffers.size(); ++b) {
      if (table.buffers[b].released_by >= 0) {
        extra_released_by_[table.buffers[b].released_by].push_back(static_cast<int>(b));
      }
      for (int holder : table.buffers[b].held_by) {
        held_of_holder_[holder].push_back(static_cast<int>(b));
      }
      if (table.buffers[b].allocated_by >= 0) {
        allocated_by_[table.buffers[b].allocated_by].push_back(static_cast<int>(b));
      }
      if (table.buffers[b].drained_by >= 0) {
        drained_by_[table.buffers[b].drained_by].push_back(static_cast<int>(b));
      }
    }
  }

  bool ForwardEdge(int tensor, int consumer) const {
    return position_[table_.tensors[tensor].node] < position_[consumer];
  }

  // Runs steps 0..last.
  void Run(size_t last, Listener* listener) {
    const size_t num_buffers = table_.buffers.size();
    alias_.resize(num_buffers);
    for (size_t b = 0; b < num_buffers; ++b) alias_[b] = static_cast<int>(b);
    // Remaining reads per buffer: every forward consumer edge of every tensor on
    // it. Fetched and external buffers hold one read that is never released.
    pending_.assign(num_buffers, 0);
    for (size_t t = 0; t < table_.tensors.size(); ++t) {
      for (int consumer : table_.tensors[t].consumers) {
        if (ForwardEdge(t, consumer)) ++pending_[table_.tensors[t].buffer];
      }
    }
    for (int t : table_.fetch_tensors) ++pending_[table_.tensors[t].buffer];
    live_.assign(num_buffers, false);
    gradient_role_.assign(num_buffers, false);
    for (size_t b = 0; b < num_buffers; ++b) {
      gradient_role_[b] = table_.tensors[table_.buffers[b].owner].role == TensorRole::kGradient;
    }
    drained_.assign(num_buffers, -1);
    value_reads_.assign(num_buffers, 0);
    old_reads_.assign(num_buffers, 0);
    copy_bytes_.assign(num_buffers, 0);
    generation_.assign(num_buffers, 0);
    tensor_generation_.assign(table_.tensors.size(), 0);
    activation.assign(num_devices_, 0);
    gradient.assign(num_devices_, 0);
    for (size_t b = 0; b < num_buffers; ++b) {
      if (table_.buffers[b].external && !table_.buffers[b].persistent) {
        ++pending_[b];
        live_[b] = true;
        Add(b, +1);
      }
    }
    for (size_t step = 0; step <= last && step < order_.size(); ++step) {
      RunStep(step, listener);
    }
  }

  int Resolve(int b) {
    while (alias_[b] != b) {
      alias_[b] = alias_[alias_[b]];
      b = alias_[b];
    }
    return b;
  }
  bool live(int b) const { return live_[b]; }

  // Transient bytes live now, per device and role.
  std::vector<int64_t> activation, gradient;

 private:
  void Add(int b, int64_t sign) {
    std::vector<int64_t>& role = gradient_role_[b] ? gradient : activation;
    role[device_of_buffer_[b]] += sign * table_.buffers[b].bytes;
  }

  void Release(int b, Listener* listener) {
    if (pending_[b] == 0 && live_[b] && !Held(b)) {
      live_[b] = false;
      Add(b, -1);
      listener->Freed(b);
      // Buffers this one held references into may go now.
      auto it = held_of_holder_.find(b);
      if (it == held_of_holder_.end()) return;
      for (int held : it->second) Release(Resolve(held), listener);
    }
  }

  // A live buffer holds references into `b` (BufferInfo::held_by).
  bool Held(int b) const {
    for (int holder : table_.buffers[b].held_by) {
      if (live_[holder]) return true;
    }
    return false;
  }

  // A value read of a variable: a non-resource tensor on a persistent buffer.
  bool IsVariableValue(int tensor, int b) const {
    return table_.buffers[b].persistent &&
           table_.tensors[tensor].dtype != tensorflow::DT_RESOURCE;
  }

  // The input buffer whose memory output `tensor` of `node` can take over, or
  // -1: a reusable input that is live, transient, on the same device, and that has
  // no reader left but this node (TF checks that the buffer's reference count is
  // one, and its root buffer's). `*view`: the input is a view into a larger buffer
  // (a Slice along dimension 0, SliceIsView), which TF forwards as it is: the
  // output is then that view, and the whole buffer lives as long as it does.
  int TakeOver(const NodeInfo& node, int node_index, int tensor, bool* view) {
    const int own = table_.tensors[tensor].buffer;
    for (int port : node.reusable_inputs) {
      const int input = node.inputs[port];
      if (!ForwardEdge(input, node_index)) continue;
      const int b = Resolve(table_.tensors[input].buffer);
      const BufferInfo& buffer = table_.buffers[b];
      if (!live_[b] || buffer.persistent || buffer.external || pending_[b] != 1 ||
          device_of_buffer_[b] != device_of_buffer_[own]) {
        continue;
      }
      if (buffer.bytes == table_.buffers[own].bytes) return b;
      // Larger: a view, unless the buffer is a TensorList's (an element read from
      // it, which the list's own references keep from being forwarded).
      if (buffer.bytes > table_.buffers[own].bytes && buffer.pieces == 1 &&
          buffer.allocated_by < 0 && buffer.held_by.empty()) {
        *view = true;
        return b;
      }
    }
    return -1;
  }

  void RunStep(size_t step, Listener* listener) {
    const int n = order_[step];
    const NodeInfo& node = table_.nodes[n];
    for (size_t i = 0; i < node.outputs.size(); ++i) {
      const int t = node.outputs[i];
      const int own = table_.tensors[t].buffer;
      const BufferInfo& buffer = table_.buffers[own];
      if (buffer.persistent) {
        // A read of a variable (or constant) holds its buffer until the read's
        // readers are done, which a copy-on-write must respect.
        if (table_.tensors[t].dtype != tensorflow::DT_RESOURCE) {
          const int b = Resolve(own);
          for (int consumer : table_.tensors[t].consumers) {
            if (ForwardEdge(t, consumer)) ++value_reads_[b];
          }
          tensor_generation_[t] = generation_[b];
        }
        continue;
      }
      // Forwarded outputs were counted when their buffer's owner ran; a list a
      // loop fills is allocated by the node that fills it (below).
      if (live_[own] || buffer.owner != t || alias_[own] != own || buffer.allocated_by >= 0) {
        continue;
      }
      bool view = false;
      const int reused =
          static_cast<int>(i) == node.reusable_output ? TakeOver(node, n, t, &view) : -1;
      if (reused >= 0 && view) {
        // The output is the input's view: it allocates nothing, and its readers hold
        // the viewed buffer (this node's read of it ends with the step).
        alias_[own] = reused;
        pending_[reused] += pending_[own];
        pending_[own] = 0;
        continue;
      }
      if (reused >= 0) {
        // The output inherits the input's memory; the input's value ends here,
        // and this node's read of it is the one read left.
        alias_[reused] = own;
        pending_[own] += pending_[reused];
        pending_[reused] = 0;
        live_[reused] = false;
        Add(reused, -1);
        live_[own] = true;
        Add(own, +1);
        listener->Reused(reused, own);
        continue;
      }
      live_[own] = true;
      Add(own, +1);
      listener->Allocated(own);
    }
    for (int b : node.extra_buffers) {
      live_[b] = true;
      Add(b, +1);
      listener->Allocated(b);
    }
    if (auto it = allocated_by_.find(n); it != allocated_by_.end()) {
      for (int b : it->second) {
        if (live_[b] || alias_[b] != b) continue;
        live_[b] = true;
        Add(b, +1);
        listener->Allocated(b);
      }
    }
    for (int port : node.updated_variables) {
      const int b = Resolve(table_.tensors[node.inputs[port]].buffer);
      if (!table_.buffers[b].persistent || value_reads_[b] == 0) continue;
      old_reads_[b] += value_reads_[b];
      value_reads_[b] = 0;
      ++generation_[b];
      copy_bytes_[b] += table_.buffers[b].bytes;
      gradient[device_of_buffer_[b]] += table_.buffers[b].bytes;
      listener->VariableCopied(b);
    }
    listener->Step(step);
    // A list the gradient loop pops empties as it goes: once this node has popped,
    // only the popped element's readers still hold the buffer.
    if (auto it = drained_by_.find(n); it != drained_by_.end()) {
      for (int b : it->second) {
        const int element = node.outputs.size() >= 2 ? node.outputs[1] : -1;
        if (element < 0 || Resolve(b) != b) continue;
        drained_[b] = element;
        pending_[b] = 0;
        for (int c : table_.tensors[element].consumers) {
          if (ForwardEdge(element, c)) ++pending_[b];
        }
      }
    }
    for (int t : node.inputs) {
      if (!ForwardEdge(t, n)) continue;
      const int b = Resolve(table_.tensors[t].buffer);
      if (drained_[b] >= 0 && drained_[b] != t) continue;  // a read of the drained list
      --pending_[b];
      if (IsVariableValue(t, b)) {
        if (tensor_generation_[t] == generation_[b]) {
          --value_reads_[b];
        } else if (old_reads_[b] > 0 && --old_reads_[b] == 0) {
          gradient[device_of_buffer_[b]] -= copy_bytes_[b];
          copy_bytes_[b] = 0;
          listener->OldCopiesFreed(b);
        }
      }
      Release(b, listener);
    }
    for (int t : node.outputs) Release(Resolve(table_.tensors[t].buffer), listener);
    if (auto it = drained_by_.find(n); it != drained_by_.end()) {
      for (int b : it->second) Release(Resolve(b), listener);
    }
    // Extra buffers go after their reader has run, or at once without one.
    auto free_extra = [&](int b) {
      if (!live_[b]) return;
      live_[b] = false;
      Add(b, -1);
      listener->Freed(b);
    };
    for (int b : node.extra_buffers) {
      const int reader = table_.buffers[b].released_by;
      if (reader < 0 || position_[reader] <= position_[n]) free_extra(b);
    }
    auto it = extra_released_by_.find(n);
    if (it != extra_released_by_.end()) {
      for (int b : it->second) free_extra(b);
    }
  }

  const TensorTable& table_;
  const std::vector<int>& order_;
  const std::vector<int>& position_;
  const std::vector<int>& device_of_buffer_;
  const int num_devices_;
  absl::flat_hash_map<int, std::vector<int>> extra_released_by_;
  absl::flat_hash_map<int, std::vector<int>> held_of_holder_;  // holder -> held buffers
  absl::flat_hash_map<int, std::vector<int>> allocated_by_;  // node -> buffers it allocates
  absl::flat_hash_map<int, std::vector<int>> drained_by_;    // node -> buffers it drains
  // Per buffer: the popped element whose readers alone still hold it, or -1.
  std::vector<int> drained_;
  std::vector<int> alias_;  // in-place reuse: a buffer's memory now serves another
  std::vector<int64_t> pending_;
  std::vector<bool> live_;
  std::vector<bool> gradient_role_;
  // Copy-on-write bookkeeping per variable buffer: reads of its current value,
  // reads still holding old copies, the bytes of those copies, and a generation
  // that tells the two kinds of read apart.
  std::vector<int64_t> value_reads_, old_reads_, copy_bytes_;
  std::vector<int> generation_, tensor_generation_;
};

// The timeline: live bytes per device and role at every step, and the peak.
class TimelineListener : public Listener {
 public:
  TimelineListener(const TensorTable& table, const std::vector<int>& order,
                   const std::vector<int>& device_of_node, Replay* replay,
                   const std::vector<std::vector<int64_t>>& beside, SimulationResult* result)
      : table_(table), order_(order), device_of_node_(device_of_node),
        replay_(replay), beside_(beside), result_(result) {}

  void Step(size_t step) override {
    const NodeInfo& node = table_.nodes[order_[step]];
    // A kernel started beside it holds its outputs and scratch (StartedBeside).
    int64_t beside = 0;
    for (int64_t bytes : beside_[step]) beside += bytes;
    for (size_t d = 0; d < result_->devices.size(); ++d) {
      DeviceTimeline& timeline = result_->devices[d];
      // A kernel's scratch memory counts while it runs, as part of its step.
      const int64_t temp =
          device_of_node_[order_[step]] == static_cast<int>(d) ? node.temp_bytes + beside : 0;
      std::vector<int64_t>& role = node.backward ? replay_->gradient : replay_->activation;
      role[d] += temp;
      const int64_t total =
          timeline.persistent_bytes + replay_->activation[d] + replay_->gradient[d];
      if (total > timeline.peak_bytes || timeline.peak_step < 0) {
        timeline.peak_bytes = total;
        timeline.peak_step = static_cast<int>(step);
      }
      timeline.activation_bytes.push_back(replay_->activation[d]);
      timeline.gradient_bytes.push_back(replay_->gradient[d]);
      role[d] -= temp;
    }
  }

 private:
  const TensorTable& table_;
  const std::vector<int>& order_;
  const std::vector<int>& device_of_node_;
  Replay* replay_;
  const std::vector<std::vector<int64_t>>& beside_;  // StartedBeside of the order
  SimulationResult* result_;
};

// The buffers live at one device's peak step.
class PeakSetListener : public Listener {
 public:
  PeakSetListener(const TensorTable& table, size_t peak_step, int device,
                  const std::vector<int>& device_of_buffer, Replay* replay,
                  std::vector<int>* live)
      : table_(table), peak_step_(peak_step), device_(device),
        device_of_buffer_(device_of_buffer), replay_(replay), live_(live) {}

  void Step(size_t step) override {
    if (step != peak_step_) return;
    // Kernels' extra buffers are not graph tensors (nothing can swap or recompute
    // them), so they count in the peak but are not listed.
    for (size_t b = 0; b < device_of_buffer_.size(); ++b) {
      if (replay_->live(b) && device_of_buffer_[b] == device_ &&
          table_.buffers[b].released_by < 0) {
        live_->push_back(b);
      }
    }
  }

 private:
  const TensorTable& table_;
  size_t peak_step_;
  int device_;
  const std::vector<int>& device_of_buffer_;
  Replay* replay_;
  std::vector<int>* live_;
};

// One allocator event of a loop body's run (see AllocatorListener's loop
// iterations).
enum ScriptKind { kAlloc, kFree, kReuse, kPiece, kPop, kScratch };
struct ScriptEvent {
  ScriptKind kind;
  int id;     // buffer (kScratch: node)
  int other;  // kReuse: the buffer that takes the memory over
};

// What one device's allocator replays share about the loops: each loop body's
// events (the same in every step and history: they come from the order, not from
// the allocator), and which loops TF may run at the same time.
struct LoopScripts {
  std::vector<std::vector<ScriptEvent>> events;  // per loop; empty: run once
  // [a][b]: neither loop depends on the other (a bidirectional RNN's two
  // directions), so TF's inter-op threads run their iterations side by side.
  std::vector<std::vector<bool>> concurrent;
};

// Whether each pair of loops is independent: neither reaches the other's Enter
// nodes through data or control inputs.
std::vector<std::vector<bool>> IndependentLoops(const TensorTable& table) {
  const int num_loops = static_cast<int>(table.loops.loops.size());
  std::vector<std::vector<bool>> upstream(num_loops, std::vector<bool>(num_loops, false));
  for (int l = 0; l < num_loops; ++l) {
    std::vector<bool> seen(table.nodes.size(), false);
    std::vector<int> stack;
    auto visit = [&](int n) {
      if (n >= 0 && !seen[n]) {
        seen[n] = true;
        stack.push_back(n);
      }
    };
    for (int e : table.loops.loops[l].enters) {
      for (int t : table.nodes[e].inputs) visit(table.tensors[t].node);
      for (int c : table.nodes[e].control_inputs) visit(c);
    }
    while (!stack.empty()) {
      const int n = stack.back();
      stack.pop_back();
      const int loop = LoopOf(table, n);
      if (loop >= 0 && loop != l) upstream[l][loop] = true;
      for (int t : table.nodes[n].inputs) visit(table.tensors[t].node);
      for (int c : table.nodes[n].control_inputs) visit(c);
    }
  }
  std::vector<std::vector<bool>> independent(num_loops, std::vector<bool>(num_loops, false));
  for (int a = 0; a < num_loops; ++a) {
    for (int b = 0; b < num_loops; ++b) {
      independent[a][b] = a != b && !upstream[a][b] && !upstream[b][a];
    }
  }
  return independent;
}

// Replays one device's allocations through the BFC model.
class AllocatorListener : public Listener {
 public:
  AllocatorListener(const TensorTable& table, const std::vector<int>& order,
                    const std::vector<int>& device_of_node,
                    const std::vector<int>& device_of_buffer, int device,
                    BfcAllocatorModel* allocator, const LoopScripts* loops = nullptr,
                    LoopScripts* record = nullptr)
      : table_(table), order_(order), device_of_node_(device_of_node),
        device_of_buffer_(device_of_buffer), device_(device), allocator_(allocator),
        shared_(loops), record_(record),
        chunk_(table.buffers.size(), -2), old_copies_(table.buffers.size()) {
    FindIteratedLoops();
  }

  // Variables, constants and the caller's inputs exist before the step; `history`
  // says in which order they were made, and how.
  void AllocateResident(ResidentHistory history) {
    std::vector<int> resident;
    for (size_t b = 0; b < table_.buffers.size(); ++b) {
      if ((table_.buffers[b].persistent || table_.buffers[b].external) && Mine(b)) {
        resident.push_back(static_cast<int>(b));
      }
    }
    if (history == ResidentHistory::kObserved) resident = ClaimObserved(resident);
    if (history == ResidentHistory::kReverseGraphOrder) {
      std::reverse(resident.begin(), resident.end());
    } else if (history == ResidentHistory::kLargestFirst) {
      std::stable_sort(resident.begin(), resident.end(), [&](int a, int b) {
        return table_.buffers[a].bytes > table_.buffers[b].bytes;
      });
    }
    for (int b : resident) {
      // An eager initializer computes the value, then the variable is allocated and
      // assigned from it, and the value's tensor goes.
      const int64_t initial_value =
          history == ResidentHistory::kInitialValueTemporaries && table_.buffers[b].persistent
              ? allocator_->Allocate(table_.buffers[b].bytes)
              : -2;
      chunk_[b] = Allocate(b);
      allocator_->Free(initial_value);
    }
  }
  // Places the resident buffers that the pool read off the live allocator already
  // holds (the variables, the caller's inputs) in its chunks in use: largest first,
  // each in the smallest unclaimed chunk that BFC could have given it (its rounded
  // size, or up to twice that, unsplit). Constants are not made yet (TF makes them
  // with their kernels, after Grappler). Returns the buffers still to allocate.
  std::vector<int> ClaimObserved(std::vector<int> resident) {
    std::stable_sort(resident.begin(), resident.end(), [&](int a, int b) {
      return table_.buffers[a].bytes > table_.buffers[b].bytes;
    });
    std::vector<int> rest;
    for (int b : resident) {
      const BufferInfo& buffer = table_.buffers[b];
      const bool constant = buffer.owner >= 0 && buffer.persistent &&
                            table_.nodes[table_.tensors[buffer.owner].node].def->op() == "Const";
      const int64_t rounded = BfcAllocatorModel::RoundedBytes(buffer.bytes);
      const auto& held = allocator_->unclaimed();
      auto it = held.lower_bound({rounded, -1});
      // BFC leaves a chunk whole only below twice the request and 128 MiB over it.
      const bool fits = it != held.end() && it->first < 2 * rounded &&
                        it->first - rounded < (int64_t{128} << 20);
      const int64_t chunk =
          constant || buffer.pieces > 1 || !fits ? -1 : allocator_->Claim(it->second);
      if (chunk < 0) {
        rest.push_back(b);
        continue;
      }
      chunk_[b] = chunk;
      owner_[chunk] = b;
    }
    // The rest in graph order, as the histories make them.
    std::sort(rest.begin(), rest.end());
    return rest;
  }
  // Frees what a step left behind (fetched outputs, old variable copies).
  void EndStep() {
    ReplayLoopsEndedBefore(static_cast<int>(order_.size()));
    ending_ = true;
    for (size_t b = 0; b < chunk_.size(); ++b) {
      if (!table_.buffers[b].persistent && !table_.buffers[b].external) Freed(b);
      OldCopiesFreed(b);
    }
    ending_ = false;
    for (auto* lists : {&draining_, &phantom_}) {
      for (auto& [b, elements] : *lists) {
        for (int64_t chunk : elements) Free(chunk);
      }
      lists->clear();
    }
    std::fill(done_.begin(), done_.end(), false);
    next_step_ = 0;
  }

  void Allocated(int b) override {
    ReplayLoopsEndedBefore(next_step_);
    if (!Mine(b)) return;
    if (filled_by_loop_[b] >= 0 && done_[filled_by_loop_[b]]) {
      // Its loop's iterations were played beside another loop's: they made its elements.
      auto it = phantom_.find(b);
      if (it != phantom_.end() && !it->second.empty()) {
        chunk_[b] = it->second.front();
        pieces_[chunk_[b]].assign(it->second.begin() + 1, it->second.end());
        phantom_.erase(it);
        step_bytes_ += table_.buffers[b].bytes;
        return;
      }
    }
    const int loop = RecordingLoop(next_step_);
    const bool filled_here = loop >= 0 && filled_by_loop_[b] == loop;
    chunk_[b] = Allocate(b, /*first_piece_only=*/filled_here);
    step_bytes_ += table_.buffers[b].bytes;
    if (loop >= 0) {
      scripts_[loop].push_back({filled_here ? kPiece : kAlloc, b, 0});
    }
  }
  void Freed(int b) override {
    const int loop = ending_ ? -1 : RecordingLoop(next_step_ - 1);
    if (loop >= 0 && drained_by_loop_[b] == loop && chunk_[b] >= 0) {
      // The gradient loop pops one element per iteration: only the last is gone.
      Detach(b);
      scripts_[loop].push_back({kPop, b, 0});
      PopPiece(b);
      return;
    }
    if (loop >= 0 && chunk_[b] >= 0) scripts_[loop].push_back({kFree, b, 0});
    Free(chunk_[b]);
    chunk_[b] = -2;
  }
  void Reused(int from, int to) override {
    ReplayLoopsEndedBefore(next_step_);
    const int loop = RecordingLoop(next_step_);
    if (loop >= 0) scripts_[loop].push_back({kReuse, from, to});
    chunk_[to] = chunk_[from];
    chunk_[from] = -2;
    Own(chunk_[to], to);
  }
  void VariableCopied(int b) override {
    ReplayLoopsEndedBefore(next_step_);
    if (!Mine(b)) return;
    old_copies_[b].push_back(chunk_[b]);
    Own(chunk_[b], -2);
    chunk_[b] = Allocate(b);
    step_bytes_ += table_.buffers[b].bytes;
  }
  void OldCopiesFreed(int b) override {
    for (int64_t chunk : old_copies_[b]) Free(chunk);
    old_copies_[b].clear();
  }
  void Step(size_t step) override {
    const int n = order_[step];
    ReplayLoopsEndedBefore(static_cast<int>(step));
    next_step_ = static_cast<int>(step);
    // What a kernel started beside this one holds while this one runs
    // (StartedBeside), placed before this one's scratch and gone with it.
    std::vector<int64_t> beside;
    if (beside_ != nullptr && device_of_node_[n] == device_) {
      for (int64_t bytes : (*beside_)[step]) {
        const int64_t chunk = allocator_->Allocate(bytes);
        if (chunk < 0) {
          Refused(bytes, absl::StrCat("what runs beside ", table_.nodes[n].def->name()));
        }
        beside.push_back(chunk);
      }
      if (!beside.empty()) Measure();
    }
    if (device_of_node_[n] == device_ && table_.nodes[n].temp_bytes > 0) {
      Scratch(n);
      const int loop = RecordingLoop(static_cast<int>(step));
      if (loop >= 0) scripts_[loop].push_back({kScratch, n, 0});
    }
    for (int64_t chunk : beside) allocator_->Free(chunk);
    next_step_ = static_cast<int>(step) + 1;
    // The measured step, kernel by kernel, for benchmarks/trace_step_memory.py.
    if (VLOG_IS_ON(2) && log_) {
      const NodeInfo& node = table_.nodes[n];
      VLOG(2) << "step " << step << " " << node.def->name() << " (" << node.def->op()
              << ") alloc " << step_bytes_ << " temp " << node.temp_bytes << " bfc "
              << allocator_->bytes_in_use();
    }
    step_bytes_ = 0;
  }
  void set_log(bool log) { log_ = log; }
  void set_beside(const std::vector<std::vector<int64_t>>* beside) { beside_ = beside; }
  // Whether some loop's iterations are played (FindIteratedLoops).
  bool plays_iterations() const { return iterated_; }
  // Whether the allocator's peak is being looked for (the measured steps).
  void set_measuring(bool measuring) { measuring_ = measuring; }
  // The first allocation the model refused (0 bytes if none).
  int64_t refused_bytes() const { return refused_bytes_; }
  const std::string& refused() const { return refused_; }
  int refused_step() const { return refused_step_; }
  int peak_step() const { return peak_step_; }
  // Fills the refusal's allocator state into `timeline`.
  void DescribeRefusal(DeviceTimeline* timeline) const {
    timeline->allocator_largest_free_bytes = largest_free_at_refusal_;
    timeline->allocator_unallocated_bytes = unallocated_at_refusal_;
    timeline->allocator_regions_at_refusal = regions_at_refusal_;
  }

 private:
  void Refused(int64_t bytes, std::string what) {
    // An empty request allocates nothing (the model answers -2): no refusal.
    if (bytes <= 0 || refused_bytes_ > 0) return;
    refused_bytes_ = bytes;
    refused_ = std::move(what);
    refused_step_ = next_step_;
    // BFC's state at the refusal: what would have to be freed, and where, for a
    // chunk of this size to exist.
    largest_free_at_refusal_ = allocator_->largest_free_bytes();
    unallocated_at_refusal_ = allocator_->unallocated_bytes();
    regions_at_refusal_.clear();
    for (const auto& region : allocator_->Regions(BfcAllocatorModel::RoundedBytes(bytes))) {
      std::vector<DeviceTimeline::RegionChunk> chunks;
      for (const auto& [address, size, in_use] : region.chunks) {
        int buffer = -1;
        if (in_use) {
          auto it = owner_.find(address);
          buffer = it == owner_.end() ? -2 : it->second;
        }
        chunks.push_back({size, buffer});
      }
      regions_at_refusal_.push_back(std::move(chunks));
    }
  }

  // The allocator's peak over the measured steps, and where it is reached.
  void Measure() {
    if (measuring_ && allocator_->bytes_in_use() > measured_peak_) {
      measured_peak_ = allocator_->bytes_in_use();
      peak_step_ = next_step_;
    }
  }

  // Which buffer a chunk (address) holds memory for; -2: none of the graph's.
  void Own(int64_t chunk, int buffer) {
    if (chunk < 0) return;
    owner_[chunk] = buffer;
    auto it = pieces_.find(chunk);
    if (it == pieces_.end()) return;
    for (int64_t piece : it->second) {
      if (piece >= 0) owner_[piece] = buffer;
    }
  }

  bool Mine(int b) const { return device_of_buffer_[b] == device_; }

  // A buffer of several pieces is several chunks; the id of its first piece
  // stands for them all.
  int64_t Allocate(int b, bool first_piece_only = false) {
    const BufferInfo& buffer = table_.buffers[b];
    const int64_t piece = buffer.pieces > 1 ? buffer.bytes / buffer.pieces : 0;
    const int64_t first = AllocateChunk(b, piece > 0 ? piece : buffer.bytes);
    if (first < 0 || piece <= 0) return first;
    std::vector<int64_t>& rest = pieces_[first];
    if (first_piece_only) return first;  // the loop's later iterations add the rest
    for (int64_t i = 1; i < buffer.pieces; ++i) rest.push_back(AllocateChunk(b, piece));
    return first;
  }
  // One chunk of `bytes` for buffer `b` (its id, or -1 when BFC would refuse it).
  // `iteration`: the loop iteration being played, named in a refusal.
  int64_t AllocateChunk(int b, int64_t bytes, int64_t iteration = -1) {
    const int64_t chunk = allocator_->Allocate(bytes);
    if (chunk < 0) {
      const std::string name = table_.TensorName(table_.buffers[b].owner);
      Refused(bytes, iteration < 0 ? name : absl::StrCat(name, " (iteration ", iteration, ")"));
      return chunk;
    }
    owner_[chunk] = b;
    Measure();
    return chunk;
  }
  void Free(int64_t chunk) {
    if (chunk < 0) return;
    auto it = pieces_.find(chunk);
    if (it != pieces_.end()) {
      for (int64_t piece : it->second) {
        allocator_->Free(piece);
        owner_.erase(piece);
      }
      pieces_.erase(it);
    }
    allocator_->Free(chunk);
    owner_.erase(chunk);
  }

  // Loop iterations. A simulation runs a loop's body once, but TF runs it once per
  // iteration, and BFC sees every iteration's allocations: the element each
  // iteration pushes onto a TensorList is allocated between that iteration's
  // temporaries, which are freed when the iteration is done. The list's elements
  // end up spread over the regions with holes between them that only small
  // tensors fit, and a gradient loop that pops one element per iteration frees
  // them one by one. A list allocated whole, in one contiguous run, leaves large
  // free chunks behind it that BFC does not have, so the model would place
  // tensors that TF cannot (a 16.6 MiB gradient beside a bidirectional LSTM's
  // lists). So the body's allocator events are recorded as the simulation runs
  // it (iteration 0) and played again for iterations 1 .. trip count - 1 once the
  // loop's last node has run: temporaries allocated and freed again, one more
  // element of each list the loop fills, one element fewer of each list it pops.
  // Loops inside other loops, and loops of unknown trip count, run once.
  void FindIteratedLoops() {
    const LoopAnalysis& loops = table_.loops;
    const int num_loops = static_cast<int>(loops.loops.size());
    filled_by_loop_.assign(table_.buffers.size(), -1);
    drained_by_loop_.assign(table_.buffers.size(), -1);
    last_step_of_loop_.assign(num_loops, -1);
    first_step_of_loop_.assign(num_loops, -1);
    done_.assign(num_loops, false);
    scripts_.assign(num_loops, {});
    if (num_loops == 0) return;
    std::vector<bool> iterated(num_loops, false);
    for (int l = 0; l < num_loops; ++l) {
      const LoopFrame& loop = loops.loops[l];
      bool nested = false;
      for (int e : loop.enters) {
        for (int t : table_.nodes[e].inputs) nested = nested || LoopOf(table_, table_.tensors[t].node) >= 0;
      }
      iterated[l] = loop.trip_count > 1 && !nested;
    }
    bool any = false;
    for (size_t b = 0; b < table_.buffers.size(); ++b) {
      const BufferInfo& buffer = table_.buffers[b];
      if (buffer.pieces <= 1) continue;
      const int filler = buffer.allocated_by >= 0 ? LoopOf(table_, buffer.allocated_by) : -1;
      const int drainer = buffer.drained_by >= 0 ? LoopOf(table_, buffer.drained_by) : -1;
      if (filler >= 0 && iterated[filler]) filled_by_loop_[b] = filler;
      if (drainer >= 0 && iterated[drainer]) drained_by_loop_[b] = drainer;
      any = any || filled_by_loop_[b] >= 0 || drained_by_loop_[b] >= 0;
    }
    if (!any) return;
    for (size_t step = 0; step < order_.size(); ++step) {
      const int loop = LoopOf(table_, order_[step]);
      if (loop < 0 || !iterated[loop]) continue;
      last_step_of_loop_[loop] = static_cast<int>(step);
      if (first_step_of_loop_[loop] < 0) first_step_of_loop_[loop] = static_cast<int>(step);
    }
    iterated_ = true;
  }

  // The loop whose body events at `step` are recorded, or -1.
  int RecordingLoop(int step) const {
    if (!iterated_ || step < 0 || step >= static_cast<int>(order_.size())) return -1;
    const int loop = LoopOf(table_, order_[step]);
    return loop >= 0 && last_step_of_loop_[loop] >= 0 && !done_[loop] ? loop : -1;
  }

  // Plays the iterations of every loop whose last node ran before `step`. A loop
  // that TF runs side by side with it (independent, and not started yet in the
  // simulated order) is played with it, iteration by iteration, from the events
  // its own run will record: their elements interleave in BFC's regions, and when
  // one loop's lists go, they leave holes between the other's.
  void ReplayLoopsEndedBefore(int step) {
    if (!iterated_) return;
    for (size_t l = 0; l < scripts_.size(); ++l) {
      if (scripts_[l].empty() || last_step_of_loop_[l] >= step) continue;
      if (record_ != nullptr) {
        record_->events[l] = std::move(scripts_[l]);
        scripts_[l].clear();
        continue;
      }
      std::vector<int> beside;
      for (size_t m = 0; shared_ != nullptr && m < scripts_.size(); ++m) {
        if (shared_->concurrent[l][m] && !done_[m] && !shared_->events[m].empty() &&
            first_step_of_loop_[m] > last_step_of_loop_[l] &&
            WithinReplayBound(static_cast<int>(m), shared_->events[m])) {
          beside.push_back(static_cast<int>(m));
        }
      }
      ReplayIterations(static_cast<int>(l), beside);
    }
  }

  // One loop's iterations 1 .. trip count - 1, and with them all iterations of
  // the loops `beside` (whose own run is then skipped).
  void ReplayIterations(int loop, std::vector<int> beside) {
    struct Player {
      std::vector<ScriptEvent> full, layout;
      int64_t first, trips;
      bool phantom;
    };
    std::vector<Player> players;
    players.push_back({std::move(scripts_[loop]), {}, 1, table_.loops.loops[loop].trip_count,
                       false});
    scripts_[loop].clear();
    if (!WithinReplayBound(loop, players.front().full)) {
      // Too long a loop to play: its lists fill at once, as one run of the body.
      for (const ScriptEvent& e : players.front().full) {
        if (e.kind == kPiece) {
          while (AddPiece(e.id)) {
          }
        }
      }
      players.front().trips = 1;
      beside.clear();
    }
    for (int m : beside) {
      players.push_back({shared_->events[m], {}, 0, table_.loops.loops[m].trip_count, true});
      done_[m] = true;
    }
    int64_t trips = 0;
    for (Player& player : players) {
      // Every iteration but the last plays only what shapes the lists' layout;
      // the last plays everything, for the loop's peak with its lists full.
      player.layout = LayoutEvents(player.full);
      trips = std::max(trips, player.trips);
    }
    for (int64_t k = 0; k < trips; ++k) {
      for (const Player& player : players) {
        if (k < player.first || k >= player.trips) continue;
        PlayIteration(k + 1 < player.trips ? player.layout : player.full, k, player.phantom);
      }
    }
    // Whatever a loop did not pop (a list longer than the trip count) goes with it.
    for (const Player& player : players) {
      for (const ScriptEvent& e : player.full) {
        if (e.kind != kPop) continue;
        auto it = draining_.find(e.id);
        if (it == draining_.end()) continue;
        for (int64_t chunk : it->second) Free(chunk);
        draining_.erase(it);
      }
    }
  }

  // One iteration of a loop body's events. `phantom`: the loop has not run yet,
  // its lists' elements are made here and handed to the lists when it does.
  void PlayIteration(const std::vector<ScriptEvent>& events, int64_t k, bool phantom) {
    std::map<int, int64_t> chunks;  // this iteration's temporaries: buffer -> chunk
    for (const ScriptEvent& e : events) {
      switch (e.kind) {
        case kAlloc: {
          const int64_t chunk = AllocateChunk(e.id, table_.buffers[e.id].bytes, k);
          if (chunk >= 0) chunks[e.id] = chunk;
          break;
        }
        case kFree:
          if (auto it = chunks.find(e.id); it != chunks.end()) {
            Free(it->second);
            chunks.erase(it);
          }
          break;
        case kReuse:
          if (auto it = chunks.find(e.id); it != chunks.end()) {
            chunks[e.other] = it->second;
            chunks.erase(e.id);
          }
          break;
        case kPiece:
          if (phantom) {
            AddPhantomPiece(e.id);
          } else {
            AddPiece(e.id);
          }
          break;
        case kPop:
          if (phantom && chunk_[e.id] >= 0) Detach(e.id);
          PopPiece(e.id);
          break;
        case kScratch:
          Scratch(e.id);
          break;
      }
    }
    // What the iteration carries to the next one, or out of the loop, is
    // counted once, by the simulation's own run of the body.
    for (const auto& [b, chunk] : chunks) Free(chunk);
  }

  // The list `b` a gradient loop pops: its elements now go one by one (PopPiece).
  void Detach(int b) {
    std::vector<int64_t>& draining = draining_[b];
    draining.push_back(chunk_[b]);
    if (auto it = pieces_.find(chunk_[b]); it != pieces_.end()) {
      draining.insert(draining.end(), it->second.begin(), it->second.end());
      pieces_.erase(it);
    }
    chunk_[b] = -2;
  }

  // An element of the list `b` of a loop that has not run yet.
  void AddPhantomPiece(int b) {
    if (!Mine(b)) return;
    const BufferInfo& buffer = table_.buffers[b];
    std::vector<int64_t>& elements = phantom_[b];
    if (static_cast<int64_t>(elements.size()) >= buffer.pieces) return;
    const int64_t chunk = AllocateChunk(b, buffer.bytes / buffer.pieces);
    if (chunk >= 0) elements.push_back(chunk);
  }

  // The events of `script` that decide where the lists' elements go: every
  // element pushed or popped, and the temporaries live while an element is
  // allocated (they are the holes between elements). A temporary allocated and
  // freed between two pushes comes and goes without moving anything.
  static std::vector<ScriptEvent> LayoutEvents(const std::vector<ScriptEvent>& script) {
    const int size = static_cast<int>(script.size());
    std::vector<int> pieces_before(size + 1, 0);
    for (int i = 0; i < size; ++i) {
      pieces_before[i + 1] = pieces_before[i] + (script[i].kind == kPiece ? 1 : 0);
    }
    // Follow each temporary through in-place reuse to the free that ends it.
    std::vector<int> root(size, -1);
    std::vector<int> end(size, size);  // per allocation: where its memory is freed
    std::map<int, int> open;           // buffer -> its allocation's index
    for (int i = 0; i < size; ++i) {
      const ScriptEvent& e = script[i];
      if (e.kind == kAlloc) {
        open[e.id] = i;
        root[i] = i;
      } else if (e.kind == kReuse || e.kind == kFree) {
        auto it = open.find(e.id);
        if (it == open.end()) continue;
        root[i] = it->second;
        open.erase(it);
        if (e.kind == kReuse) {
          open[e.other] = root[i];
        } else {
          end[root[i]] = i;
        }
      }
    }
    std::vector<ScriptEvent> layout;
    for (int i = 0; i < size; ++i) {
      const ScriptEvent& e = script[i];
      if (e.kind == kPiece || e.kind == kPop) {
        layout.push_back(e);
      } else if (root[i] >= 0 && pieces_before[end[root[i]]] > pieces_before[root[i]]) {
        layout.push_back(e);
      }
    }
    return layout;
  }

  // One more element of the list `b` a loop fills, while it has room.
  // Whether it added one.
  bool AddPiece(int b) {
    if (chunk_[b] < 0) return false;
    auto it = pieces_.find(chunk_[b]);
    if (it == pieces_.end()) return false;
    const BufferInfo& buffer = table_.buffers[b];
    if (static_cast<int64_t>(it->second.size()) + 1 >= buffer.pieces) return false;
    const int64_t chunk = AllocateChunk(b, buffer.bytes / buffer.pieces);
    if (chunk < 0) return false;
    it->second.push_back(chunk);
    return true;
  }

  // Whether a loop's iterations are short enough to play: a simulation replays
  // the step some 28 times (allocator histories x steps), for every plan tried.
  static constexpr int64_t kMaxReplayedEvents = int64_t{1} << 20;
  bool WithinReplayBound(int loop, const std::vector<ScriptEvent>& events) const {
    return table_.loops.loops[loop].trip_count * static_cast<int64_t>(events.size()) <=
           kMaxReplayedEvents;
  }
  // The last element of the list `b` a gradient loop pops is gone.
  void PopPiece(int b) {
    auto it = draining_.find(b);
    if (it == draining_.end() || it->second.empty()) return;
    allocator_->Free(it->second.back());
    owner_.erase(it->second.back());
    it->second.pop_back();
  }
  // A kernel's scratch memory, allocated and freed while it runs.
  void Scratch(int n) {
    const int64_t chunk = allocator_->Allocate(table_.nodes[n].temp_bytes);
    if (chunk < 0) {
      Refused(table_.nodes[n].temp_bytes, absl::StrCat("scratch of ", table_.nodes[n].def->name()));
    }
    Measure();
    allocator_->Free(chunk);
  }
  const std::vector<std::vector<int64_t>>* beside_ = nullptr;  // StartedBeside of the order

  const TensorTable& table_;
  const std::vector<int>& order_;
  const std::vector<int>& device_of_node_;
  const std::vector<int>& device_of_buffer_;
  const int device_;
  BfcAllocatorModel* allocator_;
  bool iterated_ = false;  // some loop's iterations are played (above)
  bool ending_ = false;    // EndStep's frees: no step runs
  const LoopScripts* shared_;  // the loops' events, for loops played beside another
  LoopScripts* record_;        // records the loops' events instead of playing them
  std::vector<int> filled_by_loop_, drained_by_loop_, first_step_of_loop_, last_step_of_loop_;
  std::vector<bool> done_;  // per loop: its iterations were played beside another's
  std::vector<std::vector<ScriptEvent>> scripts_;  // per loop: its body's events this step
  std::map<int, std::vector<int64_t>> draining_;   // popped list -> its elements left
  std::map<int, std::vector<int64_t>> phantom_;    // list -> elements made before it is
  std::vector<int64_t> chunk_;
  std::vector<std::vector<int64_t>> old_copies_;
  absl::flat_hash_map<int64_t, std::vector<int64_t>> pieces_;  // first piece -> the others
  int64_t step_bytes_ = 0;  // allocated by the current step
  bool log_ = false;
  int64_t refused_bytes_ = 0;
  std::string refused_;
  int next_step_ = 0;  // the step running (allocations come before its Step call)
  bool measuring_ = false;
  int64_t measured_peak_ = 0;
  int peak_step_ = -1;
  int refused_step_ = -1;
  int64_t largest_free_at_refusal_ = 0, unallocated_at_refusal_ = 0;
  std::vector<std::vector<DeviceTimeline::RegionChunk>> regions_at_refusal_;
  absl::flat_hash_map<int64_t, int> owner_;  // chunk address -> buffer
};

int DeviceIndex(const std::vector<std::string>& devices, const std::string& device) {
  auto it = std::lower_bound(devices.begin(), devices.end(), device);
  return static_cast<int>(it - devices.begin());
}

// A loop's body runs once in the emulation, but in TF it runs once per iteration:
// what comes out of a loop (an Exit: a filled TensorList, a final state) exists
// only after every iteration, and every iteration needs every value the loop takes
// in. So a loop runs as one block here: its Enter nodes wait for every value that
// enters the loop, and its Exit nodes for every NextIteration (the end of each
// iteration's work). Otherwise a node of the body that needs only some of the
// loop's inputs (pushing the initial state, iteration 0) would run, with the list
// it fills, long before the loop could, and what reads an Exit would run before
// the body.
template <typename AddEdge>
void AddLoopBarriers(const TensorTable& table, AddEdge add_edge) {
  const std::vector<int>& loop_of = table.loops.loop_of_node;
  const int num_loops = static_cast<int>(table.loops.loops.size());
  if (num_loops == 0) return;
  std::vector<std::vector<int>> inputs(num_loops), enters(num_loops), next(num_loops),
      exits(num_loops);
  for (int n = 0; n < static_cast<int>(loop_of.size()) && n < static_cast<int>(table.nodes.size());
       ++n) {
    const int loop = loop_of[n];
    if (loop < 0) continue;
    const tensorflow::NodeDef& def = *table.nodes[n].def;
    if (tensorflow::grappler::IsEnter(def)) {
      enters[loop].push_back(n);
      for (int t : table.nodes[n].inputs) inputs[loop].push_back(table.tensors[t].node);
    } else if (tensorflow::grappler::IsNextIteration(def)) {
      next[loop].push_back(n);
    } else if (tensorflow::grappler::IsExit(def)) {
      exits[loop].push_back(n);
    }
  }
  for (int loop = 0; loop < num_loops; ++loop) {
    std::sort(inputs[loop].begin(), inputs[loop].end());
    inputs[loop].erase(std::unique(inputs[loop].begin(), inputs[loop].end()), inputs[loop].end());
    for (int e : enters[loop]) {
      for (int p : inputs[loop]) add_edge(p, e);
    }
    for (int x : exits[loop]) {
      for (int ni : next[loop]) add_edge(ni, x);
    }
  }
}

}  // namespace

// TF's executor (ExecutorState::Process and ScheduleReady, executor.cc) runs a
// finished kernel's newly ready successors as follows: inexpensive ones inline,
// first come first served; of the expensive ones, one inline once nothing
// inexpensive is pending, the others as tasks on the inter-op pool, whose
// thread takes the task scheduled last first (Eigen's run queue is LIFO for its
// own thread). The graph's roots are queued behind them. The emulation follows
// these rules with one inter-op thread. Which expensive successor TF runs inline
// depends on the order of the node's out edges, which TF's graph rewrites
// (oneDNN's layout pass among them) leave arbitrary; measured on ResNet50 and the
// MLP, the executor finished a weight's gradient and its optimizer update before
// the data gradient in 53 of 55 layers (so the update copies the variable that
// the data gradient still reads). The emulation therefore runs inline the
// expensive successor nearest to a variable update, then the one with the
// largest output (InlineChoice::kNearestUpdate); the other choices let the
// planner check that a plan does not depend on that guess (plan/order_guard.h).
absl::Status ExecutorOrder(const TensorTable& table, std::vector<int>* order,
                           InlineChoice choice) {
  // Grappler's topological order tells loop back edges from forward ones; it is
  // computed on the table, so the planner's working tables (clones and swap nodes
  // applied in place, no GraphDef) are ordered exactly as their rewritten graphs.
  std::vector<int> topo;
  absl::Status status = GrapplerTopologicalOrder(table, &topo);
  if (!status.ok()) return status;
  const int num_nodes = static_cast<int>(table.nodes.size());
  std::vector<int> topo_position(num_nodes, -1);
  for (size_t i = 0; i < topo.size(); ++i) topo_position[topo[i]] = static_cast<int>(i);
  // Data and control edges; an edge from a node that Grappler orders later is a
  // loop back edge.
  std::vector<std::vector<int>> successors(num_nodes), data_out(num_nodes),
      control_out(num_nodes);
  std::vector<int> waiting(num_nodes, 0);
  auto add_edge = [&](int from, int to, bool control) {
    if (topo_position[from] >= topo_position[to]) return;
    successors[from].push_back(to);
    (control ? control_out : data_out)[from].push_back(to);
    ++waiting[to];
  };
  // The meta-optimizer ends by sorting the graph topologically (Grappler's
  // TopologicalSort), so the graph TF runs numbers its nodes in `topo`'s order,
  // whatever order the table's GraphDef had: node ids, out-edge lists and every tie
  // below follow that numbering.
  for (int n : topo) {
    for (int t : table.nodes[n].inputs) add_edge(table.tensors[t].node, n, false);
    for (int c : table.nodes[n].control_inputs) add_edge(c, n, true);
  }
  // (No cycle can come of these: nothing a loop takes in depends on what comes
  // out of it, and no node of a body depends on its own loop's Exit.)
  // A barrier is an ordering edge, no data: activated with the control edges.
  AddLoopBarriers(table, [&](int from, int to) {
    if (from == to) return;
    successors[from].push_back(to);
    control_out[from].push_back(to);
    ++waiting[to];
  });
  // Distance (in edges) to the nearest variable update.
  std::vector<int> to_update(num_nodes, num_nodes);
  {
    std::vector<std::vector<int>> predecessors(num_nodes);
    std::deque<int> frontier;
    for (int n = 0; n < num_nodes; ++n) {
      for (int s : successors[n]) predecessors[s].push_back(n);
      if (table.nodes[n].updates_variable) {
        to_update[n] = 0;
        frontier.push_back(n);
      }
    }
    while (!frontier.empty()) {
      const int n = frontier.front();
      frontier.pop_front();
      for (int p : predecessors[n]) {
        if (to_update[p] > to_update[n] + 1) {
          to_update[p] = to_update[n] + 1;
          frontier.push_back(p);
        }
      }
    }
  }
  std::vector<bool> expensive(num_nodes);
  for (int n = 0; n < num_nodes; ++n) expensive[n] = IsExpensiveKernel(table, n);
  // Better candidates to run inline sort last.
  auto inline_last = [&](int a, int b) {
    if (choice == InlineChoice::kFirstInGraph) return topo_position[a] > topo_position[b];
    if (choice == InlineChoice::kLastInGraph) return topo_position[a] < topo_position[b];
    if (to_update[a] != to_update[b]) return to_update[a] > to_update[b];
    const int64_t bytes_a = OutputBytes(table, a), bytes_b = OutputBytes(table, b);
    if (bytes_a != bytes_b) return bytes_a < bytes_b;
    return topo_position[a] > topo_position[b];
  };

  // Roots: the caller's inputs first (the executor's graph creates a function's
  // arguments first, in argument order), then the others in the sorted graph's order.
  std::vector<std::pair<int64_t, int>> roots;
  for (int n : topo) {
    if (waiting[n] != 0) continue;
    const tensorflow::NodeDef& def = *table.nodes[n].def;
    const int id = topo_position[n];
    int64_t key = 2 * static_cast<int64_t>(num_nodes) + id;
    if (def.op() == "_Arg" && def.attr().count("index")) {
      key = def.attr().at("index").i();
    } else if (def.attr().count("_tfmemopt_arg_index")) {
      // A function's input in tfmemopt.analyze()'s graph (analysis.metagraph_of).
      key = def.attr().at("_tfmemopt_arg_index").i();
    } else if (def.op() == "Placeholder") {
      key = num_nodes + id;
    }
    roots.push_back({key, n});
  }
  std::sort(roots.begin(), roots.end());
  std::deque<int> pool;
  for (const auto& root : roots) pool.push_back(root.second);

  order->clear();
  order->reserve(num_nodes);
  std::deque<int> inline_ready;
  std::vector<int> ready_expensive;
  while (!pool.empty()) {
    inline_ready.push_back(pool.front());
    pool.pop_front();
    while (!inline_ready.empty()) {
      const int n = inline_ready.front();
      inline_ready.pop_front();
      order->push_back(n);
      ready_expensive.clear();
      auto activate = [&](int s) {
        if (--waiting[s] != 0) return;
        if (expensive[s]) {
          ready_expensive.push_back(s);
        } else {
          inline_ready.push_back(s);
        }
      };
      // Successors made ready by data edges, ranked; then those made ready by
      // control edges, which TF's executor activates after the data edges
      // (ActivateNodes), so the last of them is the one it runs inline: a recompute
      // or swap-in that tfmemopt triggers by a control edge runs right after its
      // trigger.
      for (int s : data_out[n]) activate(s);
      std::sort(ready_expensive.begin(), ready_expensive.end(), inline_last);
      for (int s : control_out[n]) activate(s);
      if (ready_expensive.empty()) continue;
      if (inline_ready.empty()) {
        inline_ready.push_back(ready_expensive.back());
        ready_expensive.pop_back();
      }
      for (int s : ready_expensive) pool.push_front(s);
    }
  }
  if (static_cast<int>(order->size()) != num_nodes) {
    return absl::InternalError(absl::StrCat("executor order covers ", order->size(),
                                            " of ", num_nodes, " nodes (a cycle)"));
  }
  return absl::OkStatus();
}

absl::Status TopologicalOrder(const tensorflow::GraphDef& graph,
                              const TensorTable& table, std::vector<int>* order) {
  return ExecutorOrder(table, order);
}

absl::Status Simulate(const TensorTable& table, const std::vector<int>& order,
                      const SimulationOptions& options, SimulationResult* result) {
  result->order = order;
  result->devices.clear();
  const int num_devices = static_cast<int>(table.devices.size());
  std::vector<int> device_of_buffer(table.buffers.size(), 0);
  for (size_t b = 0; b < table.buffers.size(); ++b) {
    device_of_buffer[b] = DeviceIndex(table.devices, table.buffers[b].device);
  }
  std::vector<int> device_of_node(table.nodes.size(), 0);
  for (size_t n = 0; n < table.nodes.size(); ++n) {
    device_of_node[n] = DeviceIndex(table.devices, table.nodes[n].device);
  }
  for (int d = 0; d < num_devices; ++d) {
    DeviceTimeline timeline;
    timeline.device = table.devices[d];
    timeline.activation_bytes.reserve(order.size());
    timeline.gradient_bytes.reserve(order.size());
    result->devices.push_back(std::move(timeline));
  }
  for (size_t b = 0; b < table.buffers.size(); ++b) {
    if (table.buffers[b].persistent) {
      result->devices[device_of_buffer[b]].persistent_bytes += table.buffers[b].bytes;
    }
  }
  // Position of each node in the order. A read whose producer runs later is a
  // loop back edge (NextIteration -> Merge): it neither holds nor frees a buffer.
  std::vector<int> position(table.nodes.size(), -1);
  for (size_t step = 0; step < order.size(); ++step) {
    const int n = order[step];
    if (n < 0 || n >= static_cast<int>(table.nodes.size()) || position[n] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad order entry ", n));
    }
    position[n] = static_cast<int>(step);
  }

  Replay replay(table, order, position, device_of_buffer, num_devices);
  const std::vector<std::vector<int64_t>> started_beside = StartedBeside(
      table, order, position,
      options.inter_op_threads > 0 ? options.inter_op_threads : tsl::port::MaxParallelism());
  TimelineListener timeline(table, order, device_of_node, &replay, started_beside, result);
  replay.Run(order.size(), &timeline);
  for (int d = 0; d < num_devices; ++d) {
    DeviceTimeline& device = result->devices[d];
    if (device.peak_step < 0) continue;
    PeakSetListener peak(table, device.peak_step, d, device_of_buffer, &replay,
                         &device.live_at_peak);
    replay.Run(device.peak_step, &peak);
  }

  // The allocator model, once per history: resident buffers first, then warm-up
  // steps (which shape BFC's regions, as the first real steps do), then the measured
  // steps. The worst history is kept.
  const int warmup = std::max(options.warmup_steps, 0);
  const int measured = std::max(options.measured_steps, 1);
  for (int d = 0; d < num_devices && d < static_cast<int>(options.bfc_memory_limit.size()); ++d) {
    if (options.bfc_memory_limit[d] <= 0) continue;
    DeviceTimeline& device = result->devices[d];
    // The loops' body events, from one run of the order (an allocator without limit).
    // Only needed where a loop is played beside another.
    LoopScripts loops;
    bool beside = false;
    if (!table.loops.loops.empty()) {
      loops.events.assign(table.loops.loops.size(), {});
      BfcAllocatorModel unlimited(std::numeric_limits<int64_t>::max() / 4);
      AllocatorListener recorder(table, order, device_of_node, device_of_buffer, d, &unlimited,
                                 nullptr, &loops);
      if (recorder.plays_iterations()) {
        loops.concurrent = IndependentLoops(table);
        for (const std::vector<bool>& row : loops.concurrent) {
          beside = beside || std::find(row.begin(), row.end(), true) != row.end();
        }
      }
      if (beside) {
        replay.Run(order.size(), &recorder);
        recorder.EndStep();
      }
    }
    bool first = true;
    for (ResidentHistory history : options.allocator_histories) {
      BfcAllocatorModel allocator(
          options.bfc_memory_limit[d],
          d < static_cast<int>(options.bfc_first_region.size()) ? options.bfc_first_region[d] : 0);
      const bool observed = history == ResidentHistory::kObserved &&
                            d < static_cast<int>(options.bfc_pool.size()) &&
                            !options.bfc_pool[d].empty();
      if (observed) allocator.LoadPool(options.bfc_pool[d]);
      AllocatorListener listener(table, order, device_of_node, device_of_buffer, d, &allocator,
                                 beside ? &loops : nullptr);
      listener.set_beside(&started_beside);
      listener.AllocateResident(observed || history != ResidentHistory::kObserved
                                    ? history
                                    : ResidentHistory::kGraphOrder);
      std::vector<int64_t> step_peaks;
      int64_t peak = 0;
      for (int step = 0; step < warmup + measured; ++step) {
        allocator.ResetPeak();
        // benchmarks/trace_step_memory.py reads one replay: the first history's.
        listener.set_log(first && step == warmup + measured - 1);
        listener.set_measuring(step >= warmup);
        replay.Run(order.size(), &listener);
        listener.EndStep();
        if (step < warmup) continue;
        step_peaks.push_back(allocator.peak_bytes_in_use());
        peak = std::max(peak, allocator.peak_bytes_in_use());
      }
      const bool refused = listener.refused_bytes() > 0;
      device.allocator_history_peak_bytes.emplace_back(history, refused ? 0 : peak);
      const bool worse = first || (refused && device.allocator_refused_bytes <= 0) ||
                         (refused == (device.allocator_refused_bytes > 0) &&
                          peak > device.allocator_peak_bytes);
      first = false;
      if (!worse) continue;
      device.allocator_history = history;
      device.allocator_peak_bytes = peak;
      device.allocator_step_peak_bytes = std::move(step_peaks);
      device.allocator_refused_bytes = listener.refused_bytes();
      device.allocator_refused = listener.refused();
      device.allocator_peak_step = listener.peak_step();
      device.allocator_refused_step = listener.refused_step();
      if (refused) listener.DescribeRefusal(&device);
    }
    // The buffers live where the allocator peaks and where it refuses.
    for (auto [at, live] : {std::make_pair(device.allocator_peak_step, &device.live_at_allocator_peak),
                            std::make_pair(device.allocator_refused_step, &device.live_at_refusal)}) {
      if (at < 0) continue;
      PeakSetListener set(table, at, d, device_of_buffer, &replay, live);
      replay.Run(at, &set);
    }
  }
  auto largest_first = [&](int a, int b) {
    if (table.buffers[a].bytes != table.buffers[b].bytes) {
      return table.buffers[a].bytes > table.buffers[b].bytes;
    }
    return a < b;
  };
  for (DeviceTimeline& timeline : result->devices) {
    for (std::vector<int>* live : {&timeline.live_at_peak, &timeline.live_at_allocator_peak,
                                   &timeline.live_at_refusal}) {
      std::sort(live->begin(), live->end(), largest_first);
    }
  }
  return absl::OkStatus();
}

const char* ResidentHistoryName(ResidentHistory history) {
  switch (history) {
    case ResidentHistory::kGraphOrder:
      return "graph order";
    case ResidentHistory::kReverseGraphOrder:
      return "reverse graph order";
    case ResidentHistory::kLargestFirst:
      return "largest first";
    case ResidentHistory::kInitialValueTemporaries:
      return "initial values in temporaries";
    case ResidentHistory::kObserved:
      return "observed";
  }
  return "?";
}

}  // namespace tfmemopt
