#include "grappler/plan/loop_candidates.h"

#include <algorithm>

#include "grappler/rewrite/loop_swap.h"

namespace tfmemopt {

std::vector<LoopSwapCandidate> LoopSwapCandidates(const TensorTable& table,
                                                  const std::vector<int>& live_at_peak,
                                                  const std::vector<int>& chosen,
                                                  int64_t min_bytes, double bandwidth,
                                                  double exposure) {
  std::vector<LoopSwapCandidate> out;
  if (table.loops.lists.empty() || bandwidth <= 0) return out;
  std::vector<bool> live(table.buffers.size(), false);
  for (int b : live_at_peak) {
    if (b >= 0 && b < static_cast<int>(live.size())) live[b] = true;
  }
  for (size_t l = 0; l < table.loops.lists.size(); ++l) {
    const int list = static_cast<int>(l);
    if (std::find(chosen.begin(), chosen.end(), list) != chosen.end()) continue;
    const ListInstance& instance = table.loops.lists[l];
    const int64_t bytes = LoopListBytes(table, list);
    if (bytes <= 0 || bytes < min_bytes || !LoopSwapBlocker(table, list).empty()) continue;
    // What the device gets back: the list's own elements, or, for elements read
    // from another list, that list's storage once this was its last holder.
    int64_t gain = 0;
    if (!instance.referenced) {
      if (live[instance.buffer]) gain = table.buffers[instance.buffer].bytes;
    } else {
      const BufferInfo& source = table.buffers[table.tensors[instance.item].buffer];
      const int source_index = table.tensors[instance.item].buffer;
      if (live[source_index] && source.held_by.size() == 1 && source.held_by[0] == instance.buffer) {
        gain = source.bytes;
      }
    }
    if (gain <= 0) continue;
    LoopSwapCandidate candidate;
    candidate.list = list;
    candidate.gain = gain;
    candidate.seconds = 2.0 * static_cast<double>(bytes) / bandwidth * exposure + 1e-7;
    out.push_back(candidate);
  }
  return out;
}

}  // namespace tfmemopt
