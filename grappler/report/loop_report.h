// Report: per while-loop of the analyzed graph, its trip count, the TensorLists it
// fills, and which of them the plan moved to host memory (or why not).
#ifndef TFMEMOPT_GRAPPLER_REPORT_LOOP_REPORT_H_
#define TFMEMOPT_GRAPPLER_REPORT_LOOP_REPORT_H_

#include <vector>

#include "grappler/analyze/tensor_table.h"
#include "grappler/report/memory_report.h"

namespace tfmemopt {

// `table`: the analyzed (original) graph's; `swapped`: its list indices the plan
// swaps; `planned`: whether the planner ran with swapping enabled (otherwise
// swappable lists are reported as "swap_disabled"); `bandwidth`: the plan's copy
// bandwidth, bytes per second.
void FillLoopReport(const TensorTable& table, const std::vector<int>& swapped, bool planned,
                    double bandwidth, std::vector<LoopReport>* loops);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REPORT_LOOP_REPORT_H_
