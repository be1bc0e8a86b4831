#include "grappler/plan/split_choice.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grappler/plan/mechanism.h"
#include "grappler/plan/objective.h"
#include "tensorflow/core/grappler/utils.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {

using tensorflow::grappler::GrapplerItem;

// Split candidates are built, analyzed and planned in full: a bound on how many.
constexpr int kMaxTrials = 12;

// Slice counts tried: 2, 3, 4, 6, 8, 12, ... (each power of two, then 1.5 times it).
// Between two powers of two, 1.5 times the smaller gives slices whose tensors pack
// BFC's doubling regions differently (a third of a batch where halves leave a
// region's last quarter unused), at fewer slices than the next power of two.
bool IsPowerOfTwo(int k) { return (k & (k - 1)) == 0; }
int NextSliceCount(int k) { return IsPowerOfTwo(k) ? k + k / 2 : k / 3 * 4; }

// Predicted compute of what the split adds: cuts, joins and sums. The slices' own
// work is taken as equal to the original's (per-sample work is linear in the rows;
// TF's estimator often cannot price the original, whose shape inputs are computed,
// while it can price the slices, whose shape inputs are constants).
double AddedCompute(const TensorTable& table) {
  double seconds = 0;
  for (const NodeInfo& node : table.nodes) {
    const std::string& name = node.def->name();
    const size_t last = name.rfind('/');
    const bool slice = last != std::string::npos &&
                       absl::StartsWith(absl::string_view(name).substr(last + 1), "slice_");
    if (absl::StartsWith(name, kSplitScope) && !slice) {
      seconds += node.compute_seconds;
    }
  }
  return seconds;
}

// Whether a split that misses the budget lowers the peak from `unsplit` enough to
// be worth reordering sums: by more than 2 % of it. A smaller gain is within what
// the prediction cannot tell apart (a near tie). Relative only: a graph of a few
// hundred KiB is split for the same reasons as one of a few GiB.
bool ClearlyLower(int64_t peak, int64_t unsplit) { return peak < unsplit - unsplit / 50; }

int64_t WorstPeak(const std::vector<int64_t>& peaks) {
  int64_t worst = 0;
  for (int64_t peak : peaks) worst = std::max(worst, peak);
  return worst;
}

