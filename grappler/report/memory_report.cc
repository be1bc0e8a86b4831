#include "grappler/report/memory_report.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tfmemopt {
namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

template <typename T>
std::string JsonList(const std::vector<T>& values) {
  return absl::StrCat("[", absl::StrJoin(values, ","), "]");
}

// A list of (from, to) node-name pairs as a JSON array of pairs.
std::string EdgesJson(const std::vector<std::pair<std::string, std::string>>& edges) {
  std::string out = "[";
  for (size_t i = 0; i < edges.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "[", Quote(edges[i].first), ",", Quote(edges[i].second),
                    "]");
  }
  return out + "]";
}

// Bytes per device as a JSON object.
std::string BytesByDeviceJson(const std::map<std::string, int64_t>& bytes) {
  std::string out = "{";
  bool first = true;
  for (const auto& [device, value] : bytes) {
    absl::StrAppend(&out, first ? "" : ",", Quote(device), ":", value);
    first = false;
  }
  return out + "}";
}

std::string QuotedList(const std::vector<std::string>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ",";
    out += Quote(values[i]);
  }
  return out + "]";
}

std::string TimelineJson(const std::vector<DeviceTimeline>& timeline) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < timeline.size(); ++i) {
    const DeviceTimeline& t = timeline[i];
    out << (i ? "," : "") << "{\"device\":" << Quote(t.device)
        << ",\"persistent_bytes\":" << t.persistent_bytes
        << ",\"activation_bytes\":" << JsonList(t.activation_bytes)
        << ",\"gradient_bytes\":" << JsonList(t.gradient_bytes);
    if (!t.host_bytes.empty()) out << ",\"host_bytes\":" << JsonList(t.host_bytes);
    out << "}";
  }
  out << "]";
  return out.str();
}

std::string CountsJson(const std::map<std::string, int>& counts) {
  std::string out = "{";
  for (const auto& [key, count] : counts) {
    absl::StrAppend(&out, out.size() > 1 ? "," : "", Quote(key), ":", count);
  }
  return out + "}";
}

std::string SplitJson(const SplitReport& split) {
  std::ostringstream out;
  out << "{\"planned\":" << (split.planned ? "true" : "false")
      << ",\"applied\":" << (split.applied ? "true" : "false") << ",\"batch\":" << split.batch
      << ",\"slices\":" << split.slices << ",\"rows\":" << JsonList(split.rows)
      << ",\"stages\":" << split.stages << ",\"ops\":" << QuotedList(split.ops)
      << ",\"op_types\":" << CountsJson(split.op_types) << ",\"cuts\":" << split.cuts
      << ",\"joins\":" << split.joins << ",\"sums\":" << split.sums
      << ",\"shape_constants\":" << split.shape_constants
      << ",\"added_nodes\":" << split.added_nodes
      << ",\"added_seconds\":" << absl::StrFormat("%.9g", split.added_seconds)
      << ",\"through_batch_statistics\":" << (split.through_batch_statistics ? "true" : "false")
      << ",\"left_alone\":" << CountsJson(split.left_alone) << ",\"trials\":[";
  for (size_t i = 0; i < split.trials.size(); ++i) {
    const SplitReport::Trial& trial = split.trials[i];
    out << (i ? "," : "") << "{\"slices\":" << trial.slices
        << ",\"region_ops\":" << trial.region_ops
        << ",\"peak_bytes\":" << JsonList(trial.peak_bytes)
        << ",\"fits\":" << (trial.fits ? "true" : "false")
        << ",\"added_seconds\":" << absl::StrFormat("%.9g", trial.added_seconds)
        << ",\"through_batch_statistics\":"
        << (trial.through_batch_statistics ? "true" : "false") << "}";
  }
  out << "],\"note\":" << Quote(split.note) << "}";
  return out.str();
}

struct Registry {
  std::mutex mu;
  int64_t next_token = 1;
  std::vector<std::pair<int64_t, std::string>> reports;
};

Registry& GetRegistry() {
  static auto* registry = new Registry;
  return *registry;
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= (1LL << 30)) return absl::StrFormat("%.2f GiB", b / (1LL << 30));
  if (b >= (1LL << 20)) return absl::StrFormat("%.1f MiB", b / (1LL << 20));
  if (b >= (1LL << 10)) return absl::StrFormat("%.1f KiB", b / (1LL << 10));
  return absl::StrCat(bytes, " B");
}

