#include "grappler/report/loop_report.h"

#include <algorithm>

#include "absl/strings/str_join.h"

#include "grappler/rewrite/loop_swap.h"

namespace tfmemopt {

void FillLoopReport(const TensorTable& table, const std::vector<int>& swapped, bool planned,
                    double bandwidth, std::vector<LoopReport>* loops) {
  loops->clear();
  for (const LoopFrame& frame : table.loops.loops) {
    LoopReport loop;
    loop.frame = frame.name;
    loop.backward = frame.backward;
    loop.trip_count = frame.trip_count;
    loop.trip_count_source = frame.trip_count_source;
    loop.parallel_iterations = frame.parallel_iterations;
    // The reasons of the lists that hold (or may hold) data of their own; lists of
    // variable reads or written by no push explain nothing.
    std::vector<std::string> reasons;
    bool moved = false;
    for (int index : frame.lists) {
      const ListInstance& instance = table.loops.lists[index];
      LoopListReport list;
      list.list = table.nodes[instance.enter].def->name();
      if (instance.item >= 0) list.item = table.TensorName(instance.item);
      list.capacity = instance.capacity;
      list.capacity_source = instance.capacity_source;
      list.bytes = LoopListBytes(table, index);
      list.swapped = std::find(swapped.begin(), swapped.end(), index) != swapped.end();
      if (list.swapped) {
        moved = true;
        if (bandwidth > 0) list.copy_seconds = 2.0 * static_cast<double>(list.bytes) / bandwidth;
      } else {
        list.left_alone = LoopSwapBlocker(table, index);
        if (list.left_alone.empty()) list.left_alone = planned ? "not_needed" : "swap_disabled";
        if ((list.bytes > 0 || list.capacity < 0) && list.left_alone != "references_a_variable" &&
            std::find(reasons.begin(), reasons.end(), list.left_alone) == reasons.end()) {
          reasons.push_back(list.left_alone);
        }
      }
      loop.lists.push_back(std::move(list));
    }
    if (!moved) {
      std::sort(reasons.begin(), reasons.end());
      loop.left_alone = frame.backward   ? "gradient_loop"
                        : reasons.empty() ? "fills_no_list"
                                          : absl::StrJoin(reasons, ", ");
    }
    loops->push_back(std::move(loop));
  }
}

}  // namespace tfmemopt
