// Simulate: live bytes per device at every step of an execution order.
//
// The planner, the report and the tests all use this one simulator, so that "the
// plan fits" and "the report says it fits" cannot disagree.
//
// Model: a step runs one node. Its output buffers are allocated, then (inputs and
// outputs both live) the step's live bytes are taken, then every buffer whose last
// reader was this node is freed. Persistent buffers (variables, constants) are live
// for the whole step, and so are the caller's inputs (external buffers). Fetched
// tensors are never freed. Forwarding ops share buffers (TensorTable::buffers), so a
// Reshape costs nothing and extends its input's life. What TF's kernels and
// executor add, each measured on the benchmark models:
//  * in-place reuse: an element-wise op whose input buffer has no other reader left
//    writes its output into that buffer (NodeInfo::reusable_inputs);
//  * copy-on-write: updating a variable while a read of it is still live copies
//    the variable, and the old buffer lives until those reads are done
//    (NodeInfo::updated_variables);
//  * kernel memory beyond outputs: scratch (NodeInfo::temp_bytes) during the
//    step, and extra buffers such as oneDNN workspaces (NodeInfo::extra_buffers)
//    until their reader has run.
#ifndef TFMEMOPT_GRAPPLER_SIMULATE_LIVENESS_SIMULATOR_H_
#define TFMEMOPT_GRAPPLER_SIMULATE_LIVENESS_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "grappler/simulate/bfc_allocator_model.h"

#include "absl/status/status.h"
#include "grappler/analyze/tensor_table.h"

namespace tfmemopt {

// How the allocator's memory was used before the step: what shapes the free chunks
// the step finds. The resident buffers (variables, constants, the caller's inputs)
// were created before the graph ran, eagerly, in an order the graph does not keep,
// and each variable's initial value was computed in a temporary of its size before
// it was assigned. BFC never gives a region back, so that history decides which
// chunks the step's tensors land in, and a chunk less than twice a request is not
// split: the same script's peak moves by tens of MiB from one process to the next
// (docs/accuracy.md: text_cnn's unplanned peak measured 103.4 to 148.6 MiB). The model
// cannot know the history, so it replays several plausible ones.
enum class ResidentHistory {
  kGraphOrder,          // resident buffers made in the graph's order
  kReverseGraphOrder,   // ... in the reverse order
  kLargestFirst,        // ... largest first
  kInitialValueTemporaries,  // graph order, each variable's initial value computed in
                             // a temporary of its size, freed once assigned
  kObserved,  // the pool as the pass read it off the live allocator
              // (SimulationOptions::bfc_pool), the resident buffers in its chunks
};
const char* ResidentHistoryName(ResidentHistory history);

struct DeviceTimeline {
  std::string device;
  int64_t persistent_bytes = 0;
  // Peak of persistent + transient bytes, and the first step that reaches it.
  int64_t peak_bytes = 0;
  int peak_step = -1;
  // Transient live bytes during each step of the order (outputs allocated, inputs
  // not yet released), by role; the persistent part is constant and kept above, so
  // persistent + max(activation + gradient) == peak_bytes.
  std::vector<int64_t> activation_bytes;
  std::vector<int64_t> gradient_bytes;
  // Buffers live at the peak step, largest first (buffer indices); kernels' extra
  // buffers (NodeInfo::extra_buffers) count in the peak but are not listed.
  std::vector<int> live_at_peak;
  // Peak bytes in use as TF's BFC allocator would count them (whole chunks): the
  // highest over the measured steps that follow the warm-up steps
  // (SimulationOptions); 0 when the device's allocator is not modelled.
  int64_t allocator_peak_bytes = 0;
  // That peak for each measured step, in order.
  std::vector<int64_t> allocator_step_peak_bytes;
  // The history (SimulationOptions::allocator_histories) whose replay these allocator
  // fields describe: the worst one. And each history with its peak, in the options'
  // order (0 for one that refused).
  ResidentHistory allocator_history = ResidentHistory::kGraphOrder;
  std::vector<std::pair<ResidentHistory, int64_t>> allocator_history_peak_bytes;
  // The first allocation the allocator model could not place, or 0 bytes: BFC would
  // run out of memory there even when the peak is below its limit, because a tensor
  // must fit in one of its regions (which start at 2 MiB, double and never merge).
  int64_t allocator_refused_bytes = 0;
  std::string allocator_refused;  // the tensor, or "scratch of <node>"
  // Where the allocator model's peak and its first refusal happen, for the planner
  // to act there (plan/objective.h): the step of the order, and the buffers live at
  // that step (as live_at_peak lists them; -1 and empty when there is none).
  int allocator_peak_step = -1;
  std::vector<int> live_at_allocator_peak;
  int allocator_refused_step = -1;
  std::vector<int> live_at_refusal;
  // At the refusal: the largest free chunk, the bytes BFC could still add as new
  // regions, and the regions large enough to hold the request, each as its chunks
  // in address order (bytes, and the buffer whose chunk it is: a buffer index, -1
  // for a free chunk, -2 for memory no graph buffer owns, such as an old copy of an
  // updated variable).
  int64_t allocator_largest_free_bytes = 0;
  int64_t allocator_unallocated_bytes = 0;
  struct RegionChunk {
    int64_t bytes = 0;
    int buffer = -1;
  };
  std::vector<std::vector<RegionChunk>> allocator_regions_at_refusal;

