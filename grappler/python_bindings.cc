// tfmemopt._ext: the pass and its Python surface in one shared object, so that
// `import tfmemopt` registers the pass exactly once and reads its reports.
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "grappler/analyze/allocator_state.h"
#include "grappler/analyze/function_bodies.h"
#include "grappler/memory_optimizer_options.h"
#include "grappler/ops/bfc_pool_reservation.h"
#include "grappler/ops/host_memory_pool.h"
#include "grappler/register_pass.h"
#include "grappler/report/memory_report.h"
#include "grappler/tfmemopt_optimizer.h"
#include "tensorflow/core/protobuf/rewriter_config.pb.h"

namespace py = pybind11;

PYBIND11_MODULE(_ext, m) {
  m.doc() = "tfmemopt native extension: the TfMemOpt Grappler pass";
  m.attr("PASS_NAME") = tfmemopt::kTfMemOptName;
  // The TF version whose headers this was compiled against (set by CMake).
  m.attr("BUILT_AGAINST_TF_VERSION") = TFMEMOPT_BUILT_AGAINST_TF;

  if (absl::Status status = tfmemopt::RegisterTfMemOpt(); !status.ok()) {
    throw py::import_error(std::string("tfmemopt: ") + std::string(status.message()));
  }

  m.def("reports", &tfmemopt::PublishedReports, py::arg("start") = 0,
        "JSON reports of every graph optimized in this process, newest last, from the "
        "start-th on.");
  m.def("num_reports", &tfmemopt::NumPublishedReports,
        "How many reports reports() would return.");
  m.def("clear_reports", &tfmemopt::ClearPublishedReports);
  m.def(
      "set_eager_context",
      [](py::capsule context) { tfmemopt::SetEagerContext(context.get_pointer()); },
      "Where the pass reads the bodies of functions Grappler gives it as stubs: the "
      "eager context's handle (tensorflow.python.eager.context.context()._handle).");
  m.def("option_schema", &tfmemopt::OptionSchemaJson,
        "The config fields as the C++ pass knows them (JSON).");
  m.def(
      "check_custom_optimizer",
      [](py::bytes serialized) {
        tensorflow::RewriterConfig_CustomGraphOptimizer config;
        if (!config.ParseFromString(std::string(serialized))) {
          return std::string("not a serialized RewriterConfig.CustomGraphOptimizer");
        }
        tfmemopt::MemoryOptimizerOptions options;
        absl::Status status = tfmemopt::ParseMemoryOptimizerOptions(&config, &options);
        return status.ok() ? std::string() : std::string(status.message());
      },
      "Parses a serialized custom optimizer entry as the pass's Init() does; returns "
      "'' or the error message.");
  m.def(
      "reserve_cpu_pool",
      [](int64_t min_region_bytes) {
        const tfmemopt::PoolReservation r = tfmemopt::ReserveCpuPool(min_region_bytes);
        py::dict d;
        d["region_bytes"] = r.region_bytes;
        d["limit_bytes"] = r.limit_bytes;
        d["pool_bytes"] = r.pool_bytes;
        d["reason"] = r.reason;
        return d;
      },
      py::arg("min_region_bytes"),
      "Reserves the rest of the CPU BFC allocator's limit as one region (the test "
      "bed); returns region_bytes (0: none, then reason), limit_bytes, pool_bytes.");
  m.def(
      "cpu_pool_chunks",
      [] {
        py::list out;
        for (const tfmemopt::PoolChunk& c : tfmemopt::ReadCpuPool()) {
          out.append(py::make_tuple(c.address, c.bytes, c.in_use));
        }
        return out;
      },
      "The CPU BFC allocator's chunks as the pass reads them (observe_allocator), in "
      "address order: (address, bytes, in_use); [] when the CPU allocator is not BFC.");
  m.def(
      "host_pool_stats",
      [] {
        const tfmemopt::HostPoolStats stats = tfmemopt::HostMemoryPool::Global()->Stats();
        py::dict d;
        d["bytes_in_use"] = stats.bytes_in_use;
        d["peak_bytes"] = stats.peak_bytes;
        d["swap_outs"] = stats.swap_outs;
        d["swap_ins"] = stats.swap_ins;
        d["cached_bytes"] = stats.cached_bytes;
        return d;
      },
      "Host memory pool of the swap ops: bytes_in_use, peak_bytes, swap_outs, swap_ins, "
      "cached_bytes (freed blocks kept for reuse).");
  m.def(
      "run_pass",
      [](py::bytes metagraph_bytes, py::bytes entry_bytes, bool export_table) {
        tensorflow::MetaGraphDef metagraph;
        tensorflow::RewriterConfig_CustomGraphOptimizer entry;
        if (!metagraph.ParseFromString(std::string(metagraph_bytes))) {
          throw py::value_error("tfmemopt: run_pass: not a serialized MetaGraphDef");
        }
        if (!entry.ParseFromString(std::string(entry_bytes))) {
          throw py::value_error("tfmemopt: run_pass: not a serialized CustomGraphOptimizer");
        }
        tensorflow::GraphDef graph;
        std::string report, table;
        absl::Status status;
        {
          py::gil_scoped_release release;
          status = tfmemopt::RunTfMemOptOnMetaGraph(metagraph, entry, &graph, &report,
                                                    export_table ? &table : nullptr);
        }
        return py::make_tuple(std::string(status.message()), status.ok(), report,
                              py::bytes(graph.SerializeAsString()), table);
      },
      py::arg("metagraph"), py::arg("entry"), py::arg("export_table") = false,
      "Runs the pass once on a serialized MetaGraphDef (no TF pass runs first): returns "
      "(error message, ok, report JSON, output GraphDef bytes, tensor table JSON).");
  m.def(
      "reset_host_pool_peak", [] { tfmemopt::HostMemoryPool::Global()->ResetPeak(); },
      "Restarts the host pool's peak_bytes from its bytes_in_use.");
}