// The splittable ops: per-sample or reductions, allowed by the user's filters, not
// kept by TF, and reading region tensors only along the batch (a reduction's partial
// sum never). Returns the connected parts (by data edges), each in index order.
std::vector<std::vector<int>> Regions(const TensorTable& table, const BatchAnalysis& batch,
                                      const MemoryPlannerOptions& options,
                                      const std::set<std::string>& preserved,
                                      std::map<std::string, int>* left_alone) {
  const int n = static_cast<int>(table.nodes.size());
  // Tensors computed from a batch input: only ops that touch them are worth
  // splitting (an element-wise op on a weight whose first dimension happens to
  // equal the batch is not).
  std::vector<bool> derived(table.tensors.size(), false);
  std::deque<int> frontier;
  for (size_t t = 0; t < table.tensors.size(); ++t) {
    const std::string& op = table.nodes[table.tensors[t].node].def->op();
    const bool input = op == "_Arg" || op == "Placeholder" || op == "IteratorGetNext" ||
                       op == "IteratorGetNextSync" || op == "PlaceholderWithDefault";
    if (input && batch.shape_known[t] && !batch.shapes[t].empty() &&
        batch.shapes[t][0] == batch.batch) {
      derived[t] = true;
      frontier.push_back(table.tensors[t].node);
    }
  }
  std::vector<bool> seen(n, false);
  while (!frontier.empty()) {
    const int v = frontier.front();
    frontier.pop_front();
    for (int t : table.nodes[v].outputs) {
      derived[t] = true;
      for (int c : table.tensors[t].consumers) {
        if (!seen[c]) {
          seen[c] = true;
          frontier.push_back(c);
        }
      }
    }
  }
  std::vector<bool> in(n, false);
  for (int v = 0; v < n; ++v) {
    const BatchUse& use = batch.nodes[v];
    std::string reason = use.role == BatchRole::kNone ? use.why_not : "";
    if (reason.empty() && preserved.count(table.nodes[v].def->name())) reason = "preserved";
    if (reason.empty()) reason = FilterReason(*table.nodes[v].def, options);
    if (reason.empty()) {
      bool touches_batch = false;
      for (int port : use.batch_inputs) touches_batch |= derived[table.nodes[v].inputs[port]];
      // An op that makes the batch from one row (the gradient of a mean over the
      // batch) is worth splitting when that row comes from the batch's data.
      if (use.batch_inputs.empty()) touches_batch = derived[table.nodes[v].inputs[0]];
      if (!touches_batch) reason = "not_batch_data";
    }
    if (reason.empty()) {
      in[v] = true;
    } else if (reason != "op" && reason != "batch_unknown") {
      ++(*left_alone)[reason];
    }
  }
  // Fixpoint: a region op reads region tensors only where it cuts them, and never
  // a reduction's partial sum.
  for (bool changed = true; changed;) {
    changed = false;
    for (int v = 0; v < n; ++v) {
      if (!in[v]) continue;
      const BatchUse& use = batch.nodes[v];
      for (size_t port = 0; port < table.nodes[v].inputs.size() && in[v]; ++port) {
        const int p = table.tensors[table.nodes[v].inputs[port]].node;
        if (!in[p]) continue;
        const bool cut = std::find(use.batch_inputs.begin(), use.batch_inputs.end(),
                                   static_cast<int>(port)) != use.batch_inputs.end();
        if (!cut || batch.nodes[p].role == BatchRole::kReduce) {
          in[v] = false;
          changed = true;
          ++(*left_alone)["reads_region_whole"];
        }
      }
    }
  }
  // Connected parts.
  std::vector<int> parent(n);
  std::iota(parent.begin(), parent.end(), 0);
  std::function<int(int)> find = [&](int v) {
    while (parent[v] != v) v = parent[v] = parent[parent[v]];
    return v;
  };
  for (int v = 0; v < n; ++v) {
    if (!in[v]) continue;
    for (int t : table.nodes[v].inputs) {
      const int p = table.tensors[t].node;
      if (in[p]) parent[find(p)] = find(v);
    }
  }
  std::map<int, std::vector<int>> parts;
  for (int v = 0; v < n; ++v) {
    if (in[v]) parts[find(v)].push_back(v);
  }
  // A part worth splitting cuts or makes a tensor of at least min_tensor_bytes
  // (the size below which the planner leaves tensors alone).
  std::vector<std::vector<int>> regions;
  for (auto& [root, nodes] : parts) {
    int64_t largest = 0;
    for (int v : nodes) {
      for (int port : batch.nodes[v].batch_inputs) {
        largest = std::max(largest, table.tensors[table.nodes[v].inputs[port]].bytes);
      }
      for (int t : table.nodes[v].outputs) largest = std::max(largest, table.tensors[t].bytes);
    }
    if (largest >= std::max<int64_t>(options.min_tensor_bytes, 1)) {
      regions.push_back(std::move(nodes));
    } else {
      (*left_alone)["small"] += static_cast<int>(nodes.size());
    }
  }
  return regions;
}

// The largest working set of one op of `nodes` (distinct non-persistent buffers it
// reads and writes, plus scratch).
int64_t LargestWorkingSet(const TensorTable& table, const std::vector<int>& nodes) {
  int64_t largest = 0;
  for (int v : nodes) {
    std::set<int> buffers;
    for (const std::vector<int>* tensors : {&table.nodes[v].inputs, &table.nodes[v].outputs}) {
      for (int t : *tensors) buffers.insert(table.tensors[t].buffer);
    }
    int64_t bytes = table.nodes[v].temp_bytes;
    for (int b : buffers) {
      if (!table.buffers[b].persistent) bytes += table.buffers[b].bytes;
    }
    largest = std::max(largest, bytes);
  }
  return largest;
}

struct Trial {
  SplitGraph graph;
  SplitSpec spec;
  SplitSummary summary;
  SplitTrial result;
};

}  // namespace

bool NeedsSplit(const MemoryPlan& plan, const SimulationResult& simulation,
                const std::vector<int64_t>& budget_bytes) {
  if (!plan.feasible) return true;
  for (size_t d = 0; d < simulation.devices.size() && d < budget_bytes.size(); ++d) {
    if (budget_bytes[d] > 0 && simulation.devices[d].allocator_refused_bytes > 0) return true;
  }
  return false;
}