std::string MemoryReport::ToJson() const {
  std::ostringstream out;
  out << "{\"graph_id\":" << Quote(graph_id) << ",\"status\":" << Quote(status)
      << ",\"failed_stage\":" << Quote(failed_stage) << ",\"message\":" << Quote(message)
      << ",\"mode\":" << Quote(ModeName(options.mode))
      << ",\"num_nodes\":" << num_nodes << ",\"never_run_nodes\":" << never_run_nodes
      << ",\"num_tensors\":" << num_tensors
      << ",\"unresolved_tensors\":" << unresolved_tensors
      << ",\"unresolved_variants\":" << unresolved_variants
      << ",\"unresolved_examples\":[";
  for (size_t i = 0; i < unresolved_examples.size(); ++i) {
    out << (i ? "," : "") << Quote(unresolved_examples[i]);
  }
  out << "],\"batch_dims_resolved\":" << batch_dims_resolved
      << ",\"batch_dims_assumed\":" << batch_dims_assumed
      << ",\"assume_batch_size\":" << options.assume_batch_size
      << ",\"graph_changed\":" << (graph_changed ? "true" : "false")
      << ",\"min_tensor_bytes\":" << min_tensor_bytes
      << ",\"min_tensor_bytes_adaptive\":"
      << (options.min_tensor_bytes == kAdaptiveMinTensorBytes ? "true" : "false")
      << ",\"devices\":[";
  for (size_t i = 0; i < devices.size(); ++i) {
    const DeviceReport& d = devices[i];
    out << (i ? "," : "") << "{\"device\":" << Quote(d.device)
        << ",\"memory_bytes\":" << d.memory_bytes
        << ",\"memory_source\":" << Quote(d.memory_source)
        << ",\"memory_shared_by\":" << d.memory_shared_by
        << ",\"budget_bytes\":" << d.budget_bytes
        << ",\"persistent_bytes\":" << d.persistent_bytes
        << ",\"peak_before_bytes\":" << d.peak_before_bytes
        << ",\"peak_after_bytes\":" << d.peak_after_bytes
        << ",\"live_peak_bytes\":" << d.live_peak_bytes
        << ",\"allocator\":" << Quote(d.allocator)
        << ",\"peak_step\":" << d.peak_step
        << ",\"planned_peak_bytes\":" << d.planned_peak_bytes
        << ",\"max_op_working_set_bytes\":" << d.max_op_working_set_bytes
        << ",\"max_op_working_set_op\":" << Quote(d.max_op_working_set_op)
        << ",\"allocator_refused_bytes\":" << d.allocator_refused_bytes
        << ",\"allocator_refused\":" << Quote(d.allocator_refused)
        << ",\"allocator_refused_before_bytes\":" << d.allocator_refused_before_bytes
        << ",\"allocator_history\":" << Quote(d.allocator_history)
        << ",\"allocator_history_peaks\":{";
    for (size_t j = 0; j < d.allocator_history_peaks.size(); ++j) {
      out << (j ? "," : "") << Quote(d.allocator_history_peaks[j].first) << ":"
          << d.allocator_history_peaks[j].second;
    }
    out << "}"
        << ",\"held_outside_bytes\":" << d.held_outside_bytes
        << ",\"allocator_region_bytes\":" << d.allocator_region_bytes
        << ",\"observed_pool_bytes\":" << d.observed_pool_bytes
        << ",\"top_tensors_at_peak\":[";
    for (size_t j = 0; j < d.top_tensors_at_peak.size(); ++j) {
      const PeakTensor& t = d.top_tensors_at_peak[j];
      out << (j ? "," : "") << "{\"name\":" << Quote(t.name) << ",\"op\":" << Quote(t.op)
          << ",\"role\":" << Quote(t.role) << ",\"bytes\":" << t.bytes << "}";
    }
    out << "]}";
  }
  out << "],\"recompute\":{\"planned\":" << (recompute.planned ? "true" : "false")
      << ",\"policy\":" << Quote(recompute.policy) << ",\"nodes\":" << QuotedList(recompute.nodes)
      << ",\"num_triggers\":" << recompute.num_triggers
      << ",\"added_seconds\":" << absl::StrFormat("%.9g", recompute.added_seconds)
      << ",\"step_seconds\":" << absl::StrFormat("%.9g", recompute.step_seconds)
      << ",\"feasible\":" << (recompute.feasible ? "true" : "false")
      << ",\"simulations\":" << recompute.simulations
      << ",\"search\":" << Quote(recompute.search)
      << ",\"exact_candidates\":" << recompute.exact_candidates
      << ",\"checkpoints\":" << QuotedList(recompute.checkpoints) << ",\"left_alone\":{";
  bool first_reason = true;
  for (const auto& [reason, count] : recompute.left_alone) {
    out << (first_reason ? "" : ",") << Quote(reason) << ":" << count;
    first_reason = false;
  }
  out << "},\"hinted_but_not_recomputable\":" << QuotedList(recompute.hinted_but_not_recomputable)
      << ",\"note\":" << Quote(recompute.note)
      << "},\"swap\":{\"planned\":" << (swap.planned ? "true" : "false")
      << ",\"feasible\":" << (swap.feasible ? "true" : "false")
      << ",\"tensors\":" << QuotedList(swap.tensors) << ",\"num_swap_out\":" << swap.num_swap_out
      << ",\"num_swap_in\":" << swap.num_swap_in << ",\"bytes_to_host\":" << swap.bytes_to_host
      << ",\"host_peak_bytes\":" << swap.host_peak_bytes
      << ",\"copy_seconds\":" << absl::StrFormat("%.9g", swap.copy_seconds)
      << "},\"schedule\":{\"planned\":" << (schedule.planned ? "true" : "false")
      << ",\"num_edges\":" << schedule.edges.size()
      << ",\"edges\":" << EdgesJson(schedule.edges)
      << ",\"peak_before_bytes\":" << BytesByDeviceJson(schedule.peak_before_bytes)
      << ",\"peak_after_bytes\":" << BytesByDeviceJson(schedule.peak_after_bytes)
      << ",\"backward_peak_before_bytes\":"
      << BytesByDeviceJson(schedule.backward_peak_before_bytes)
      << ",\"backward_peak_after_bytes\":" << BytesByDeviceJson(schedule.backward_peak_after_bytes)
      << ",\"simulations\":" << schedule.simulations << "},\"split\":" << SplitJson(split)
      << ",\"plan_choice\":{\"chosen\":" << Quote(plan_choice.chosen) << ",\"candidates\":[";
  for (size_t i = 0; i < plan_choice.candidates.size(); ++i) {
    const PlanChoiceReport::Candidate& c = plan_choice.candidates[i];
    out << (i ? "," : "") << "{\"name\":" << Quote(c.name)
        << ",\"fits\":" << (c.fits ? "true" : "false")
        << ",\"added_seconds\":" << absl::StrFormat("%.9g", c.added_seconds)
        << ",\"recomputed\":" << c.recomputed << ",\"swapped\":" << c.swapped
        << ",\"simulations\":" << c.simulations
        << ",\"peak_bytes\":" << BytesByDeviceJson(c.peak_bytes) << "}";
  }
  out << "],\"order_edges\":" << EdgesJson(plan_choice.order_edges)
      << ",\"allocator_windows\":" << plan_choice.allocator_windows
      << ",\"freed_for_allocator\":" << QuotedList(plan_choice.freed_for_allocator)
      << "},\"order_guard\":{\"checked\":" << (order_guard.checked ? "true" : "false")
      << ",\"complete\":" << (order_guard.complete ? "true" : "false")
      << ",\"unplanned\":" << (order_guard.unplanned ? "true" : "false")
      << ",\"edges\":" << EdgesJson(order_guard.edges)
      << ",\"worst_peak_before_bytes\":" << BytesByDeviceJson(order_guard.worst_peak_before_bytes)
      << ",\"worst_peak_after_bytes\":" << BytesByDeviceJson(order_guard.worst_peak_after_bytes)
      << ",\"eager_start_peak_before_bytes\":"
      << BytesByDeviceJson(order_guard.eager_start_peak_before_bytes)
      << ",\"eager_start_peak_after_bytes\":"
      << BytesByDeviceJson(order_guard.eager_start_peak_after_bytes)
      << ",\"deferred\":" << order_guard.deferred
      << "},\"onednn_merges\":{\"kept\":" << (onednn_merges.kept ? "true" : "false")
      << ",\"pairs\":" << onednn_merges.pairs
      << ",\"edges_shared\":" << onednn_merges.edges_shared
      << ",\"edges_removed\":" << onednn_merges.edges_removed
      << ",\"edges_moved\":" << onednn_merges.edges_moved
      << ",\"partner_edges\":" << onednn_merges.partner_edges
      << ",\"cycle_edges\":" << onednn_merges.cycle_edges
      << ",\"unmerged\":" << QuotedList(onednn_merges.unmerged)
      << "},\"loop_pacing\":{\"values\":" << loop_pacing.values
      << ",\"edges\":" << EdgesJson(loop_pacing.edges)
      << ",\"unplanned\":" << (loop_pacing.unplanned ? "true" : "false")
      << "},\"arrival_order_sums\":[";
  for (size_t i = 0; i < arrival_order_sums.size(); ++i) {
    out << (i ? "," : "") << "{\"name\":" << Quote(arrival_order_sums[i].name)
        << ",\"terms\":" << arrival_order_sums[i].terms << "}";
  }
  out << "],\"loops\":[";
  for (size_t i = 0; i < loops.size(); ++i) {
    const LoopReport& loop = loops[i];
    out << (i ? "," : "") << "{\"frame\":" << Quote(loop.frame)
        << ",\"backward\":" << (loop.backward ? "true" : "false")
        << ",\"trip_count\":" << loop.trip_count
        << ",\"trip_count_source\":" << Quote(loop.trip_count_source)
        << ",\"parallel_iterations\":" << loop.parallel_iterations
        << ",\"left_alone\":" << Quote(loop.left_alone) << ",\"lists\":[";
    for (size_t j = 0; j < loop.lists.size(); ++j) {
      const LoopListReport& list = loop.lists[j];
      out << (j ? "," : "") << "{\"list\":" << Quote(list.list) << ",\"item\":" << Quote(list.item)
          << ",\"capacity\":" << list.capacity
          << ",\"capacity_source\":" << Quote(list.capacity_source)
          << ",\"bytes\":" << list.bytes << ",\"swapped\":" << (list.swapped ? "true" : "false")
          << ",\"copy_seconds\":" << absl::StrFormat("%.9g", list.copy_seconds)
          << ",\"left_alone\":" << Quote(list.left_alone) << "}";
    }
    out << "]}";
  }
  out << "],\"timeline\":" << TimelineJson(timeline)
      << ",\"timeline_before\":" << TimelineJson(timeline_before) << ",\"stage_seconds\":{";
  bool first = true;
  for (const auto& [stage, seconds] : stage_seconds) {
    out << (first ? "" : ",") << Quote(stage) << ":" << absl::StrFormat("%.6f", seconds);
    first = false;
  }
  out << "},\"total_seconds\":" << absl::StrFormat("%.6f", total_seconds) << "}";
  return out.str();
}

