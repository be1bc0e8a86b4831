#include "grappler/ops/swap_ops.h"

#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "grappler/ops/host_memory_pool.h"
#include "tensorflow/core/framework/kernel_def_builder.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def_builder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfmemopt {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

// Types whose bytes are the value: a memcpy moves them. String, resource and
// variant tensors hold pointers to heap objects and are excluded.
constexpr char kPlainTypesAttr[] =
    "T: {bool, int8, uint8, int16, uint16, int32, uint32, int64, uint64, "
    "half, bfloat16, float, double, complex64, complex128}";

// One memcpy on the kernel's own thread. Splitting it over the intra-op threads
// gained nothing measurable here (memory-bound; benchmarks/host_bandwidth.py at
// commit ef7e3a0), and would take those threads from the compute that a swap is
// meant to overlap with.
void Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

class SwapOutOp : public OpKernel {
 public:
  explicit SwapOutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const size_t bytes = x.TotalBytes();
    tensorflow::core::RefCountPtr<tensorflow::TensorBuffer> buffer(
        HostMemoryPool::Global()->AllocateForSwapOut(bytes));
    OP_REQUIRES(ctx, buffer != nullptr,
                absl::ResourceExhaustedError(absl::StrCat(
                    name(), ": the host memory pool cannot allocate ", bytes, " bytes")));
    Copy(buffer->data(), x.tensor_data().data(), bytes);
    ctx->set_output(0, Tensor(x.dtype(), x.shape(), std::move(buffer)));
  }
};

class SwapInOp : public OpKernel {
 public:
  explicit SwapInOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& stash = ctx->input(0);
    // allocate_output, never forwarding: y must come from the device allocator,
    // and the host buffer is released when the stash's last reference goes.
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, stash.shape(), &y));
    Copy(const_cast<char*>(y->tensor_data().data()), stash.tensor_data().data(),
         stash.TotalBytes());
    HostMemoryPool::Global()->RecordSwapIn();
  }
};

absl::Status SameShapeAsInput(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->input(0));
  return absl::OkStatus();
}

void RegisterOp(const tensorflow::OpDefBuilder& builder) {
  tensorflow::OpRegistry::Global()->Register(
      [builder](tensorflow::OpRegistrationData* data) { return builder.Finalize(data); });
}

template <typename Kernel>
void RegisterCpuKernel(const char* op_name, const char* class_name) {
  // Registrars must outlive the process's kernel lookups; they are never freed.
  new tensorflow::kernel_factory::OpKernelRegistrar(
      tensorflow::KernelDefBuilder(op_name).Device(tensorflow::DEVICE_CPU).Build(), class_name,
      [](OpKernelConstruction* ctx) -> OpKernel* { return new Kernel(ctx); });
}

}  // namespace

absl::Status RegisterSwapOpsOnce() {
  static std::mutex mu;
  static bool registered_here = false;
  std::lock_guard<std::mutex> lock(mu);
  if (registered_here) return absl::OkStatus();
  for (const char* name : {kSwapOutOpName, kSwapInOpName}) {
    if (tensorflow::OpRegistry::Global()->LookUp(name) != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat(
          "an op named ", name, " is already registered by another library"));
    }
  }
  RegisterOp(tensorflow::OpDefBuilder(kSwapOutOpName)
                 .Input("x: T")
                 .Output("stash: T")
                 .Attr(kPlainTypesAttr)
                 .SetIsStateful()
                 .SetShapeFn(SameShapeAsInput)
                 .Doc(R"doc(
Copies `x` into tfmemopt's host memory pool, outside TensorFlow's allocators, so
that `x` itself can be freed. Inserted by the TfMemOpt Grappler pass; read back
with TfMemSwapIn. T must be a type whose bytes are its value (numbers and bool;
not string, resource or variant). Stateful so that later Grappler passes keep it.

stash: `x`'s value, held in host memory.
)doc"));
  RegisterOp(tensorflow::OpDefBuilder(kSwapInOpName)
                 .Input("stash: T")
                 .Output("y: T")
                 .Attr(kPlainTypesAttr)
                 .SetIsStateful()
                 .SetShapeFn(SameShapeAsInput)
                 .Doc(R"doc(
Copies a TfMemSwapOut stash back into a new tensor from the device allocator.
Its control inputs decide when the bytes come back. T must be a type whose bytes
are its value (numbers and bool; not string, resource or variant). Stateful so
that later Grappler passes keep it.

y: the value that was swapped out, bitwise identical.
)doc"));
  RegisterCpuKernel<SwapOutOp>(kSwapOutOpName, "SwapOutOp");
  RegisterCpuKernel<SwapInOp>(kSwapInOpName, "SwapInOp");
  registered_here = true;
  return absl::OkStatus();
}

}  // namespace tfmemopt