namespace {

// One search over regions and slice counts (see the header). With
// `through_batch_statistics`, gradients of batch statistics are per-sample ops
// (analyze/per_sample.h), so regions pass through them.
absl::Status SearchSplits(const GrapplerItem& item, const TensorTable& table,
                          const std::vector<int>& order, const ControlFlowInfo& flow,
                          const MemoryOptimizerOptions& options,
                          const MemoryPlannerOptions& planner, const MemoryPlan& unsplit,
                          const SimulationResult& unsplit_simulation,
                          bool through_batch_statistics, SplitOutcome* out) {
  out->planned = true;
  BatchAnalysis batch;
  absl::Status status = AnalyzeBatch(item, table, flow, through_batch_statistics, &batch);
  if (!status.ok()) {
    out->note = absl::StrCat("the batch could not be analyzed: ", status.message());
    return absl::OkStatus();
  }
  out->batch = batch.batch;
  if (batch.batch < 2) {
    out->note = "the batch size is not static (or is 1): nothing is split";
    return absl::OkStatus();
  }
  std::set<std::string> preserved;
  for (const std::string& name : item.NodesToPreserve()) preserved.insert(name);
  for (const std::string& fetch : item.fetch) {
    preserved.insert(tensorflow::grappler::NodeName(fetch));
  }
  std::vector<std::vector<int>> regions =
      Regions(table, batch, planner, preserved, &out->left_alone);
  VLOG(1) << "TfMemOpt split: batch " << batch.batch << ", " << regions.size() << " regions";
  if (VLOG_IS_ON(2)) {
    // Where the regions end: readers of a region tensor outside every region.
    std::vector<bool> in(table.nodes.size(), false);
    for (const std::vector<int>& region : regions) {
      for (int v : region) in[v] = true;
    }
    for (const std::vector<int>& region : regions) {
      for (int v : region) {
        for (int t : table.nodes[v].outputs) {
          for (int c : table.tensors[t].consumers) {
            if (in[c] || ReadsShapeOnly(table.nodes[c].def->op())) continue;
            VLOG(2) << "  region ends at " << table.nodes[c].def->name() << " ("
                    << table.nodes[c].def->op() << ": " << batch.nodes[c].why_not << ")";
          }
        }
      }
    }
  }
  if (regions.empty()) {
    out->note = "no per-sample ops to split";
    return absl::OkStatus();
  }
  // The part with the largest op working set first, then all parts.
  std::stable_sort(regions.begin(), regions.end(),
                   [&](const std::vector<int>& a, const std::vector<int>& b) {
                     return LargestWorkingSet(table, a) > LargestWorkingSet(table, b);
                   });
  std::vector<std::vector<int>> region_sets = {regions.front()};
  if (regions.size() > 1) {
    std::vector<int> all;
    for (const std::vector<int>& region : regions) all.insert(all.end(), region.begin(), region.end());
    std::sort(all.begin(), all.end());
    region_sets.push_back(std::move(all));
  }
  // Candidates that do not fit are judged as the planner judges plans (Objective):
  // the peak's excess plus the bytes an allocator refusal misses, so that a split
  // whose peak is lower but whose allocation BFC refuses is not taken for progress.
  // Only the excess is compared across graphs (the overshoot sums over steps, and a
  // split graph has more of them).
  const int64_t unsplit_peak = WorstPeak(unsplit.peak_bytes);
  const int64_t unsplit_excess = Judge(unsplit_simulation, planner.budget_bytes).excess;
  // Each trial plans a whole graph: its own descent gets a quarter of the effort.
  MemoryPlannerOptions trial_planner = planner;
  trial_planner.max_simulations = std::max(1, planner.max_simulations / 4);
  std::unique_ptr<Trial> best;
  std::vector<std::string> failures;
  int trials = 0;
  int64_t unaligned = 0;  // a region's slice unit when the batch has fewer than 2 of them
  for (const std::vector<int>& region : region_sets) {
    int64_t previous_excess = unsplit_excess;
    int64_t previous_rows = batch.batch;  // the largest slice of the last count tried
    int misses = 0;  // powers of two in a row that raised the excess
    const int64_t unit = SliceUnit(table, batch, region);
    if (SliceRows(batch.batch, 2, unit).empty()) unaligned = unit;
    for (int k = 2; k <= planner.max_split_slices && !SliceRows(batch.batch, k, unit).empty() &&
                    trials < kMaxTrials;
         k = NextSliceCount(k)) {
      // Aligned slices can be uneven: a count whose largest slice is no smaller than
      // the last count's peaks no lower (a batch of 4 units in 3 slices: 2, 1, 1).
      const std::vector<int64_t> rows = SliceRows(batch.batch, k, unit);
      const int64_t largest = *std::max_element(rows.begin(), rows.end());
      if (largest >= previous_rows) continue;
      previous_rows = largest;
      ++trials;
      auto trial = std::make_unique<Trial>();
      SplitGraph& candidate = trial->graph;
      trial->spec.nodes = region;
      trial->spec.slices = k;
      trial->spec.preserved = preserved;
      tensorflow::GraphDef graph;
      status = BuildSplitGraph(item.graph, table, order, batch, trial->spec, &graph,
                               &trial->summary);
      if (!status.ok()) {
        failures.push_back(absl::StrCat(k, " slices: ", status.message()));
        VLOG(1) << "TfMemOpt split: " << failures.back();
        break;
      }
      VLOG(1) << "TfMemOpt split: built " << region.size() << " ops in " << k << " slices, "
              << trial->summary.stages << " stages, " << graph.node_size() << " nodes";
      candidate.item = std::make_unique<GrapplerItem>(item.WithGraph(std::move(graph)));
      status = BuildTensorTable(*candidate.item, options, &candidate.table);
      if (status.ok()) {
        status = TopologicalOrder(candidate.item->graph, candidate.table, &candidate.order);
      }
      if (status.ok()) {
        status = AnalyzeControlFlow(candidate.item->graph, candidate.table, candidate.order,
                                    &candidate.flow);
      }
      if (status.ok()) {
        status = candidate.table.devices == table.devices
                     ? absl::OkStatus()
                     : absl::FailedPreconditionError("the split graph uses other devices");
      }
      if (status.ok()) {
        status = PlanMemory(candidate.table, candidate.order, candidate.flow, trial_planner,
                            &candidate.plan, &candidate.rewrite, &candidate.simulation);
      }
      if (!status.ok()) {
        // A candidate that cannot be analyzed or planned is not split; the plan
        // without splitting stands.
        failures.push_back(absl::StrCat(k, " slices: ", status.message()));
        VLOG(1) << "TfMemOpt split: " << failures.back();
        break;
      }
      SplitTrial& result = trial->result;
      result.slices = k;
      result.through_batch_statistics = through_batch_statistics;
      result.region_nodes = static_cast<int>(region.size());
      result.peak_bytes = candidate.plan.peak_bytes;
      result.fits = !NeedsSplit(candidate.plan, candidate.simulation, planner.budget_bytes);
      result.excess = Judge(candidate.simulation, planner.budget_bytes).excess;
      result.added_seconds = AddedCompute(candidate.table) + candidate.plan.added_seconds +
                             kSliceOverheadSeconds * trial->summary.added_nodes;
      out->trials.push_back(result);
      VLOG(1) << "TfMemOpt split: " << region.size() << " ops in " << k << " slices: peak "
              << WorstPeak(result.peak_bytes) << (result.fits ? " fits" : " does not fit");
      const bool better =
          best == nullptr ||
          (result.fits && !best->result.fits) ||
          (result.fits == best->result.fits && !result.fits &&
           result.excess < best->result.excess);
      const int64_t excess = result.excess;
      if (better) best = std::move(trial);
      if (result.fits) break;  // a larger k only costs more
      // More slices help only while each slice's working set keeps the plan from
      // fitting. A split that comes no closer to fitting than the plan without
      // splitting, or no closer than fewer slices did (within 0.1 % of the peak),
      // no longer reaches what keeps the plan from fitting: more slices will not
      // either. A count that does worse is another matter: the slices' tensors pack
      // BFC's doubling regions differently at each count, so the excess is not
      // monotone in it (ResNet-50 64x64 at batch 384 under a 1024 MiB cap: 3 slices
      // 933.5 MiB, 4 958.8, 6 942.1, 8 919.5 and fits). The search gives up after
      // two such powers of two in a row (a count between them is tried either way).
      if (excess >= previous_excess) {
        const bool flat = excess - previous_excess <= unsplit_peak / 1000;
        if (IsPowerOfTwo(k) && (excess >= unsplit_excess || flat || ++misses >= 2)) break;
        continue;
      }
      misses = 0;
      previous_excess = excess;
    }
    if (best != nullptr && best->result.fits) break;  // the smaller region suffices
  }
  if (best == nullptr) {
    if (failures.empty() && unaligned > 0) {
      // Slices start at 64-byte-aligned rows (SliceUnit), so that per-sample
      // outputs stay bitwise equal.
      out->note = absl::StrCat("a batch of ", batch.batch,
                               " cannot be cut into 2 slices that start at multiples of ",
                               unaligned, " rows (64-byte-aligned rows, for bitwise equal "
                               "per-sample outputs)");
    } else {
      out->note = absl::StrCat("no split could be built",
                               failures.empty() ? "" : absl::StrCat(": ", failures.front()));
    }
    return absl::OkStatus();
  }
  if (!best->result.fits && (best->result.excess >= unsplit_excess ||
                              !ClearlyLower(WorstPeak(best->result.peak_bytes), unsplit_peak))) {
    // Splitting changes the order of the weight gradients' sums. A split that does
    // not fit either is worth that only when it beats the plan without splitting on
    // every count: a predicted peak lower by more than a near tie, and closer to
    // fitting (allocator refusals included). Where the two disagree, the prediction
    // cannot tell them apart.
    out->note = !ClearlyLower(WorstPeak(best->result.peak_bytes), unsplit_peak)
                    ? "no split lowers the predicted peak by more than 2 %"
                    : "no split comes closer to fitting: the split with the lowest peak "
                      "has an allocator refusal that leaves it further from the budget";
    return absl::OkStatus();
  }
  out->applied = true;
  out->fits = best->result.fits;
  out->excess = best->result.excess;
  out->peak = WorstPeak(best->result.peak_bytes);
  out->through_batch_statistics = through_batch_statistics;
  out->spec = std::move(best->spec);
  out->summary = std::move(best->summary);
  out->added_seconds = best->result.added_seconds;
  for (int v : out->spec.nodes) {
    out->region.push_back(table.nodes[v].def->name());
    ++out->region_ops[table.nodes[v].def->op()];
  }
  if (!best->result.fits) {
    out->note = absl::StrCat("no split fits the budget; the one applied reaches the lowest peak "
                             "found (", best->result.slices, " slices)");
  }
  out->chosen = std::move(best->graph);
  return absl::OkStatus();
}

}  // namespace