std::string MemoryReport::Summary() const {
  std::string line = absl::StrCat("TfMemOpt: graph ", graph_id, ": ", num_nodes, " nodes");
  if (never_run_nodes > 0) {
    absl::StrAppend(&line, " (", never_run_nodes, " never run: no fetch needs them)");
  }
  if (status != "ok") {
    return absl::StrCat(line, ": ", failed_stage, " failed (", message,
                        "); the original graph is used");
  }
  std::vector<std::string> peaks;
  for (const DeviceReport& d : devices) {
    std::string peak = absl::StrCat(d.device.empty() ? "unplaced" : d.device, " ",
                                    FormatBytes(d.peak_before_bytes));
    if (d.peak_after_bytes != d.peak_before_bytes) {
      absl::StrAppend(&peak, " -> ", FormatBytes(d.peak_after_bytes));
    }
    absl::StrAppend(&peak, d.budget_bytes > 0
                               ? absl::StrCat(" (budget ", FormatBytes(d.budget_bytes), ")")
                               : " (no budget known)");
    peaks.push_back(peak);
  }
  int swapped_lists = 0, loop_swap_ops = 0;
  int64_t loop_bytes = 0;
  for (const LoopReport& loop : loops) {
    for (const LoopListReport& list : loop.lists) {
      if (!list.swapped) continue;
      ++swapped_lists;
      loop_bytes += list.bytes;
    }
  }
  loop_swap_ops = loop_swap_nodes;
  const size_t added =
      recompute.nodes.size() + swap.num_swap_out + swap.num_swap_in + loop_swap_ops;
  if (added > 0) {
    std::vector<std::string> parts;
    if (!recompute.nodes.empty()) {
      std::string part = absl::StrCat(recompute.nodes.size(), " recomputed");
      if (recompute.step_seconds > 0) {
        absl::StrAppend(&part, absl::StrFormat(" (+%.1f%% compute)",
                                               100.0 * recompute.added_seconds /
                                                   recompute.step_seconds));
      }
      parts.push_back(part);
    }
    if (swap.num_swap_out > 0) {
      parts.push_back(absl::StrCat(swap.num_swap_out, " swap-out, ", swap.num_swap_in,
                                   " swap-in, ", FormatBytes(swap.bytes_to_host), " to host"));
    }
    if (swapped_lists > 0) {
      parts.push_back(absl::StrCat(swapped_lists, " loop list", swapped_lists == 1 ? "" : "s",
                                   " to host (", FormatBytes(loop_bytes), ")"));
    }
    absl::StrAppend(&line, ", added ", added, " ops (", absl::StrJoin(parts, ", "), ")");
  }
  if (options.min_tensor_bytes == kAdaptiveMinTensorBytes && min_tensor_bytes >= 0 &&
      min_tensor_bytes < AdaptiveMinTensorBytesSteps(options).front()) {
    absl::StrAppend(&line, ", tensors down to ", FormatBytes(min_tensor_bytes),
                    " considered (the budget needs them)");
  }
  if (split.applied) {
    absl::StrAppend(&line, ", split ", split.ops.size(), " ops into ", split.slices,
                    " slices of the batch",
                    split.through_batch_statistics
                        ? " through batch statistics (gradients reordered: "
                          "docs/split.md#batch-statistics)"
                        : " (weight-gradient sums reordered: docs/split.md)");
    if (recompute.step_seconds > 0) {
      absl::StrAppend(&line, absl::StrFormat(" (+%.1f%% predicted)",
                                             100.0 * split.added_seconds /
                                                 recompute.step_seconds));
    }
  }
  if (!schedule.edges.empty()) {
    absl::StrAppend(&line, ", scheduled with ", schedule.edges.size(), " control edge",
                    schedule.edges.size() == 1 ? "" : "s");
  }
  absl::StrAppend(&line, ", predicted peak ", absl::StrJoin(peaks, ", "));
  if ((recompute.planned || swap.planned) && !(recompute.feasible && swap.feasible)) {
    for (const DeviceReport& d : devices) {
      if (d.budget_bytes > 0 && d.peak_after_bytes > d.budget_bytes) {
        absl::StrAppend(&line, "; budget not met on ", d.device,
                        ": the smallest peak reachable is ",
                        FormatBytes(d.peak_after_bytes));
      }
    }
  }
  if (unresolved_tensors > 0) {
    absl::StrAppend(&line, "; ", unresolved_tensors,
                    " tensors have unknown dimensions (counted as 1",
                    options.assume_batch_size > 0 ? "; of unknown rank)"
                                                  : "; set assume_batch_size)");
  }
  if (batch_dims_assumed > 0) {
    absl::StrAppend(&line, "; ", batch_dims_assumed,
                    " other unknown dimensions taken as assume_batch_size=",
                    options.assume_batch_size);
  }
  if (unresolved_variants > 0) {
    absl::StrAppend(&line, "; ", unresolved_variants,
                    " lists or optionals of unknown contents (counted as empty)");
  }
  if (options.mode == Mode::kAnalyzeOnly) absl::StrAppend(&line, " [analyze only]");
  return line;
}

