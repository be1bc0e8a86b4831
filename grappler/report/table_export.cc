#include "grappler/report/table_export.h"

#include <sstream>

#include "absl/strings/str_format.h"
#include "grappler/plan/memory_planner.h"
#include "tensorflow/core/framework/types.h"

namespace tfmemopt {
namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

void List(std::ostringstream& out, const std::vector<int>& values) {
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  out << "]";
}

}  // namespace

std::string TensorTableJson(const TensorTable& table, const std::vector<int>& order,
                            const ControlFlowInfo& flow, const MemoryOptimizerOptions& options) {
  MemoryPlannerOptions planner;
  planner.exclude_scopes = options.exclude_scopes;
  planner.include_scopes = options.include_scopes;
  planner.exclude_op_types = options.exclude_op_types;
  planner.include_op_types = options.include_op_types;
  std::ostringstream out;
  out << "{\"nodes\":[";
  for (size_t n = 0; n < table.nodes.size(); ++n) {
    const NodeInfo& node = table.nodes[n];
    out << (n ? "," : "") << "{\"name\":" << Quote(node.def->name())
        << ",\"op\":" << Quote(node.def->op()) << ",\"device\":" << Quote(node.device)
        << ",\"backward\":" << (node.backward ? "true" : "false")
        << ",\"stateful\":" << (node.stateful ? "true" : "false")
        << ",\"compute_seconds\":" << absl::StrFormat("%.9g", node.compute_seconds)
        << ",\"temp_bytes\":" << node.temp_bytes << ",\"inputs\":";
    List(out, node.inputs);
    out << ",\"outputs\":";
    List(out, node.outputs);
    out << ",\"control_inputs\":";
    List(out, node.control_inputs);
    const std::string why = node.backward ? "backward"
                                          : NotRecomputableReason(table, flow, planner,
                                                                  static_cast<int>(n));
    out << ",\"recomputable\":" << Quote(why) << ",\"reusable_inputs\":";
    List(out, node.reusable_inputs);
    out << ",\"reusable_output\":" << node.reusable_output;
    out << ",\"updated_variables\":";
    List(out, node.updated_variables);
    out << ",\"extra_buffers\":";
    List(out, node.extra_buffers);
    out << "}";
  }
  out << "],\"tensors\":[";
  for (size_t t = 0; t < table.tensors.size(); ++t) {
    const TensorInfo& tensor = table.tensors[t];
    out << (t ? "," : "") << "{\"node\":" << tensor.node << ",\"port\":" << tensor.port
        << ",\"bytes\":" << tensor.bytes << ",\"buffer\":" << tensor.buffer
        << ",\"role\":" << Quote(TensorRoleName(tensor.role))
        << ",\"dtype\":" << Quote(tensorflow::DataTypeString(tensor.dtype)) << "}";
  }
  out << "],\"buffers\":[";
  for (size_t b = 0; b < table.buffers.size(); ++b) {
    const BufferInfo& buffer = table.buffers[b];
    out << (b ? "," : "") << "{\"owner\":" << buffer.owner << ",\"bytes\":" << buffer.bytes
        << ",\"host_bytes\":" << buffer.host_bytes
        << ",\"persistent\":" << (buffer.persistent ? "true" : "false")
        << ",\"device\":" << Quote(buffer.device)
        << ",\"external\":" << (buffer.external ? "true" : "false")
        << ",\"released_by\":" << buffer.released_by << ",\"pieces\":" << buffer.pieces << "}";
  }
  out << "],\"order\":";
  List(out, order);
  out << ",\"fetch\":";
  List(out, table.fetch_tensors);
  out << ",\"devices\":[";
  for (size_t d = 0; d < table.devices.size(); ++d) out << (d ? "," : "") << Quote(table.devices[d]);
  out << "]}";
  return out.str();
}

}  // namespace tfmemopt