absl::Status PlanSplit(const GrapplerItem& item, const TensorTable& table,
                       const std::vector<int>& order, const ControlFlowInfo& flow,
                       const MemoryOptimizerOptions& options,
                       const MemoryPlannerOptions& planner, const MemoryPlan& unsplit,
                       const SimulationResult& unsplit_simulation, SplitOutcome* out) {
  // Splits that keep every sum over the batch but the weight gradients' first.
  absl::Status status = SearchSplits(item, table, order, flow, options, planner, unsplit,
                                     unsplit_simulation, /*through_batch_statistics=*/false, out);
  if (!status.ok()) return status;
  const auto statistics = out->left_alone.find("batch_statistics");
  if (out->fits || !options.split_batch_statistics || statistics == out->left_alone.end() ||
      statistics->second == 0) {
    return absl::OkStatus();
  }
  // Splitting through batch statistics reorders the sums that batch normalization's
  // backward subtracts from each other (docs/split.md#batch-statistics): searched
  // only when no other split fits, and taken when it fits or, missing the budget
  // too, beats the split found without it (if any) on both counts, as any split
  // must beat the plan without splitting.
  SplitOutcome through;
  status = SearchSplits(item, table, order, flow, options, planner, unsplit,
                        unsplit_simulation, /*through_batch_statistics=*/true, &through);
  if (!status.ok()) return status;
  const bool better = through.applied &&
                      (through.fits || !out->applied ||
                       (through.excess < out->excess && ClearlyLower(through.peak, out->peak)));
  if (!better) {
    out->trials.insert(out->trials.end(), through.trials.begin(), through.trials.end());
    const std::string why = through.applied ? "no split comes closer to fitting" : through.note;
    if (why != out->note) {
      absl::StrAppend(&out->note, out->note.empty() ? "" : "; ", "through batch statistics: ",
                      why);
    }
    return absl::OkStatus();
  }
  through.trials.insert(through.trials.begin(), out->trials.begin(), out->trials.end());
  if (through.note.empty()) {
    through.note = "no split that leaves batch statistics whole fits the budget";
  }
  *out = std::move(through);
  return absl::OkStatus();
}

}  // namespace tfmemopt
