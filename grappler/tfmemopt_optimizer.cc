#include "grappler/tfmemopt_optimizer.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>

#include <unistd.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/analyze/allocator_state.h"
#include "grappler/analyze/arrival_order_sums.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/executed_nodes.h"
#include "grappler/analyze/initial_values.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/plan/memory_planner.h"
#include "grappler/plan/order_guard.h"
#include "grappler/rewrite/loop_pacing.h"
#include "grappler/rewrite/onednn_merge_guard.h"
#include "grappler/plan/pin_order.h"
#include "grappler/plan/schedule.h"
#include "grappler/plan/split_choice.h"
#include "grappler/report/loop_report.h"
#include "grappler/report/memory_report.h"
#include "grappler/report/table_export.h"
#include "grappler/rewrite/recompute_pass.h"
#include "grappler/rewrite/test_only_hold.h"
#include "grappler/simulate/liveness_simulator.h"
#include "grappler/verify/graph_verifier.h"
#include "tensorflow/core/common_runtime/device_set.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/grappler/clusters/cluster.h"
#include "tensorflow/core/grappler/grappler_item_builder.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer_registry.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

using tensorflow::grappler::Cluster;
using tensorflow::grappler::GrapplerItem;

// TF's CPU test bed switches the CPU allocator to BFC and caps it through the
// environment; the Grappler cluster does not know about it, so it is read here.
bool CpuUsesBfc() {
  const char* use_bfc = std::getenv("TF_CPU_ALLOCATOR_USE_BFC");
  if (use_bfc == nullptr) return false;
  const std::string flag(use_bfc);
  return flag == "true" || flag == "1" || flag == "True";
}

// The CPU BFC cap in bytes; TF's default is 64 GiB when none is set. 0: no BFC.
int64_t CpuBfcLimitBytes() {
  if (!CpuUsesBfc()) return 0;
  const char* limit_mb = std::getenv("TF_CPU_BFC_MEM_LIMIT_IN_MB");
  long long mb = 1LL << 16;
  if (limit_mb != nullptr) {
    char* end = nullptr;
    const long long parsed = std::strtoll(limit_mb, &end, 10);
    if (end != limit_mb && parsed > 0) mb = parsed;
  }
  return static_cast<int64_t>(mb) << 20;
}

int64_t HostRamBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : 0;
}

// The allocator of the cluster's device `device` (a short name), from the devices TF
// runs the graph on (a tf.function's or a Session's cluster has them; the Python
// grappler API's does not), or nullptr.
tensorflow::Allocator* DeviceAllocator(const Cluster* cluster, const std::string& device) {
  if (cluster == nullptr || cluster->GetDeviceSet() == nullptr) return nullptr;
  for (tensorflow::Device* candidate : cluster->GetDeviceSet()->devices()) {
    if (ShortDeviceName(candidate->name()) == device) {
      return candidate->GetAllocator(tensorflow::AllocatorAttributes());
    }
  }
  return nullptr;
}

// What the allocator of `device` holds now: -1 when unknown.
int64_t AllocatorBytesInUse(const Cluster* cluster, const std::string& device) {
  tensorflow::Allocator* allocator = DeviceAllocator(cluster, device);
  if (allocator == nullptr) return -1;
  const std::optional<tensorflow::AllocatorStats> stats = allocator->GetStats();
  return stats ? stats->bytes_in_use : -1;
}

// The part of what `device`'s allocator holds (`in_use`, -1: unknown) that `table`
// does not account for: not its persistent buffers (variables, kept initial values)
// nor its inputs (the caller allocated them before the step). Its constants are not
// allocated yet (TF makes them with their kernels, after Grappler), so they are not
// subtracted.
int64_t HeldOutsideBytes(const TensorTable& table, const std::string& device, int64_t in_use) {
  if (in_use <= 0) return 0;
  int64_t own = 0;
  for (const BufferInfo& buffer : table.buffers) {
    if (!(buffer.persistent || buffer.external) || buffer.device != device) continue;
    if (buffer.owner >= 0 && buffer.persistent &&
        table.nodes[table.tensors[buffer.owner].node].def->op() == "Const") {
      continue;
    }
    own += buffer.bytes;
  }
  return std::max<int64_t>(0, in_use - own);
}

// The cluster's only device, for an unplaced graph (a Session graph before
// placement, or a metagraph handed to tfmemopt.analyze_metagraph), which runs there;
// nullptr when the cluster has none or several.
const tensorflow::DeviceProperties* OnlyClusterDevice(const Cluster* cluster) {
  if (cluster == nullptr || cluster->GetDevices().size() != 1) return nullptr;
  return &cluster->GetDevices().begin()->second;
}

// Grappler's clusters describe a CPU with a nominal memory size (256 MiB in TF
// 2.21's VirtualCluster), so CPU memory is the BFC cap of the test bed if one is
// set, else the host's RAM. An unplaced graph counts as the CPU's when the cluster's
// only device is a CPU, or when there is no cluster to say.
void DescribeDeviceMemory(const Cluster* cluster, DeviceReport* device) {
  device->memory_source = "none";
  const tensorflow::DeviceProperties* only =
      device->device.empty() ? OnlyClusterDevice(cluster) : nullptr;
  const bool cpu = absl::StartsWith(device->device, "CPU") ||
                   (device->device.empty() && (only == nullptr || only->type() == "CPU"));
  if (cpu) {
    const int64_t bfc_limit = CpuBfcLimitBytes();
    if (bfc_limit > 0) {
      device->memory_bytes = std::min(bfc_limit, HostRamBytes());
      device->memory_source = "TF_CPU_BFC_MEM_LIMIT_IN_MB";
      device->allocator = "bfc";
      return;
    }
    if (!device->device.empty() || only != nullptr) {
      device->memory_bytes = HostRamBytes();
      device->memory_source = "host_ram";
      return;
    }
  }
  if (cluster == nullptr) return;
  if (only != nullptr) {
    device->memory_bytes = only->memory_size();
    device->memory_source = "cluster";
    return;
  }
  for (const auto& [name, properties] : cluster->GetDevices()) {
    if (ShortDeviceName(name) == device->device && properties.memory_size() > 0) {
      device->memory_bytes = properties.memory_size();
      device->memory_source = "cluster";
      // TF's GPU memory is a BFC allocator too.
      if (absl::StartsWith(device->device, "GPU")) device->allocator = "bfc";
      return;
    }
  }
}

