#include "grappler/memory_optimizer_options.h"

#include <functional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/attr_value.pb.h"

namespace tfmemopt {
namespace {

using tensorflow::AttrValue;
using Setter = std::function<absl::Status(const std::string& key,
                                          const AttrValue& value,
                                          MemoryOptimizerOptions* options)>;
using Getter = std::function<std::string(const MemoryOptimizerOptions& options)>;

// One row per field of tfmemopt.MemoryOptimizerConfig.
struct OptionField {
  const char* name;
  const char* type;  // as reported by OptionSchemaJson()
  std::vector<std::string> enum_values;
  Setter set;
  Getter get;  // JSON-encoded value
};

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string Describe(const AttrValue& value) {
  switch (value.value_case()) {
    case AttrValue::kI: return absl::StrCat("int ", value.i());
    case AttrValue::kF: return absl::StrCat("float ", value.f());
    case AttrValue::kB: return value.b() ? "bool true" : "bool false";
    case AttrValue::kS: return absl::StrCat("string \"", value.s(), "\"");
    case AttrValue::kList: return "a list";
    default: return "a value of another kind";
  }
}

absl::Status Bad(const std::string& key, const AttrValue& value,
                 const std::string& allowed) {
  return absl::InvalidArgumentError(absl::StrCat(
      "TfMemOpt: parameter_map key '", key, "' has ", Describe(value),
      "; allowed: ", allowed));
}

// AttrValue only carries float32, so whole numbers given as int are accepted too.
bool AsNumber(const AttrValue& value, double* x) {
  if (value.value_case() == AttrValue::kF) {
    *x = value.f();
  } else if (value.value_case() == AttrValue::kI) {
    *x = static_cast<double>(value.i());
  } else {
    return false;
  }
  return true;
}

template <typename Int>
OptionField IntField(const char* name, const char* type,
                     Int MemoryOptimizerOptions::*member, int64_t min_value,
                     int64_t max_value, const char* allowed_text = nullptr) {
  const std::string allowed =
      allowed_text != nullptr ? std::string(allowed_text)
      : max_value == INT64_MAX ? absl::StrCat("an int >= ", min_value)
                               : absl::StrCat("an int in ", min_value, "..", max_value);
  return {name, type, {},
          [=](const std::string& key, const AttrValue& value,
              MemoryOptimizerOptions* options) {
            if (value.value_case() != AttrValue::kI || value.i() < min_value ||
                value.i() > max_value) {
              return Bad(key, value, allowed);
            }
            options->*member = static_cast<Int>(value.i());
            return absl::OkStatus();
          },
          [=](const MemoryOptimizerOptions& options) {
            return absl::StrCat(options.*member);
          }};
}

OptionField BoolField(const char* name, bool MemoryOptimizerOptions::*member) {
  return {name, "bool", {},
          [=](const std::string& key, const AttrValue& value,
              MemoryOptimizerOptions* options) {
            if (value.value_case() != AttrValue::kB) return Bad(key, value, "a bool");
            options->*member = value.b();
            return absl::OkStatus();
          },
          [=](const MemoryOptimizerOptions& options) {
            return std::string(options.*member ? "true" : "false");
          }};
}

// `valid` decides the range; `allowed` says it in words.
OptionField DoubleField(const char* name, double MemoryOptimizerOptions::*member,
                        std::function<bool(double)> valid, std::string allowed) {
  return {name, "double", {},
          [=](const std::string& key, const AttrValue& value,
              MemoryOptimizerOptions* options) {
            double x;
            if (!AsNumber(value, &x) || !valid(x)) return Bad(key, value, allowed);
            options->*member = x;
            return absl::OkStatus();
          },
          [=](const MemoryOptimizerOptions& options) {
            return absl::StrCat(options.*member);
          }};
}

OptionField StringListField(const char* name,
                            std::vector<std::string> MemoryOptimizerOptions::*member) {
  return {name, "repeated_string", {},
          [=](const std::string& key, const AttrValue& value,
              MemoryOptimizerOptions* options) {
            std::vector<std::string> parsed;
            if (value.value_case() == AttrValue::kS) {
              parsed.push_back(value.s());
            } else if (value.value_case() == AttrValue::kList &&
                       value.list().i_size() == 0 && value.list().f_size() == 0 &&
                       value.list().b_size() == 0) {
              parsed.assign(value.list().s().begin(), value.list().s().end());
            } else {
              return Bad(key, value, "a list of strings");
            }
            for (const std::string& s : parsed) {
              if (s.empty()) return Bad(key, value, "a list of non-empty strings");
            }
            options->*member = std::move(parsed);
            return absl::OkStatus();
          },
          [=](const MemoryOptimizerOptions& options) {
            std::vector<std::string> quoted;
            for (const std::string& s : options.*member) quoted.push_back(JsonString(s));
            return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
          }};
}

// A string field restricted to `names`; enums also accept their number.
OptionField ChoiceField(const char* name, const char* type,
                        std::vector<std::string> names,
                        std::function<void(MemoryOptimizerOptions*, int)> assign,
                        std::function<int(const MemoryOptimizerOptions&)> index) {
  const bool is_enum = std::string(type) == "enum";
  std::vector<std::string> quoted;
  for (const std::string& n : names) quoted.push_back(JsonString(n));
  const std::string allowed = absl::StrCat("one of ", absl::StrJoin(quoted, ", "));
  return {name, type, is_enum ? names : std::vector<std::string>{},
          [=](const std::string& key, const AttrValue& value,
              MemoryOptimizerOptions* options) {
            int found = -1;
            if (value.value_case() == AttrValue::kS) {
              for (size_t i = 0; i < names.size(); ++i) {
                if (names[i] == value.s()) found = static_cast<int>(i);
              }
            } else if (is_enum && value.value_case() == AttrValue::kI &&
                       value.i() >= 0 &&
                       value.i() < static_cast<int64_t>(names.size())) {
              found = static_cast<int>(value.i());
            }
            if (found < 0) return Bad(key, value, allowed);
            assign(options, found);
            return absl::OkStatus();
          },
          [=](const MemoryOptimizerOptions& options) {
            return JsonString(names[index(options)]);
          }};
}

const std::vector<std::string>& ModeNames() {
  static const auto* names =
      new std::vector<std::string>{"AUTO", "ANALYZE_ONLY", "MANUAL"};
  return *names;
}

const std::vector<std::string>& RecomputePolicyNames() {
  static const auto* names = new std::vector<std::string>{"AUTO", "SQRT", "MANUAL"};
  return *names;
}

const std::vector<std::string>& FailStages() {
  static const auto* stages = new std::vector<std::string>{
      "", "analyze", "simulate", "schedule", "plan", "rewrite", "pace", "order", "merge",
      "verify", "report"};
  return *stages;
}

const std::vector<OptionField>& Fields() {
  using O = MemoryOptimizerOptions;
  static const auto* fields = new std::vector<OptionField>{
      IntField<int64_t>("budget_bytes", "int64", &O::budget_bytes, 0, INT64_MAX),
      DoubleField("budget_fraction", &O::budget_fraction,
                  [](double x) { return x > 0 && x <= 1; }, "a float in (0, 1]"),
      ChoiceField(
          "mode", "enum", ModeNames(),
          [](O* o, int i) { o->mode = static_cast<Mode>(i); },
          [](const O& o) { return static_cast<int>(o.mode); }),
      BoolField("enable_swap", &O::enable_swap),
      BoolField("enable_recompute", &O::enable_recompute),
      BoolField("enable_schedule", &O::enable_schedule),
      BoolField("enable_split", &O::enable_split),
      BoolField("split_batch_statistics", &O::split_batch_statistics),
      IntField<int64_t>("min_tensor_bytes", "int64", &O::min_tensor_bytes,
                        kAdaptiveMinTensorBytes, INT64_MAX,
                        "an int >= 0, or -1 (adaptive)"),
      StringListField("exclude_scopes", &O::exclude_scopes),
      StringListField("include_scopes", &O::include_scopes),
      StringListField("exclude_op_types", &O::exclude_op_types),
      StringListField("include_op_types", &O::include_op_types),
      DoubleField("host_bandwidth_bytes_per_sec", &O::host_bandwidth_bytes_per_sec,
                  [](double x) { return x >= 0; }, "a float >= 0 (0 = default)"),
      BoolField("fail_on_infeasible", &O::fail_on_infeasible),
      IntField<int>("log_level", "int32", &O::log_level, 0, 2),
      IntField<int64_t>("assume_batch_size", "int64", &O::assume_batch_size, 0,
                        INT64_MAX),
      ChoiceField(
          "recompute_policy", "enum", RecomputePolicyNames(),
          [](O* o, int i) { o->recompute_policy = static_cast<RecomputePolicy>(i); },
          [](const O& o) { return static_cast<int>(o.recompute_policy); }),
      StringListField("recompute_scopes", &O::recompute_scopes),
      IntField<int64_t>("max_swapped_tensors", "int64", &O::max_swapped_tensors, 0, INT64_MAX),
      IntField<int>("swapin_lead_ops", "int32", &O::swapin_lead_ops, 0, INT32_MAX),
      IntField<int>("swapin_lag_ops", "int32", &O::swapin_lag_ops, 0, INT32_MAX),
      BoolField("fuse_swapins", &O::fuse_swapins),
      IntField<int64_t>("assume_trip_count", "int64", &O::assume_trip_count, 0, INT64_MAX),
      BoolField("pace_loops", &O::pace_loops),
      BoolField("count_memory_held_outside", &O::count_memory_held_outside),
      IntField<int64_t>("allocator_region_bytes", "int64", &O::allocator_region_bytes, 0,
                        INT64_MAX),
      BoolField("observe_allocator", &O::observe_allocator),
      IntField<int>("model_inter_op_threads", "int32", &O::model_inter_op_threads, 0, 1024),
      ChoiceField(
          "test_only_fail_stage", "string", FailStages(),
          [](O* o, int i) { o->test_only_fail_stage = FailStages()[i]; },
          [](const O& o) {
            const auto& stages = FailStages();
            for (size_t i = 0; i < stages.size(); ++i) {
              if (stages[i] == o.test_only_fail_stage) return static_cast<int>(i);
            }
            return 0;
          }),
      IntField<int64_t>("test_only_hold_bytes", "int64", &O::test_only_hold_bytes, 0,
                        INT64_MAX),
      BoolField("test_only_keep_merge_cycles", &O::test_only_keep_merge_cycles),
  };
  return *fields;
}

}  // namespace

std::vector<int64_t> AdaptiveMinTensorBytesSteps(const MemoryOptimizerOptions& options) {
  if (options.min_tensor_bytes != kAdaptiveMinTensorBytes) return {options.min_tensor_bytes};
  return {int64_t{1} << 20, int64_t{64} << 10, 0};
}

const char* ModeName(Mode mode) {
  return ModeNames()[static_cast<int>(mode)].c_str();
}

const char* RecomputePolicyName(RecomputePolicy policy) {
  return RecomputePolicyNames()[static_cast<int>(policy)].c_str();
}

absl::Status ParseMemoryOptimizerOptions(
    const tensorflow::RewriterConfig_CustomGraphOptimizer* config,
    MemoryOptimizerOptions* options) {
  *options = MemoryOptimizerOptions();
  if (config == nullptr) return absl::OkStatus();
  std::vector<std::string> known;
  for (const OptionField& field : Fields()) known.push_back(field.name);
  for (const auto& [key, value] : config->parameter_map()) {
    const OptionField* match = nullptr;
    for (const OptionField& field : Fields()) {
      if (key == field.name) match = &field;
    }
    if (match == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TfMemOpt: unknown parameter_map key '", key,
          "'; known keys: ", absl::StrJoin(known, ", ")));
    }
    absl::Status status = match->set(key, value, options);
    if (!status.ok()) return status;
  }
  if (options->swapin_lead_ops > 0 && options->swapin_lag_ops > 0 &&
      options->swapin_lead_ops > options->swapin_lag_ops) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TfMemOpt: parameter_map keys 'swapin_lead_ops' (", options->swapin_lead_ops,
        ") and 'swapin_lag_ops' (", options->swapin_lag_ops,
        ") contradict each other; allowed: swapin_lead_ops <= swapin_lag_ops"));
  }
  if (config->parameter_map().count("budget_bytes") &&
      config->parameter_map().count("budget_fraction")) {
    return absl::InvalidArgumentError(
        "TfMemOpt: parameter_map keys 'budget_bytes' and 'budget_fraction' are "
        "both set; allowed: at most one of them");
  }
  return absl::OkStatus();
}

std::string OptionSchemaJson() {
  const MemoryOptimizerOptions defaults;
  std::ostringstream out;
  out << "{";
  bool first = true;
  for (const OptionField& field : Fields()) {
    if (!first) out << ", ";
    first = false;
    out << JsonString(field.name) << ": {\"type\": " << JsonString(field.type)
        << ", \"default\": " << field.get(defaults) << ", \"values\": [";
    for (size_t i = 0; i < field.enum_values.size(); ++i) {
      out << (i ? ", " : "") << JsonString(field.enum_values[i]);
    }
    out << "]}";
  }
  out << "}";
  return out.str();
}

}  // namespace tfmemopt