  // Host bytes held off the device by swapped-out tensors at each step (filled by
  // the report, empty when nothing is swapped).
  std::vector<int64_t> host_bytes;
};

struct SimulationOptions {
  // Per device (TensorTable::devices order): the BFC memory limit to model, or 0
  // for devices whose allocator is not BFC. Empty: no allocator model.
  std::vector<int64_t> bfc_memory_limit;
  // Per device, beside bfc_memory_limit: a region the pool already holds when the
  // step starts (MemoryOptimizerOptions::allocator_region_bytes); 0 or missing: none.
  std::vector<int64_t> bfc_first_region;
  // Per device, beside bfc_memory_limit: the pool as the pass read it off the device's
  // live allocator when it ran (grappler/analyze/allocator_state.h), in place of a
  // history and of bfc_first_region; empty or missing: not read. With kObserved the
  // model starts from it: each resident buffer in a chunk in use that could hold it,
  // the other chunks in use held by what lives outside the graph (not counted in the
  // peak, as held_outside_bytes is not).
  std::vector<std::vector<PoolChunk>> bfc_pool;
  // The allocator model runs the order `warmup_steps` times (BFC's regions grow
  // during the first steps), then `measured_steps` more times and keeps the
  // highest peak. The peak moves from step to step: a variable that an update
  // copies (copy-on-write) ends up in another chunk, so fragmentation drifts as
  // in a real training run.
  int warmup_steps = 2;
  int measured_steps = 5;
  // The histories replayed before the warm-up steps, each from an empty allocator;
  // the worst one (a refusal, else the highest peak) is the device's allocator
  // prediction. A plan fits only when it fits after every one of them.
  // TF's inter-op threads (StartedBeside); 0: the machine's, TF's default; 1: one
  // kernel at a time.
  int inter_op_threads = 1;
  std::vector<ResidentHistory> allocator_histories = {
      ResidentHistory::kGraphOrder, ResidentHistory::kReverseGraphOrder,
      ResidentHistory::kLargestFirst, ResidentHistory::kInitialValueTemporaries};
};

struct SimulationResult {
  std::vector<int> order;  // node indices, the order simulated
  std::vector<DeviceTimeline> devices;  // same order as TensorTable::devices
};

// Which of the expensive successors that a finished kernel makes ready at once TF's
// executor runs inline (the others go to the inter-op pool). TF takes the one its
// out-edge list holds last; that list's order is not fixed by the graph (an EdgeSet
// past eight edges, kInline in edgeset.h, is ordered by the edges' addresses), so it
// can differ from one machine or process to another.
enum class InlineChoice {
  kNearestUpdate,  // nearest to a variable update, then the largest output (what
                   // was measured on ResNet50 and the MLP; the default)
  kFirstInGraph,   // the first in the sorted graph's order
  kLastInGraph,    // the last in the sorted graph's order
};

// What runs beside each step's kernel: with two or more inter-op threads, of the
// expensive kernels that one kernel's end makes ready, TF's executor runs one inline
// and starts the next at once on the pool (ExecutorOrder's rules; the emulated order
// runs it only after the first one's inline successors). While the first runs, the
// second holds its outputs and its scratch. A convolution's filter and data
// gradients are such a pair: on TF's own CPU kernels (no oneDNN) each holds tens of
// MiB of im2col scratch. Per step of `order`, the bytes of the chunks the kernel
// started beside it holds (empty: none); only where one of the two has scratch
// (NodeInfo::temp_bytes), both on one device, outside loops.
std::vector<std::vector<int64_t>> StartedBeside(const TensorTable& table,
                                                const std::vector<int>& order,
                                                const std::vector<int>& position,
                                                int inter_op_threads);

// Whether TF's executor runs node `n`'s kernel as a task of its own (expensive)
// rather than inline: its kernel class may be expensive and, after the first step's
// cost measurement, it still takes more than a few microseconds (by its bytes).
bool IsExpensiveKernel(const TensorTable& table, int n);

// The order in which TF's executor runs the graph's kernels, emulated from its
// scheduling rules (see ExecutorOrder in the .cc): a topological order of the
// table's graph, with loop back edges (NextIteration -> Merge) ignored.
absl::Status ExecutorOrder(const TensorTable& table, std::vector<int>* order,
                           InlineChoice choice = InlineChoice::kNearestUpdate);

// The order to simulate a graph in: ExecutorOrder.
absl::Status TopologicalOrder(const tensorflow::GraphDef& graph,
                              const TensorTable& table, std::vector<int>* order);

absl::Status Simulate(const TensorTable& table, const std::vector<int>& order,
                      const SimulationOptions& options, SimulationResult* result);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_SIMULATE_LIVENESS_SIMULATOR_H_
