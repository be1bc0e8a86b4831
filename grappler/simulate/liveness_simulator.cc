#include "grappler/simulate/liveness_simulator.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "grappler/simulate/bfc_allocator_model.h"
#include "tensorflow/core/grappler/utils/topological_sort.h"

namespace tfmemopt {

absl::Status TopologicalOrder(const tensorflow::GraphDef& graph,
                              const TensorTable& table, std::vector<int>* order) {
  std::vector<const tensorflow::NodeDef*> topo;
  absl::Status status = tensorflow::grappler::ComputeTopologicalOrder(graph, &topo);
  if (!status.ok()) return status;
  order->clear();
  order->reserve(topo.size());
  for (const tensorflow::NodeDef* node : topo) {
    auto it = table.node_index.find(node->name());
    if (it == table.node_index.end()) {
      return absl::InternalError(absl::StrCat("order names unknown node ", node->name()));
    }
    order->push_back(it->second);
  }
  return absl::OkStatus();
}

absl::Status Simulate(const TensorTable& table, const std::vector<int>& order,
                      const SimulationOptions& options, SimulationResult* result) {
  result->order = order;
  result->devices.clear();
  const int num_devices = static_cast<int>(table.devices.size());
  std::vector<int> device_of_buffer(table.buffers.size(), 0);
  for (size_t b = 0; b < table.buffers.size(); ++b) {
    auto it = std::lower_bound(table.devices.begin(), table.devices.end(),
                               table.buffers[b].device);
    device_of_buffer[b] = static_cast<int>(it - table.devices.begin());
  }
  for (int d = 0; d < num_devices; ++d) {
    DeviceTimeline timeline;
    timeline.device = table.devices[d];
    timeline.activation_bytes.reserve(order.size());
    timeline.gradient_bytes.reserve(order.size());
    result->devices.push_back(std::move(timeline));
  }

  for (size_t b = 0; b < table.buffers.size(); ++b) {
    if (table.buffers[b].persistent) {
      result->devices[device_of_buffer[b]].persistent_bytes += table.buffers[b].bytes;
    }
  }
  // Position of each node in the order. A read whose producer runs later is a
  // loop back edge (NextIteration -> Merge): it neither holds nor frees a buffer.
  std::vector<int> position(table.nodes.size(), -1);
  for (size_t step = 0; step < order.size(); ++step) {
    const int n = order[step];
    if (n < 0 || n >= static_cast<int>(table.nodes.size()) || position[n] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad order entry ", n));
    }
    position[n] = static_cast<int>(step);
  }
  auto forward_edge = [&](int tensor, int consumer) {
    return position[table.tensors[tensor].node] < position[consumer];
  };

  // Runs the order up to and including step `last`; `on_step` sees the live set
  // between allocation and release, `on_alloc`/`on_free` see each buffer.
  std::vector<bool> live;
  std::vector<int64_t> activation, gradient;
  using BufferHook = std::function<void(int)>;
  const BufferHook no_hook = [](int) {};
  auto run = [&](size_t last, const std::function<void(size_t)>& on_step,
                 const BufferHook& on_alloc, const BufferHook& on_free) {
    // Remaining reads per buffer: every consumer edge of every tensor on it. A
    // fetched tensor holds one extra read that is never released.
    std::vector<int64_t> pending(table.buffers.size(), 0);
    for (size_t t = 0; t < table.tensors.size(); ++t) {
      for (int consumer : table.tensors[t].consumers) {
        if (forward_edge(t, consumer)) ++pending[table.tensors[t].buffer];
      }
    }
    for (int t : table.fetch_tensors) ++pending[table.tensors[t].buffer];
    live.assign(table.buffers.size(), false);
    activation.assign(num_devices, 0);
    gradient.assign(num_devices, 0);
    auto add = [&](int b, int64_t sign) {
      const BufferInfo& buffer = table.buffers[b];
      const int d = device_of_buffer[b];
      if (table.tensors[buffer.owner].role == TensorRole::kGradient) {
        gradient[d] += sign * buffer.bytes;
      } else {
        activation[d] += sign * buffer.bytes;
      }
    };
    auto release = [&](int b) {
      if (pending[b] == 0 && live[b]) {
        live[b] = false;
        add(b, -1);
        on_free(b);
      }
    };
    for (size_t step = 0; step <= last && step < order.size(); ++step) {
      const NodeInfo& node = table.nodes[order[step]];
      for (int t : node.outputs) {
        const int b = table.tensors[t].buffer;
        // Forwarded outputs were counted when their buffer's owner ran.
        if (table.buffers[b].persistent || live[b] || table.buffers[b].owner != t) continue;
        live[b] = true;
        add(b, +1);
        on_alloc(b);
      }
      on_step(step);
      for (int t : node.inputs) {
        if (!forward_edge(t, order[step])) continue;
        const int b = table.tensors[t].buffer;
        --pending[b];
        release(b);
      }
      for (int t : node.outputs) release(table.tensors[t].buffer);
    }
  };

  std::vector<int> device_of_node(table.nodes.size(), 0);
  for (size_t n = 0; n < table.nodes.size(); ++n) {
    auto it = std::lower_bound(table.devices.begin(), table.devices.end(),
                               table.nodes[n].device);
    device_of_node[n] = static_cast<int>(it - table.devices.begin());
  }
  run(order.size(), [&](size_t step) {
    const NodeInfo& node = table.nodes[order[step]];
    for (int d = 0; d < num_devices; ++d) {
      DeviceTimeline& timeline = result->devices[d];
      // A kernel's scratch memory counts while it runs, as part of its step.
      const int64_t temp = device_of_node[order[step]] == d ? node.temp_bytes : 0;
      std::vector<int64_t>& role = node.backward ? gradient : activation;
      role[d] += temp;
      const int64_t total = timeline.persistent_bytes + activation[d] + gradient[d];
      if (total > timeline.peak_bytes || timeline.peak_step < 0) {
        timeline.peak_bytes = total;
        timeline.peak_step = static_cast<int>(step);
      }
      timeline.activation_bytes.push_back(activation[d]);
      timeline.gradient_bytes.push_back(gradient[d]);
      role[d] -= temp;
    }
  }, no_hook, no_hook);
  for (int d = 0; d < num_devices; ++d) {
    DeviceTimeline& timeline = result->devices[d];
    if (timeline.peak_step < 0) continue;
    const size_t peak_step = static_cast<size_t>(timeline.peak_step);
    run(peak_step, [&](size_t step) {
      if (step != peak_step) return;
      for (size_t b = 0; b < live.size(); ++b) {
        if (live[b] && device_of_buffer[b] == d) timeline.live_at_peak.push_back(b);
      }
    }, no_hook, no_hook);
  }

  // The allocator model: persistent buffers first, then a warm-up step (which
  // shapes BFC's regions, as the first real step does), then the measured step.
  for (int d = 0; d < num_devices && d < static_cast<int>(options.bfc_memory_limit.size()); ++d) {
    if (options.bfc_memory_limit[d] <= 0) continue;
    BfcAllocatorModel allocator(options.bfc_memory_limit[d]);
    for (size_t b = 0; b < table.buffers.size(); ++b) {
      if (table.buffers[b].persistent && device_of_buffer[b] == d) {
        allocator.Allocate(table.buffers[b].bytes);
      }
    }
    std::vector<int64_t> chunk(table.buffers.size(), -2);
    const BufferHook on_alloc = [&](int b) {
      if (device_of_buffer[b] == d) chunk[b] = allocator.Allocate(table.buffers[b].bytes);
    };
    const BufferHook on_free = [&](int b) {
      allocator.Free(chunk[b]);
      chunk[b] = -2;
    };
    const auto on_step = [&](size_t step) {
      const int n = order[step];
      if (device_of_node[n] == d && table.nodes[n].temp_bytes > 0) {
        allocator.Free(allocator.Allocate(table.nodes[n].temp_bytes));
      }
    };
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1) allocator.ResetPeak();
      run(order.size(), on_step, on_alloc, on_free);
      for (size_t b = 0; b < chunk.size(); ++b) on_free(static_cast<int>(b));  // step outputs
    }
    result->devices[d].allocator_peak_bytes = allocator.peak_bytes_in_use();
  }
  for (DeviceTimeline& timeline : result->devices) {
    std::sort(timeline.live_at_peak.begin(), timeline.live_at_peak.end(),
              [&](int a, int b) {
                if (table.buffers[a].bytes != table.buffers[b].bytes) {
                  return table.buffers[a].bytes > table.buffers[b].bytes;
                }
                return a < b;
              });
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