// Logical CPU devices (tf.config.set_logical_device_configuration, as
// MirroredStrategy on one machine uses them) all allocate from the process's one
// CPU allocator: on the test bed, one BFC pool of TF_CPU_BFC_MEM_LIMIT_IN_MB. A graph
// spanning N of them gets 1/N of that pool per device, so that the replicas' peaks,
// which come together (they run in step), fit it together.
void ShareCpuAllocator(std::vector<DeviceReport>* devices) {
  int shared = 0;
  for (const DeviceReport& device : *devices) {
    shared += device.memory_source == "TF_CPU_BFC_MEM_LIMIT_IN_MB" ? 1 : 0;
  }
  if (shared < 2) return;
  for (DeviceReport& device : *devices) {
    if (device.memory_source != "TF_CPU_BFC_MEM_LIMIT_IN_MB") continue;
    device.memory_bytes /= shared;
    device.memory_shared_by = shared;
  }
}

class StageRunner {
 public:
  StageRunner(const MemoryOptimizerOptions& options, MemoryReport* report)
      : options_(options), report_(report) {}

  // Runs one stage, timed; a forced failure (test_only_fail_stage) stands in for
  // any error the stage could raise.
  absl::Status Run(const char* stage, const std::function<absl::Status()>& body) {
    current_ = stage;
    if (options_.test_only_fail_stage == stage) {
      return absl::InternalError("forced failure (test_only_fail_stage)");
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = body();
    report_->stage_seconds[stage] +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return status;
  }
  const std::string& current() const { return current_; }

 private:
  const MemoryOptimizerOptions& options_;
  MemoryReport* report_;
  std::string current_;
};

void FillPeakTensors(const TensorTable& table, const DeviceTimeline& timeline,
                     DeviceReport* device) {
  for (int b : timeline.live_at_peak) {
    if (device->top_tensors_at_peak.size() >= 10) break;
    const int owner = table.buffers[b].owner;
    const TensorInfo& tensor = table.tensors[owner];
    PeakTensor peak;
    peak.name = table.TensorName(owner);
    peak.op = table.nodes[tensor.node].def->op();
    peak.role = TensorRoleName(tensor.role);
    peak.bytes = table.buffers[b].bytes;
    device->top_tensors_at_peak.push_back(peak);
  }
}

void FillDeviceFigures(const TensorTable& table, const DeviceTimeline& timeline,
                       DeviceReport* device) {
  device->persistent_bytes = timeline.persistent_bytes;
  device->live_peak_bytes = timeline.peak_bytes;
  device->peak_after_bytes = PredictedPeak(timeline);
  device->peak_step = timeline.peak_step;
  device->allocator_refused_bytes = timeline.allocator_refused_bytes;
  device->allocator_refused = timeline.allocator_refused;
  device->allocator_history_peaks.clear();
  device->allocator_history.clear();
  if (!timeline.allocator_history_peak_bytes.empty()) {
    device->allocator_history = ResidentHistoryName(timeline.allocator_history);
    for (const auto& [history, peak] : timeline.allocator_history_peak_bytes) {
      device->allocator_history_peaks.emplace_back(ResidentHistoryName(history), peak);
    }
  }
  device->top_tensors_at_peak.clear();
  FillPeakTensors(table, timeline, device);
}

// Allocator settings for simulating `table` (a rewritten graph may use one more
// device than the report lists: the host a GPU swaps to).
SimulationOptions SimulationFor(const MemoryOptimizerOptions& options,
                                const std::vector<DeviceReport>& devices,
                                const TensorTable& table) {
  SimulationOptions simulation;
  simulation.inter_op_threads = options.model_inter_op_threads;
  bool observed = false;
  for (const std::string& name : table.devices) {
    int64_t limit = 0;
    int64_t region = 0;
    const std::vector<PoolChunk>* pool = nullptr;
    for (const DeviceReport& device : devices) {
      // Memory held outside the graph is not the step's to use (0 unless counted);
      // what holds it sits in the region the pool already has, if any.
      if (device.device == name && device.allocator == "bfc") {
        limit = std::max<int64_t>(1, device.memory_bytes - device.held_outside_bytes);
        region = std::clamp<int64_t>(device.allocator_region_bytes - device.held_outside_bytes,
                                     0, limit);
        // A pool read off the allocator holds what lives outside the graph in its
        // own chunks: the model gets the whole limit and keeps those chunks.
        if (!device.observed_pool.empty()) {
          limit = device.memory_bytes;
          pool = &device.observed_pool;
        }
      }
    }
    simulation.bfc_memory_limit.push_back(limit);
    simulation.bfc_first_region.push_back(region);
    simulation.bfc_pool.push_back(pool != nullptr ? *pool : std::vector<PoolChunk>());
    observed = observed || pool != nullptr;
  }
  // The pool as it is stands for every history the model would otherwise replay.
  if (observed) {
    simulation.allocator_histories = {ResidentHistory::kObserved};
    return simulation;
  }
  // A Session's initializer made the variables, in graph order, before the step:
  // that is the one history, and a plan built to fit the others would hold back
  // memory the step does not need (docs/allocator.md).
  if (table.variables_made_by_recorded_initializer) {
    simulation.allocator_histories = {ResidentHistory::kGraphOrder};
  }
  return simulation;
}

// Index of device `name` in a simulation's devices, or -1.
int DeviceIndex(const SimulationResult& simulation, const std::string& name) {
  for (size_t d = 0; d < simulation.devices.size(); ++d) {
    if (simulation.devices[d].device == name) return static_cast<int>(d);
  }
  return -1;
}

// OK when the rewritten graph (`after`) predicts no higher peak than the original
// (`before`) on any of the original's devices; else what rose, and where.
absl::Status PeakNotRaised(const SimulationResult& before, const SimulationResult& after) {
  for (const DeviceTimeline& device : before.devices) {
    const int a = DeviceIndex(after, device.device);
    if (a < 0) {
      return absl::InternalError(
          absl::StrCat("the rewritten graph no longer uses ", device.device));
    }
    if (PredictedPeak(after.devices[a]) > PredictedPeak(device)) {
      return absl::InternalError(absl::StrCat(
          "the rewritten graph's predicted peak on ", device.device, " (",
          FormatBytes(PredictedPeak(after.devices[a])), ") exceeds the original's (",
          FormatBytes(PredictedPeak(device)), ")"));
    }
  }
  return absl::OkStatus();
}

void FillSplitReport(const SplitOutcome& split, SplitReport* report) {
  report->planned = split.planned;
  report->applied = split.applied;
  report->batch = split.batch;
  report->note = split.note;
  report->left_alone = split.left_alone;
  for (const SplitTrial& trial : split.trials) {
    report->trials.push_back({trial.slices, trial.region_nodes, trial.peak_bytes, trial.fits,
                              trial.added_seconds, trial.through_batch_statistics});
  }
  if (!split.applied) return;
  report->slices = split.spec.slices;
  report->rows = split.summary.rows;
  report->stages = split.summary.stages;
  report->ops = split.region;
  report->op_types = split.region_ops;
  report->cuts = split.summary.cuts;
  report->joins = split.summary.joins;
  report->sums = split.summary.sums;
  report->shape_constants = split.summary.shape_constants;
  report->added_nodes = split.summary.added_nodes;
  report->added_seconds = split.added_seconds;
  report->through_batch_statistics = split.through_batch_statistics;
}

MemoryPlannerOptions PlannerOptions(const MemoryOptimizerOptions& options,
                                    const std::vector<DeviceReport>& devices,
                                    const TensorTable& table) {
  MemoryPlannerOptions planner;
  planner.policy = options.mode == Mode::kManual ? RecomputePolicy::kManual
                                                 : options.recompute_policy;
  planner.enable_recompute = options.enable_recompute;
  // MANUAL means only what the user hinted: no swapping on the planner's initiative.
  planner.enable_swap = options.enable_swap && options.mode != Mode::kManual;
  planner.max_swapped_tensors = options.max_swapped_tensors;
  planner.swap.bandwidth_bytes_per_sec = options.host_bandwidth_bytes_per_sec;
  planner.swap.lead_ops = options.swapin_lead_ops;
  planner.swap.lag_ops = options.swapin_lag_ops;
  planner.swap.fuse_swapins = options.fuse_swapins;
  for (const DeviceReport& device : devices) planner.budget_bytes.push_back(device.budget_bytes);
  planner.min_tensor_bytes = AdaptiveMinTensorBytesSteps(options).front();
  planner.exclude_scopes = options.exclude_scopes;
  planner.include_scopes = options.include_scopes;
  planner.exclude_op_types = options.exclude_op_types;
  planner.include_op_types = options.include_op_types;
  planner.hint_scopes = options.recompute_scopes;
  planner.simulation = SimulationFor(options, devices, table);
  return planner;
}

// The most bytes, per device of `table`, that the producers PaceLoops made wait
// could hold by running ahead: each producer's outputs for every iteration its loop
// may run at once beyond the one the simulation runs (parallel_iterations - 1).
std::vector<int64_t> RunAheadBytes(const TensorTable& table, const LoopPacingResult& paced) {
  std::vector<int64_t> bytes(table.devices.size(), 0);
  absl::flat_hash_set<int> counted;
  for (const auto& [waited_for, waiting] : paced.edges) {
    auto it = table.node_index.find(waiting);
    if (it == table.node_index.end() || !counted.insert(it->second).second) continue;
    const int n = it->second;
    const int loop = LoopOf(table, n);
    if (loop < 0) continue;
    const int64_t ahead = table.loops.loops[loop].parallel_iterations - 1;
    auto device = std::lower_bound(table.devices.begin(), table.devices.end(),
                                   table.nodes[n].device);
    if (ahead <= 0 || device == table.devices.end() || *device != table.nodes[n].device) continue;
    bytes[device - table.devices.begin()] += ahead * AllocatedOutputBytes(table, n);
  }
  return bytes;
}

// Sets each device's budget; true if some device's peak before is over it.
bool SetBudgets(const MemoryOptimizerOptions& options, std::vector<DeviceReport>* devices) {
  bool over_budget = false;
  for (DeviceReport& device : *devices) {
    if (options.budget_bytes > 0) {
      device.budget_bytes = options.budget_bytes;
    } else if (device.memory_bytes > 0) {
      device.budget_bytes =
          static_cast<int64_t>(options.budget_fraction * static_cast<double>(device.memory_bytes));
    }
    // A fraction of the device's memory: the step gets what is left of it once the
    // memory held outside the graph is taken (never 0, which means "no budget"); the
    // report says how much was held. budget_bytes is the step's own.
    if (options.count_memory_held_outside && options.budget_bytes == 0 &&
        device.budget_bytes > 0) {
      device.budget_bytes = std::max<int64_t>(1, device.budget_bytes - device.held_outside_bytes);
    } else {
      device.held_outside_bytes = 0;
    }
    over_budget |= device.budget_bytes > 0 && device.peak_before_bytes > device.budget_bytes;
  }
  return over_budget;
}

// How far a plan is from its budgets: 0 when it fits, else its largest overshoot.
int64_t Overshoot(const MemoryPlan& plan, const MemoryPlannerOptions& planner) {
  int64_t worst = 0;
  for (size_t d = 0; d < plan.peak_bytes.size() && d < planner.budget_bytes.size(); ++d) {
    if (planner.budget_bytes[d] > 0) {
      worst = std::max(worst, plan.peak_bytes[d] - planner.budget_bytes[d]);
    }
  }
  return plan.feasible ? 0 : std::max<int64_t>(worst, 1);
}

// How far below a missed budget's reached peak the second search aims: 2.5 % of it,
// and at least 1 MiB.
int64_t ReplanStepBytes(int64_t peak) {
  return std::max<int64_t>(int64_t{1} << 20, peak / 40);
}

// Plans with each min_tensor_bytes threshold of AdaptiveMinTensorBytesSteps in turn
// until a plan fits, keeping the plan that comes closest to the budget. A lower
// threshold is tried only when some tensor is newly admitted by it, and the cascade
// stops when admitting smaller tensors did not bring the peak down.
absl::Status PlanWithAdaptiveThreshold(const MemoryOptimizerOptions& options,
                                       const TensorTable& table, const std::vector<int>& order,
                                       const ControlFlowInfo& flow,
                                       MemoryPlannerOptions planner, MemoryPlan* plan,
                                       PlannedRewrite* rewrite, SimulationResult* planned,
                                       int64_t* used_threshold) {
  const std::vector<int64_t> thresholds = AdaptiveMinTensorBytesSteps(options);
  int simulations = 0;
  // Plans under `attempt` and takes that plan when `take(candidate)` says so
  // (`*taken`); `judged_infeasible`: the plan misses the real budgets whatever it
  // met.
  auto plan_under = [&](const MemoryPlannerOptions& attempt, bool judged_infeasible,
                        const std::function<bool(const MemoryPlan&)>& take,
                        bool* taken) -> absl::Status {
    MemoryPlan candidate;
    PlannedRewrite candidate_rewrite;
    SimulationResult candidate_simulation;
    absl::Status status = PlanMemory(table, order, flow, attempt, &candidate,
                                     &candidate_rewrite, &candidate_simulation);
    if (!status.ok()) return status;
    simulations += candidate.simulations;
    if (judged_infeasible) candidate.feasible = false;
    *taken = take(candidate);
    if (*taken) {
      *plan = std::move(candidate);
      *rewrite = std::move(candidate_rewrite);
      *planned = std::move(candidate_simulation);
      *used_threshold = attempt.min_tensor_bytes;
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < thresholds.size(); ++i) {
    if (i > 0) {
      bool admits_more = false;
      for (const TensorInfo& tensor : table.tensors) {
        admits_more |= tensor.bytes >= thresholds[i] && tensor.bytes < thresholds[i - 1];
      }
      if (!admits_more) continue;
    }
    planner.min_tensor_bytes = thresholds[i];
    const bool first = i == 0;
    bool better = false;
    absl::Status status = plan_under(planner, false, [&](const MemoryPlan& candidate) {
      return first || Overshoot(candidate, planner) < Overshoot(*plan, planner);
    }, &better);
    if (!status.ok()) return status;
    if (plan->feasible || (!first && !better)) break;
  }
  // A search that misses its budget by much can come back with nothing where a
  // looser budget finds a plan that lowers the peak: to cover a large excess the
  // descent takes several candidates at once, and BFC's chunks can make them worth
  // nothing. Then "the smallest peak reachable" would be the unchanged step's. So a
  // plan that chose nothing is planned once more, under budgets just below its
  // peak (a step of ReplanStepBytes), and kept when it comes closer to the budgets
  // (judged against them: it misses them).
  const bool chose_nothing = plan->recompute_nodes.empty() && plan->swap_tensors.empty() &&
                             plan->loop_swap_lists.empty();
  if (!plan->feasible && chose_nothing) {
    MemoryPlannerOptions looser = planner;
    bool loosened = false;
    for (size_t d = 0; d < looser.budget_bytes.size() && d < plan->peak_bytes.size(); ++d) {
      const int64_t peak = plan->peak_bytes[d];
      if (looser.budget_bytes[d] <= 0 || peak <= looser.budget_bytes[d]) continue;
      const int64_t aim = peak - ReplanStepBytes(peak);
      if (aim <= looser.budget_bytes[d]) continue;  // the same budget: the same plan
      looser.budget_bytes[d] = aim;
      loosened = true;
    }
    bool taken = false;
    absl::Status status = loosened ? plan_under(looser, true, [&](const MemoryPlan& candidate) {
      return Overshoot(candidate, planner) < Overshoot(*plan, planner);
    }, &taken) : absl::OkStatus();
    if (!status.ok()) return status;
  }
  plan->simulations = simulations;
  return absl::OkStatus();
}

absl::Status RunPipeline(const MemoryOptimizerOptions& options, Cluster* cluster,
                         const GrapplerItem& item, tensorflow::GraphDef* output,
                         MemoryReport* report, StageRunner* stages) {
  TensorTable table;
  absl::Status status = stages->Run("analyze", [&] {
    return BuildTensorTable(item, options, &table);
  });
  if (!status.ok()) return status;
  report->num_tensors = static_cast<int>(table.tensors.size());
  report->unresolved_tensors = 0;
  report->unresolved_variants = 0;
  for (int t : table.unresolved_tensors) {
    if (table.tensors[t].dtype == tensorflow::DT_VARIANT) {
      ++report->unresolved_variants;
      continue;
    }
    ++report->unresolved_tensors;
    if (report->unresolved_examples.size() < 5) {
      report->unresolved_examples.push_back(table.TensorName(t));
    }
  }
  report->batch_dims_resolved = table.batch_dims_resolved;
  report->batch_dims_assumed = table.batch_dims_assumed;
  if (VLOG_IS_ON(1)) {
    for (const BufferInfo& buffer : table.buffers) {
      if (!buffer.persistent || buffer.bytes == 0) continue;
      VLOG(1) << "TfMemOpt: graph " << item.id << ": persistent "
              << table.TensorName(buffer.owner) << " ("
              << table.nodes[table.tensors[buffer.owner].node].def->op() << ") "
              << FormatBytes(buffer.bytes);
    }
  }

  std::vector<DeviceReport> devices(table.devices.size());
  SimulationResult before;
  std::vector<int> order;
  ControlFlowInfo flow;
  status = stages->Run("simulate", [&] {
    for (size_t d = 0; d < table.devices.size(); ++d) {
      devices[d].device = table.devices[d];
      DescribeDeviceMemory(cluster, &devices[d]);
    }
    ShareCpuAllocator(&devices);
    for (DeviceReport& device : devices) {
      if (device.allocator != "bfc") continue;
      device.allocator_region_bytes =
          std::min(options.allocator_region_bytes / std::max(1, device.memory_shared_by),
                   device.memory_bytes);
      // The pool the step will use, as it is now: only where this device alone uses
      // it (logical CPUs share one pool) and its limit is the device's memory. Read
      // with observe_allocator, and always for a Session whose initializer the pass
      // saw: its variables were made in that process by a graph that ran before this
      // one, and the pool holds them as they are (with the regions its initial
      // values' temporaries grew), where a replay of graph order misses those.
      const bool observe =
          options.observe_allocator || table.variables_made_by_recorded_initializer;
      if (observe && device.memory_shared_by == 1 &&
          device.memory_source == "TF_CPU_BFC_MEM_LIMIT_IN_MB") {
        device.observed_pool = ReadBfcPool(DeviceAllocator(cluster, device.device));
        for (const PoolChunk& chunk : device.observed_pool) {
          device.observed_pool_bytes += chunk.bytes;
        }
      }
    }
    absl::Status s = TopologicalOrder(item.graph, table, &order);
    if (!s.ok()) return s;
    s = AnalyzeControlFlow(item.graph, table, order, &flow);
    if (!s.ok()) return s;
    return Simulate(table, order, SimulationFor(options, devices, table), &before);
  });
  if (!status.ok()) return status;
  for (size_t d = 0; d < devices.size(); ++d) {
    devices[d].peak_before_bytes = PredictedPeak(before.devices[d]);
    devices[d].allocator_refused_before_bytes = before.devices[d].allocator_refused_bytes;
    // Devices that share one allocator each take their share of what it holds.
    int64_t in_use = AllocatorBytesInUse(cluster, devices[d].device);
    if (in_use > 0) in_use /= std::max(1, devices[d].memory_shared_by);
    devices[d].held_outside_bytes = HeldOutsideBytes(table, devices[d].device, in_use);
  }
  for (const NodeInfo& node : table.nodes) report->recompute.step_seconds += node.compute_seconds;

  // A graph that already holds our nodes (or our scheduling edges) is our own
  // output, seen again by a later meta-optimizer iteration: it is only analyzed
  // (idempotence).
  const bool rewritten_before = HasTfMemOptNodes(item.graph) || HasScheduledNodes(item.graph);
  bool over_budget = SetBudgets(options, &devices);
  // Below the budget, BFC may still be unable to place a tensor in its regions (the
  // allocator model refuses it): only a split can help there.
  bool refused = false;
  for (size_t d = 0; d < devices.size(); ++d) {
    refused |= devices[d].budget_bytes > 0 && before.devices[d].allocator_refused_bytes > 0;
  }

  // Schedule: control edges that lower the peak before anything is swapped or
  // recomputed. The planner then plans on the scheduled graph, analyzed afresh.
  Schedule schedule;
  GrapplerItem scheduled;
  status = stages->Run("schedule", [&] {
    if (!options.enable_schedule || options.mode == Mode::kAnalyzeOnly ||
        options.mode == Mode::kManual || rewritten_before || !over_budget) {
      return absl::OkStatus();
    }
    report->schedule.planned = true;
    ScheduleOptions scheduling;
    scheduling.simulation = SimulationFor(options, devices, table);
    scheduling.min_gain_bytes = AdaptiveMinTensorBytesSteps(options).front();
    absl::Status s = PlanSchedule(table, flow, before, scheduling, &schedule);
    if (!s.ok()) return s;
    report->schedule.simulations = schedule.simulations;
    for (size_t d = 0; d < devices.size(); ++d) {
      report->schedule.peak_before_bytes[devices[d].device] = schedule.peak_before[d];
      report->schedule.peak_after_bytes[devices[d].device] = schedule.peak_after[d];
      report->schedule.backward_peak_before_bytes[devices[d].device] =
          schedule.backward_peak_before[d];
      report->schedule.backward_peak_after_bytes[devices[d].device] =
          schedule.backward_peak_after[d];
    }
    if (schedule.edges.empty()) return absl::OkStatus();
    for (const auto& [from, to] : schedule.edges) {
      report->schedule.edges.push_back({table.nodes[from].def->name(), table.nodes[to].def->name()});
    }
    s = ApplySchedule(table, schedule, output);
    if (!s.ok()) return s;
    scheduled = item.WithGraph(tensorflow::GraphDef(*output));
    TensorTable scheduled_table;
    s = BuildTensorTable(scheduled, options, &scheduled_table);
    if (!s.ok()) return s;
    table = std::move(scheduled_table);
    s = TopologicalOrder(scheduled.graph, table, &order);
    if (!s.ok()) return s;
    s = AnalyzeControlFlow(scheduled.graph, table, order, &flow);
    if (!s.ok()) return s;
    // The scheduled graph, analyzed afresh, is what the budget is checked against.
    SimulationResult now;
    s = Simulate(table, order, SimulationFor(options, devices, table), &now);
    if (!s.ok()) return s;
    over_budget = false;
    for (size_t d = 0; d < devices.size(); ++d) {
      over_budget |= devices[d].budget_bytes > 0 &&
                     PredictedPeak(now.devices[d]) > devices[d].budget_bytes;
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;

  // Plan.
  MemoryPlan plan;
  PlannedRewrite rewrite;
  SimulationResult planned;
  SplitOutcome split;
  // The table the plan's indices refer to: the split graph's when a split is chosen.
  const TensorTable* planned_table = &table;
  status = stages->Run("plan", [&] {
    MemoryPlannerOptions planner = PlannerOptions(options, devices, table);
    const bool hinted_recompute =
        planner.enable_recompute && planner.policy != RecomputePolicy::kAuto;
    const bool may_split = options.enable_split && options.mode == Mode::kAuto;
    const bool wanted =
        hinted_recompute ||
        (over_budget && (planner.enable_recompute || planner.enable_swap || may_split)) ||
        (refused && may_split);
    if (options.mode == Mode::kAnalyzeOnly || rewritten_before || !wanted) {
      return absl::OkStatus();
    }
    report->recompute.planned = planner.enable_recompute;
    report->recompute.policy = RecomputePolicyName(planner.policy);
    report->swap.planned = planner.enable_swap;
    absl::Status s = PlanWithAdaptiveThreshold(options, table, order, flow, planner, &plan,
                                               &rewrite, &planned, &report->min_tensor_bytes);
    if (!s.ok()) return s;
    if (may_split && NeedsSplit(plan, planned, planner.budget_bytes)) {
      // Splitting, the fourth choice: only when the others cannot meet the budget.
      const GrapplerItem& planned_item = schedule.edges.empty() ? item : scheduled;
      s = PlanSplit(planned_item, table, order, flow, options, planner, plan, planned, &split);
      if (!s.ok()) return s;
      if (split.applied) {
        plan = std::move(split.chosen.plan);
        rewrite = std::move(split.chosen.rewrite);
        planned = std::move(split.chosen.simulation);
        planned_table = &split.chosen.table;
      }
      FillSplitReport(split, &report->split);
    }
    report->recompute.feasible = report->swap.feasible = plan.feasible;
    report->recompute.simulations = plan.simulations;
    report->recompute.search = plan.search;
    report->recompute.exact_candidates = plan.exact_candidates;
    report->recompute.left_alone = plan.left_alone;
    report->recompute.hinted_but_not_recomputable = plan.hinted_but_not_recomputable;
    report->recompute.note = plan.note;
    for (int n : plan.checkpoints) {
      report->recompute.checkpoints.push_back(planned_table->nodes[n].def->name());
    }
    report->plan_choice.chosen = plan.chosen_plan;
    report->plan_choice.allocator_windows = plan.allocator_windows;
    report->plan_choice.freed_for_allocator = plan.steered_tensors;
    for (const CandidatePlan& c : plan.candidate_plans) {
      PlanChoiceReport::Candidate entry;
      entry.name = c.name;
      entry.fits = c.fits;
      entry.added_seconds = c.added_seconds;
      entry.recomputed = c.recomputed;
      entry.swapped = c.swapped;
      entry.simulations = c.simulations;
      for (size_t d = 0; d < c.peak_bytes.size() && d < planned_table->devices.size(); ++d) {
        entry.peak_bytes[planned_table->devices[d]] = c.peak_bytes[d];
      }
      report->plan_choice.candidates.push_back(std::move(entry));
    }
    for (size_t d = 0; d < devices.size() && d < plan.peak_bytes.size(); ++d) {
      devices[d].planned_peak_bytes = plan.peak_bytes[d];
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  {
    // The plan's list indices are the planned table's (the split graph's when split).
    const MemoryPlannerOptions planner = PlannerOptions(options, devices, table);
    FillLoopReport(*planned_table, plan.loop_swap_lists, report->swap.planned,
                   SwapBandwidth(*planned_table, planner), &report->loops);
  }

  status = stages->Run("rewrite", [&] {
    const RecomputeRewrite& recompute = rewrite.recompute;
    const SwapRewrite& swap = rewrite.swap;
    if (split.applied) *output = split.chosen.item->graph;
    if (recompute.cloned.empty() && swap.swapped.empty() && rewrite.loop_swap.swapped.empty()) {
      return absl::OkStatus();
    }
    for (int n : recompute.cloned) {
      report->recompute.nodes.push_back(planned_table->nodes[n].def->name());
    }
    report->recompute.num_triggers = recompute.num_triggers;
    report->recompute.added_seconds = recompute.added_seconds;
    for (int t : swap.swapped) report->swap.tensors.push_back(rewrite.table().TensorName(t));
    report->swap.num_swap_out = swap.num_swap_out;
    report->swap.num_swap_in = swap.num_swap_in;
    report->swap.bytes_to_host = swap.bytes_to_host;
    report->swap.copy_seconds = swap.copy_seconds;
    report->swap.host_peak_bytes = 0;
    report->loop_swap_nodes = rewrite.loop_swap.num_swap_out + rewrite.loop_swap.num_swap_in;
    HostBytesTimeline(rewrite.table(), rewrite.order(), &report->swap.host_peak_bytes);
    report->plan_choice.order_edges = rewrite.pin_edges;
    return ApplyPlannedRewrite(rewrite, output);
  });
  if (!status.ok()) return status;
  report->graph_changed = !rewrite.recompute.cloned.empty() || !rewrite.swap.swapped.empty() ||
                          !rewrite.loop_swap.swapped.empty() || !schedule.edges.empty() ||
                          split.applied;

  // The rewritten graph analyzed afresh (its own shapes, its own order).
  // after_table points into `rewritten`, so both live to the report stage.
  GrapplerItem rewritten;
  TensorTable after_table;
  std::vector<int> after_order;
  SimulationResult after;
  bool after_built = false;
  auto analyze_output = [&]() -> absl::Status {
    rewritten = item.WithGraph(tensorflow::GraphDef(*output));
    after_table = TensorTable();
    absl::Status s = BuildTensorTable(rewritten, options, &after_table);
    if (!s.ok()) return s;
    s = TopologicalOrder(rewritten.graph, after_table, &after_order);
    if (!s.ok()) return s;
    s = Simulate(after_table, after_order, SimulationFor(options, devices, after_table), &after);
    after_built = s.ok();
    return s;
  };

  // Pace: a loop's values are computed about one iteration ahead at most, as the
  // simulation assumes (rewrite/loop_pacing.h). A graph the plan changed is always
  // paced. A graph the pass leaves as it is is paced only where the iterations its
  // loops may run ahead could take it over a budget its prediction meets
  // (RunAheadBytes), and only if that does not raise the prediction: the
  // edges change when kernels start, never what they compute.
  status = stages->Run("pace", [&] {
    if (!options.pace_loops) return absl::OkStatus();
    const bool unchanged = !report->graph_changed;
    if (unchanged && (options.mode == Mode::kAnalyzeOnly || options.mode == Mode::kManual ||
                      rewritten_before)) {
      return absl::OkStatus();
    }
    tensorflow::GraphDef paced = *output;
    LoopPacingResult result;
    absl::Status s = PaceLoops(table, &paced, &result);
    if (!s.ok() || result.edges.empty()) return s;
    if (unchanged) {
      const std::vector<int64_t> ahead = RunAheadBytes(table, result);
      bool could_exceed = false;
      for (size_t d = 0; d < devices.size() && d < ahead.size(); ++d) {
        could_exceed |= devices[d].budget_bytes > 0 &&
                        PredictedPeak(before.devices[d]) + ahead[d] > devices[d].budget_bytes;
      }
      if (!could_exceed) return absl::OkStatus();
      const tensorflow::GraphDef original = *output;
      *output = std::move(paced);
      s = analyze_output();
      if (!s.ok()) return s;
      if (!PeakNotRaised(before, after).ok()) {
        *output = original;  // no worse than unpaced: left as it was
        after_built = false;
        return absl::OkStatus();
      }
      report->graph_changed = true;
    } else {
      *output = std::move(paced);
    }
    report->loop_pacing.values = result.values;
    report->loop_pacing.edges = std::move(result.edges);
    report->loop_pacing.unplanned = unchanged;
    return absl::OkStatus();
  });
  if (!status.ok()) return status;

  // Order: the plan's peak must hold whichever ready kernel TF's executor takes
  // first (plan/order_guard.h). So must the "fits" of a graph that needs no plan: one
  // that meets its budget in the simulated order but not in another the executor may
  // take is pinned to the simulated order (its control edges are then all the pass
  // adds); one that meets it in every order is left as it is.
  status = stages->Run("order", [&] {
    const bool unchanged = !report->graph_changed;
    if (unchanged && (options.mode != Mode::kAuto || rewritten_before)) {
      return absl::OkStatus();
    }
    OrderGuardOptions guard;
    guard.pin_only_over_budget = unchanged;
    for (const DeviceReport& device : devices) guard.budget_bytes[device.device] = device.budget_bytes;
    OrderGuardResult result;
    absl::Status s;
    if (unchanged) {
      // The original graph, as analyzed and simulated already; a copy of its table,
      // which pinning edits.
      TensorTable guarded = table;
      guard.simulation = SimulationFor(options, devices, guarded);
      s = GuardOrder(&guarded, flow, order, before, guard, &result);
    } else {
      s = analyze_output();
      if (!s.ok()) return s;
      guard.simulation = SimulationFor(options, devices, after_table);
      ControlFlowInfo after_flow;
      s = AnalyzeControlFlow(rewritten.graph, after_table, after_order, &after_flow);
      if (!s.ok()) return s;
      s = GuardOrder(&after_table, after_flow, after_order, after, guard, &result);
    }
    if (!s.ok()) return s;
    OrderGuardReport& out = report->order_guard;
    out.checked = result.checked;
    out.complete = result.complete;
    out.edges = result.edges;
    out.worst_peak_before_bytes = result.worst_peak_before_bytes;
    out.worst_peak_after_bytes = result.worst_peak_after_bytes;
    out.eager_start_peak_before_bytes = result.eager_start_peak_before_bytes;
    out.eager_start_peak_after_bytes = result.eager_start_peak_after_bytes;
    out.deferred = result.deferred;
    if (result.edges.empty()) return absl::OkStatus();
    s = ApplyPinnedEdges(result.edges, output);
    if (!s.ok()) return s;
    if (unchanged) {
      report->graph_changed = true;
      out.unplanned = true;
    }
    return analyze_output();
  });
  if (!status.ok()) return status;

  // Merge: the node pairs TF's oneDNN layout pass merges stay mergeable, so that they
  // run the same kernels as without the pass (rewrite/onednn_merge_guard.h).
  // A pair left unmerged sums in another order, so the plan breaks merges only where
  // nothing else fits: when keeping them takes back order edges the plan needs to
  // meet a budget it met without them, the output keeps those edges and says so.
  auto fits_budgets = [&]() {
    for (const DeviceReport& device : devices) {
      const int a = DeviceIndex(after, device.device);
      if (a >= 0 && PredictedPeak(after.devices[a]) > device.budget_bytes) return false;
    }
    return true;
  };
  auto keep_merges = [&]() -> absl::Status {
    const bool fitted = after_built && fits_budgets();
    // Only a plan that fitted may be given back unguarded.
    tensorflow::GraphDef unguarded;
    if (fitted) unguarded = *output;
    MergeGuardResult result;
    absl::Status s = KeepOneDnnMerges(item.graph, output, &result);
    if (!s.ok()) return s;
    MergeGuardReport& out = report->onednn_merges;
    out.pairs = result.pairs;
    out.edges_shared = result.edges_shared;
    out.edges_removed = result.edges_removed;
    out.edges_moved = result.edges_moved;
    out.partner_edges = result.partner_edges;
    out.unmerged = result.unmerged;
    if (result.edges_shared + result.edges_removed + result.edges_moved +
            result.partner_edges == 0) {
      return absl::OkStatus();
    }
    s = analyze_output();
    if (!s.ok() || !fitted || fits_budgets()) return s;
    out.kept = false;
    *output = std::move(unguarded);
    return analyze_output();
  };
  // Then, whichever output that kept: no pair TF merges may have a path between its
  // two nodes, or TF finds the merged kernel in a cycle after Grappler, where no
  // fall-back is left (BreakMergeCycles).
  status = stages->Run("merge", [&] {
    if (!report->graph_changed) return absl::OkStatus();
    absl::Status s = keep_merges();
    if (!s.ok() || options.test_only_keep_merge_cycles) return s;
    MergeGuardResult result;
    s = BreakMergeCycles(item.graph, output, &result);
    if (!s.ok()) return s;
    MergeGuardReport& out = report->onednn_merges;
    out.cycle_edges = result.cycle_edges_moved + result.cycle_edges_removed;
    out.unmerged.insert(out.unmerged.end(), result.unmerged.begin(), result.unmerged.end());
    if (out.cycle_edges == 0 && result.unmerged.empty()) return absl::OkStatus();
    return analyze_output();
  });
  if (!status.ok()) return status;

  // Verify: the output is a valid graph, and it peaks no higher than the original did.
  status = stages->Run("verify", [&] {
    absl::Status s = VerifyOptimizedGraph(item, *output);
    if (!s.ok() || !report->graph_changed) return s;
    if (!after_built) {
      s = analyze_output();
      if (!s.ok()) return s;
    }
    return PeakNotRaised(before, after);
  });
  if (!status.ok()) return status;
  if (report->graph_changed && options.test_only_hold_bytes > 0) {
    std::vector<std::string> wait_for(item.fetch.begin(), item.fetch.end());
    wait_for.insert(wait_for.end(), item.keep_ops.begin(), item.keep_ops.end());
    status = AddTestOnlyHold(options.test_only_hold_bytes, wait_for, output);
    if (!status.ok()) return status;
  }

  return stages->Run("report", [&] {
    const bool changed = report->graph_changed;
    const TensorTable& final_table = changed ? after_table : table;
    const SimulationResult& final_simulation = changed ? after : before;
    report->timeline.clear();
    for (size_t d = 0; d < devices.size(); ++d) {
      const int index = DeviceIndex(final_simulation, devices[d].device);
      if (index < 0) return absl::InternalError(absl::StrCat("no timeline for ", devices[d].device));
      FillDeviceFigures(final_table, final_simulation.devices[index], &devices[d]);
      // An order the guard could not pin may run: its peak is the plan's (or, for
      // a graph left as it is, the graph's).
      if (!report->order_guard.complete) {
        auto worst = report->order_guard.worst_peak_after_bytes.find(devices[d].device);
        if (worst != report->order_guard.worst_peak_after_bytes.end()) {
          devices[d].peak_after_bytes = std::max(devices[d].peak_after_bytes, worst->second);
        }
      }
      FillOpWorkingSet(table, &devices[d]);
      report->timeline.push_back(final_simulation.devices[index]);
    }
    report->devices = std::move(devices);
    if (changed && (!rewrite.swap.swapped.empty() || !rewrite.loop_swap.swapped.empty())) {
      int64_t host_peak = 0;
      const std::vector<int64_t> host = HostBytesTimeline(after_table, after_order, &host_peak);
      for (DeviceTimeline& timeline : report->timeline) timeline.host_bytes = host;
      report->swap.host_peak_bytes = std::max(report->swap.host_peak_bytes, host_peak);
    }
    report->timeline_before = before.devices;
    return absl::OkStatus();
  });
}

// An over-budget graph under fail_on_infeasible is the user's error, not ours: it
// is returned as such so that the meta-optimizer reports it (and drops our output).
absl::Status InfeasibleError(const MemoryOptimizerOptions& options,
                             const MemoryReport& report) {
  if (!options.fail_on_infeasible || options.mode == Mode::kAnalyzeOnly ||
      report.status != "ok") {
    return absl::OkStatus();
  }
  for (const DeviceReport& d : report.devices) {
    if (d.budget_bytes > 0 && d.peak_after_bytes > d.budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "TfMemOpt: graph ", report.graph_id, ": budget ", FormatBytes(d.budget_bytes),
          " cannot be met on ", d.device, "; the smallest peak reachable is ",
          FormatBytes(d.peak_after_bytes), " (fail_on_infeasible is set)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TfMemOptOptimizer::Init(
    const tensorflow::RewriterConfig_CustomGraphOptimizer* config) {
  // config_proto_ is what the meta-optimizer runs with (InitWithConfig sets it).
  iterations_ = config_proto_.graph_options().rewrite_options().meta_optimizer_iterations() ==
                        tensorflow::RewriterConfig::ONE
                    ? 1
                    : 2;
  return ParseMemoryOptimizerOptions(config, &options_);
}

absl::Status TfMemOptOptimizer::Optimize(Cluster* cluster, const GrapplerItem& item,
                                         tensorflow::GraphDef* optimized_graph) {
  const auto start = std::chrono::steady_clock::now();
  *optimized_graph = item.graph;
  // An initializer's graph is seen before the step that updates its variables
  // (analyze/initial_values.h); recorded on every call, whatever the pass does next.
  RecordInitializedVariables(item.graph);
  // The meta-optimizer's next iteration over a graph we rewrote: our nodes are in
  // it, the report of the rewrite stands, and nothing is added twice.
  Published& seen = published_[item.id];
  ++seen.calls;
  if (seen.calls < iterations_ && options_.mode != Mode::kAnalyzeOnly) {
    return absl::OkStatus();  // the rewrite waits for the last iteration
  }
  if (seen.rewrote && HasTfMemOptNodes(item.graph)) return absl::OkStatus();
  MemoryReport report;
  report.graph_id = item.id;
  report.options = options_;
  report.num_nodes = item.graph.node_size();
  // Whatever the pass does, the user learns where TF's own sums follow the execution
  // order (a rewrite that changes the order changes their last bits).
  report.arrival_order_sums = FindArrivalOrderSums(item.graph);
  StageRunner stages(options_, &report);
  absl::Status status;
  try {
    // The pass plans what the step runs; nodes no fetch needs go back unchanged.
    GrapplerItem executed;
    std::vector<tensorflow::NodeDef> never_run;
    const bool pruned = SplitNeverRunNodes(item, &executed, &never_run);
    report.never_run_nodes = static_cast<int>(never_run.size());
    if (pruned) *optimized_graph = executed.graph;
    status = RunPipeline(options_, cluster, pruned ? executed : item, optimized_graph,
                         &report, &stages);
    const int left_out = AppendNeverRunNodes(std::move(never_run), optimized_graph);
    if (left_out > 0 && options_.log_level >= 1) {
      LOG(INFO) << "TfMemOpt: graph " << item.id << ": " << left_out
                << " nodes no fetch needs read ops the rewrite replaced; left out";
    }
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("exception: ", e.what()));
  } catch (...) {
    status = absl::InternalError("unknown exception");
  }
  if (!status.ok()) {
    *optimized_graph = item.graph;
    report.status = "fallback";
    report.failed_stage = stages.current();
    report.message = std::string(status.message());
    report.graph_changed = false;
  }
  report.total_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  Published& published = seen;
  const std::string summary = report.Summary();
  if (summary != published.summary) {
    const bool infeasible = (report.recompute.planned || report.swap.planned) &&
                            !(report.recompute.feasible && report.swap.feasible);
    // A split sums weight gradients over slices: results differ from the original's
    // in the order of float sums, which the user must hear of even with INFO off.
    const bool reordered_sums = report.graph_changed && report.split.applied;
    // Tensors of unknown batch counted as 1 make the prediction (and "fits") a small
    // fraction of the step: the plan is made for a step that does not exist.
    const bool unknown_batch = report.unresolved_tensors > 0 &&
                               options_.assume_batch_size == 0 &&
                               options_.mode != Mode::kAnalyzeOnly;
    if (report.status != "ok") {
      LOG(WARNING) << summary;
    } else if ((infeasible || reordered_sums || unknown_batch) && options_.log_level >= 1) {
      // The best plan is applied and the budget is not met, the plan splits, or it was
      // made without the batch size.
      LOG(WARNING) << summary;
    } else if (options_.log_level >= 1) {
      LOG(INFO) << summary;
    }
    if (options_.log_level >= 2) {
      for (const DeviceReport& d : report.devices) {
        for (const PeakTensor& t : d.top_tensors_at_peak) {
          LOG(INFO) << "TfMemOpt:   at peak on " << d.device << ": " << t.name << " ("
                    << t.op << ", " << t.role << ") " << FormatBytes(t.bytes);
        }
      }
    }
  }
  published.summary = summary;
  published.rewrote = report.graph_changed;
  published.token = PublishReport(published.token, report.ToJson());
  return InfeasibleError(options_, report);
}

absl::Status RunTfMemOptOnMetaGraph(const tensorflow::MetaGraphDef& metagraph,
                                    const tensorflow::RewriterConfig_CustomGraphOptimizer& entry,
                                    tensorflow::GraphDef* graph, std::string* report_json,
                                    std::string* table_json) {
  tensorflow::grappler::ItemConfig item_config;
  std::unique_ptr<GrapplerItem> item =
      tensorflow::grappler::GrapplerItemFromMetaGraphDef("run_pass", metagraph, item_config);
  if (item == nullptr) {
    return absl::InvalidArgumentError(
        "the MetaGraphDef is not a valid graph with a train_op collection");
  }
  TfMemOptOptimizer optimizer;
  tensorflow::ConfigProto one_iteration;
  one_iteration.mutable_graph_options()->mutable_rewrite_options()->set_meta_optimizer_iterations(
      tensorflow::RewriterConfig::ONE);
  absl::Status status = optimizer.InitWithConfig(one_iteration, &entry);
  if (!status.ok()) return status;
  if (table_json != nullptr) {
    TensorTable table;
    status = BuildTensorTable(*item, optimizer.options(), &table);
    if (!status.ok()) return status;
    std::vector<int> order;
    status = TopologicalOrder(item->graph, table, &order);
    if (!status.ok()) return status;
    ControlFlowInfo flow;
    status = AnalyzeControlFlow(item->graph, table, order, &flow);
    if (!status.ok()) return status;
    *table_json = TensorTableJson(table, order, flow, optimizer.options());
  }
  const size_t before = PublishedReports().size();
  status = optimizer.Optimize(nullptr, *item, graph);
  const std::vector<std::string> reports = PublishedReports();
  if (reports.size() > before) *report_json = reports.back();
  return status;
}

bool RegisterTfMemOptOnce() {
  static std::mutex mu;
  static bool registered_here = false;
  std::lock_guard<std::mutex> lock(mu);
  if (registered_here) return true;
  for (const std::string& name :
       tensorflow::grappler::CustomGraphOptimizerRegistry::GetRegisteredOptimizers()) {
    if (name == kTfMemOptName) return false;
  }
  tensorflow::grappler::CustomGraphOptimizerRegistry::RegisterOptimizerOrDie(
      [] { return new TfMemOptOptimizer; }, kTfMemOptName);
  registered_here = true;
  return true;
}

}  // namespace tfmemopt
