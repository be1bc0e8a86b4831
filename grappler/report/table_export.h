// Report: the pass's view of a graph, as JSON, for benchmarks and tests that need
// to reason about exactly what the planner sees (e.g. benchmarks/optimality.py
// builds the Checkmate MILP from it).
#ifndef TFMEMOPT_GRAPPLER_REPORT_TABLE_EXPORT_H_
#define TFMEMOPT_GRAPPLER_REPORT_TABLE_EXPORT_H_

#include <string>
#include <vector>

#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/memory_optimizer_options.h"

namespace tfmemopt {

// {"nodes": [{"name", "op", "device", "backward", "stateful", "compute_seconds",
//             "temp_bytes", "inputs": [tensor], "outputs": [tensor],
//             "control_inputs": [node], "recomputable": "" or why not,
//             "reusable_inputs": [input position], "updated_variables": [input position],
//             "extra_buffers": [buffer]}],
//  "tensors": [{"node", "port", "bytes", "buffer", "role", "dtype"}],
//  "buffers": [{"owner", "bytes", "host_bytes", "persistent", "device", "external",
//               "released_by": node or -1, "pieces"}],
//  "order": [node], "fetch": [tensor], "devices": [name]}
// The fields are NodeInfo's, TensorInfo's and BufferInfo's (dtype: DataTypeString,
// e.g. "float", "resource"); `order` is the order the simulator replays (ExecutorOrder),
// so that a replay of the table in Python can follow the simulator's rules exactly.
std::string TensorTableJson(const TensorTable& table, const std::vector<int>& order,
                            const ControlFlowInfo& flow, const MemoryOptimizerOptions& options);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REPORT_TABLE_EXPORT_H_
