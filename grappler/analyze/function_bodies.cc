#include "grappler/analyze/function_bodies.h"

#include <atomic>

#include "tensorflow/c/c_api.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"
#include "tensorflow/core/framework/function.pb.h"
#include "tensorflow/core/platform/logging.h"

namespace tfmemopt {
namespace {
std::atomic<void*> eager_context{nullptr};

// A signature with outputs and no nodes.
bool IsStub(const tensorflow::FunctionDef& function) {
  return function.node_def_size() == 0 && function.signature().output_arg_size() > 0;
}
}  // namespace

void SetEagerContext(void* context) { eager_context.store(context); }

bool HasStubFunctions(const tensorflow::GraphDef& graph) {
  for (const tensorflow::FunctionDef& function : graph.library().function()) {
    if (IsStub(function)) return true;
  }
  return false;
}

bool FillFunctionBodies(tensorflow::GraphDef* graph) {
  auto* context = static_cast<TFE_Context*>(eager_context.load());
  if (context == nullptr) return false;
  bool filled = false;
  for (tensorflow::FunctionDef& function : *graph->mutable_library()->mutable_function()) {
    if (!IsStub(function)) continue;
    const std::string name = function.signature().name();
    TF_Buffer* buffer = TF_NewBuffer();
    TF_Status* status = TF_NewStatus();
    TFE_ContextGetFunctionDef(context, name.c_str(), buffer, status);
    tensorflow::FunctionDef body;
    if (TF_GetCode(status) == TF_OK && body.ParseFromArray(buffer->data, buffer->length) &&
        body.signature().name() == name && body.node_def_size() > 0) {
      function = std::move(body);
      filled = true;
    } else {
      VLOG(1) << "TfMemOpt: no body for function " << name << ": " << TF_Message(status);
    }
    TF_DeleteStatus(status);
    TF_DeleteBuffer(buffer);
  }
  return filled;
}

}  // namespace tfmemopt
