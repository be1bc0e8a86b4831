// Options of the TfMemOpt pass, parsed from the custom optimizer's parameter_map.
//
// The schema is protos/rewriter_config_ext.proto (tfmemopt.MemoryOptimizerConfig).
// Each parameter_map key is one field name of that message. The C++ side cannot use
// protoc-generated classes against TF's bundled protobuf, so the fields are listed
// again in kOptionFields (memory_optimizer_options.cc); a Python test compares that
// table with the proto so the two cannot drift apart.
#ifndef TFMEMOPT_GRAPPLER_MEMORY_OPTIMIZER_OPTIONS_H_
#define TFMEMOPT_GRAPPLER_MEMORY_OPTIMIZER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/protobuf/rewriter_config.pb.h"

namespace tfmemopt {

enum class Mode { kAuto = 0, kAnalyzeOnly = 1, kManual = 2 };
enum class RecomputePolicy { kAuto = 0, kSqrt = 1, kManual = 2 };

// min_tensor_bytes' default: no fixed threshold, see AdaptiveMinTensorBytesSteps.
inline constexpr int64_t kAdaptiveMinTensorBytes = -1;

struct MemoryOptimizerOptions {
  // Per-device budget in bytes; 0 means "budget_fraction of the device memory".
  int64_t budget_bytes = 0;
  // Fraction of the device memory that the Grappler cluster reports, in (0, 1].
  double budget_fraction = 0.9;
  Mode mode = Mode::kAuto;
  bool enable_swap = true;
  bool enable_recompute = true;
  bool enable_schedule = true;
  // Split per-sample work along the batch when nothing else meets the budget.
  bool enable_split = true;
  // Splitting may pass through the gradient of a mean over the batch (batch
  // normalization's) when no other split fits; see the proto field.
  bool split_batch_statistics = true;
  // Below this size a tensor is never swapped or recomputed. kAdaptiveMinTensorBytes
  // (the default): 1 MiB while the budget can be met without smaller tensors, lower
  // steps (AdaptiveMinTensorBytesSteps) when it cannot.
  int64_t min_tensor_bytes = kAdaptiveMinTensorBytes;
  std::vector<std::string> exclude_scopes;
  std::vector<std::string> include_scopes;
  std::vector<std::string> exclude_op_types;
  std::vector<std::string> include_op_types;
  // Device <-> host copy bandwidth for the swap cost model; 0 = measured default.
  double host_bandwidth_bytes_per_sec = 0;
  bool fail_on_infeasible = false;
  // 0 silent, 1 one INFO line per graph, 2 also the tensors at the peak.
  int log_level = 1;
  // Stand-in for an unknown batch dimension; 0 leaves it unresolved.
  int64_t assume_batch_size = 0;
  RecomputePolicy recompute_policy = RecomputePolicy::kAuto;
  // Name scopes recomputed under RecomputePolicy::kManual.
  std::vector<std::string> recompute_scopes;
  // At most this many tensors are swapped; 0: no limit.
  int64_t max_swapped_tensors = 0;
  // Bounds in ops on how far ahead of its first reader a swap-in starts; 0: none.
  int swapin_lead_ops = 0;
  int swapin_lag_ops = 0;
  bool fuse_swapins = true;
  // Stand-in for the trip count of a loop whose condition does not give it; 0
  // leaves such loops unsized.
  int64_t assume_trip_count = 0;
  // Keep loops in step when the graph changes (rewrite/loop_pacing.h).
  bool pace_loops = true;
  // A budget_fraction is of the device's memory: what its allocator holds when the
  // graph is planned, beyond the graph's own persistent buffers and inputs (a
  // dataset, another model, eager tensors), is taken from it
  // (DeviceReport::held_outside_bytes). budget_bytes is the step's own.
  bool count_memory_held_outside = true;
  // A BFC region of this many bytes that every BFC device's pool holds before the
  // step (a GPU without memory growth: its whole memory; the CPU test bed after
  // tfmemopt.enable() reserved it); 0: the pool grows from 2 MiB regions.
  int64_t allocator_region_bytes = 0;
  // Start the allocator model from the live pool where the pass can read it
  // (grappler/analyze/allocator_state.h) instead of replaying histories.
  bool observe_allocator = false;
  // Inter-op threads the simulator assumes for kernels that start together
  // (simulate/liveness_simulator.h, StartedBeside); 0: the machine's (TF's default
  // pool); 1: one kernel at a time.
  int model_inter_op_threads = 1;
  // Test-only: name of the stage that must fail ("" = none).
  std::string test_only_fail_stage;
  // Test-only: bytes a changed graph holds through its step, unpredicted
  // (rewrite/test_only_hold.h); 0 = none.
  int64_t test_only_hold_bytes = 0;
  // Test-only: skip BreakMergeCycles (rewrite/onednn_merge_guard.h), so that TF
  // cannot build a rewritten graph that has such a path.
  bool test_only_keep_merge_cycles = false;
};

// Fills `options` from a custom optimizer entry. Unknown keys, values of the wrong
// AttrValue kind and out-of-range values yield InvalidArgument naming the key, the
// value and what is allowed. A null `config` leaves the defaults.
absl::Status ParseMemoryOptimizerOptions(
    const tensorflow::RewriterConfig_CustomGraphOptimizer* config,
    MemoryOptimizerOptions* options);

// The schema as the C++ side knows it, as JSON:
// {"field": {"type": "int64|double|bool|string|enum|repeated_string",
//            "default": ..., "values": [...enum names]}, ...}
std::string OptionSchemaJson();

// The thresholds the planner tries, in turn, for min_tensor_bytes: the user's value
// alone when one is set, else 1 MiB, 64 KiB and 0. Small tensors are many and rarely
// matter, so they are left out while the budget can be met without them (planning
// stays fast); a graph of many mid-sized tensors (a chain of 1 MB activations) still
// gets a plan when the budget needs them.
std::vector<int64_t> AdaptiveMinTensorBytesSteps(const MemoryOptimizerOptions& options);

const char* ModeName(Mode mode);
const char* RecomputePolicyName(RecomputePolicy policy);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_MEMORY_OPTIMIZER_OPTIONS_H_