void FillOpWorkingSet(const TensorTable& table, DeviceReport* device) {
  device->max_op_working_set_bytes = 0;
  device->max_op_working_set_op.clear();
  std::vector<int> buffers;
  for (const NodeInfo& node : table.nodes) {
    if (node.device != device->device) continue;
    buffers.clear();
    for (const std::vector<int>* tensors : {&node.inputs, &node.outputs}) {
      for (int t : *tensors) buffers.push_back(table.tensors[t].buffer);
    }
    std::sort(buffers.begin(), buffers.end());
    buffers.erase(std::unique(buffers.begin(), buffers.end()), buffers.end());
    int64_t bytes = node.temp_bytes;
    for (int b : buffers) {
      const BufferInfo& buffer = table.buffers[b];
      if (!buffer.persistent && buffer.device == device->device) bytes += buffer.bytes;
    }
    if (bytes > device->max_op_working_set_bytes) {
      device->max_op_working_set_bytes = bytes;
      device->max_op_working_set_op = node.def->name();
    }
  }
}

int64_t PublishReport(int64_t token, const std::string& json) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  if (token > 0) {
    for (auto& entry : registry.reports) {
      if (entry.first == token) {
        entry.second = json;
        return token;
      }
    }
  }
  token = registry.next_token++;
  registry.reports.emplace_back(token, json);
  return token;
}

std::vector<std::string> PublishedReports(int64_t start) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  std::vector<std::string> out;
  for (size_t i = std::max<int64_t>(start, 0); i < registry.reports.size(); ++i) {
    out.push_back(registry.reports[i].second);
  }
  return out;
}

int64_t NumPublishedReports() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  return static_cast<int64_t>(registry.reports.size());
}

void ClearPublishedReports() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.reports.clear();
}

}  // namespace tfmemopt
