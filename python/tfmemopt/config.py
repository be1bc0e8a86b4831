"""The tfmemopt config: one schema (protos/rewriter_config_ext.proto), built here.

The message class is made at import time from the descriptor set that the build
generates from the .proto, so it does not depend on the protobuf runtime's version.
Python validates field names, types and the `budget` argument; value ranges are
checked by the C++ pass's own parser (the same code Grappler runs), so the two sides
cannot disagree about what is allowed.
"""

import difflib
import os
import re

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor as _FD
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from tfmemopt._loader import load_extension

_ext = load_extension()

PASS_NAME = _ext.PASS_NAME
# TF's built-in Grappler memory optimizer levels (RewriterConfig.MemOptType), by name.
MEMORY_OPTIMIZATION_LEVELS = tuple(
    rewriter_config_pb2.RewriterConfig.MemOptType.Name(v)
    for v in rewriter_config_pb2.RewriterConfig.MemOptType.values())
_DESCRIPTOR_FILE = os.path.join(os.path.dirname(__file__), "rewriter_config_ext.desc")


def _load_message_class():
    with open(_DESCRIPTOR_FILE, "rb") as f:
        file_set = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for file_proto in file_set.file:
        pool.Add(file_proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tfmemopt.MemoryOptimizerConfig")
    )


MemoryOptimizerConfig = _load_message_class()
_FIELDS = MemoryOptimizerConfig.DESCRIPTOR.fields_by_name


def _is_repeated(field):
    # protobuf 7 dropped FieldDescriptor.label in favour of is_repeated.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == _FD.LABEL_REPEATED

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text, field="budget"):
    """'6GiB' -> 6442450944, '512MB' -> 512000000, '1024' -> 1024 (bytes)."""
    match = _SIZE_RE.match(text)
    negative = _SIZE_RE.match(text.strip()[1:]) if text.strip().startswith("-") else None
    if negative and negative.group(2).upper() in _UNITS:
        # A size with a minus sign is a size, just not an allowed one: say that.
        raise ValueError(f"tfmemopt: {field}={text!r} must be more than 0 bytes; allowed: "
                         f"a positive size such as '6GiB' or '512MB'")
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"tfmemopt: {field}={text!r} is not a size; allowed: a number with an "
            f"optional unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
            f"(powers of 1024), e.g. '6GiB' or '512MB'"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        hint = ""
        if not unit and field == "budget":
            # '0.5' reads as half a byte: the user most likely meant a fraction.
            hint = (f"; a string without a unit is bytes, so for a fraction of device "
                    f"memory pass the float {float(match.group(1))!r}")
        raise ValueError(f"tfmemopt: {field}={text!r} must be more than 0 bytes{hint}")
    return value


def _budget_fields(budget):
    """Maps the `budget` argument to budget_bytes or budget_fraction."""
    if budget is None:
        return {}
    if isinstance(budget, bool):
        raise TypeError(
            f"tfmemopt: budget={budget!r} is a bool; allowed: bytes (int), a size "
            f"string like '6GiB', or a fraction of device memory in (0, 1]"
        )
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(
                f"tfmemopt: budget={budget} must be a positive number of bytes"
            )
        return {"budget_bytes": budget}
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(
                f"tfmemopt: budget={budget!r} is a float, i.e. a fraction of device "
                f"memory, and must be in (0, 1]; for bytes pass an int or a string "
                f"like '6GiB'"
            )
        return {"budget_fraction": budget}
    if isinstance(budget, str):
        return {"budget_bytes": parse_size(budget)}
    raise TypeError(
        f"tfmemopt: budget={budget!r} has type {type(budget).__name__}; allowed: "
        f"bytes (int), a size string like '6GiB', or a fraction in (0, 1]"
    )


def _type_name(field):
    if _is_repeated(field):
        return "a list of str"
    if field.type == _FD.TYPE_ENUM:
        return "one of " + ", ".join(repr(v.name) for v in field.enum_type.values)
    return {
        _FD.TYPE_INT64: "an int", _FD.TYPE_INT32: "an int", _FD.TYPE_DOUBLE: "a float",
        _FD.TYPE_BOOL: "a bool", _FD.TYPE_STRING: "a str",
    }[field.type]


def _set_field(message, name, value):
    field = _FIELDS[name]

    def bad_type():
        return TypeError(
            f"tfmemopt: {name}={value!r} has type {type(value).__name__}; "
            f"allowed: {_type_name(field)}"
        )

    if _is_repeated(field):
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
            raise bad_type()
        getattr(message, name).extend(values)
    elif field.type == _FD.TYPE_BOOL:
        if not isinstance(value, bool):
            raise bad_type()
        setattr(message, name, value)
    elif field.type in (_FD.TYPE_INT64, _FD.TYPE_INT32):
        if isinstance(value, str) and name.endswith("_bytes"):
            value = parse_size(value, field=name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_type()
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"tfmemopt: {name}={value} is out of the int64 range")
        setattr(message, name, value)
    elif field.type == _FD.TYPE_DOUBLE:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_type()
        setattr(message, name, float(value))
    elif field.type == _FD.TYPE_ENUM:
        names = {v.name: v.number for v in field.enum_type.values}
        if isinstance(value, str) and value.upper() in names:
            setattr(message, name, names[value.upper()])
        elif isinstance(value, int) and not isinstance(value, bool) and value in names.values():
            setattr(message, name, value)
        elif isinstance(value, (str, int)) and not isinstance(value, bool):
            raise ValueError(f"tfmemopt: {name}={value!r}; allowed: {_type_name(field)}")
        else:
            raise bad_type()
    else:  # string
        if not isinstance(value, str):
            raise bad_type()
        setattr(message, name, value)


def make_config(budget=None, **fields):
    """Builds and validates a MemoryOptimizerConfig.

    `budget` is bytes (int), a size string ('6GiB', '512MB') or a fraction of the
    device memory in (0, 1]. Any other keyword is a field of the proto. Raises
    ValueError/TypeError naming the field, the value and what is allowed.
    """
    message = MemoryOptimizerConfig()
    for name in fields:
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, list(_FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"tfmemopt: unknown field {name!r}{hint}; allowed fields: "
                + ", ".join(sorted(_FIELDS))
            )
    budget_fields = _budget_fields(budget)
    for name in budget_fields:
        if name in fields:
            raise ValueError(
                f"tfmemopt: budget={budget!r} and {name}={fields[name]!r} both set the "
                f"budget; allowed: one of them"
            )
    if "budget_bytes" in fields and "budget_fraction" in fields:
        raise ValueError(
            "tfmemopt: budget_bytes and budget_fraction are both set; allowed: one of them"
        )
    for name, value in {**fields, **budget_fields}.items():
        _set_field(message, name, value)
    # Every config built in a process whose CPU pool tfmemopt.enable() reserved plans
    # for that pool (analyze(), tfmemopt.function, the Keras callback, Sessions).
    from tfmemopt import memory_pool

    if "allocator_region_bytes" not in fields and memory_pool.reserved_region_bytes():
        message.allocator_region_bytes = memory_pool.reserved_region_bytes()
    error = _ext.check_custom_optimizer(custom_optimizer_entry(message).SerializeToString())
    if error:
        raise ValueError(error.replace("TfMemOpt: parameter_map key", "tfmemopt: field"))
    return message


def custom_optimizer_entry(config):
    """The RewriterConfig.CustomGraphOptimizer that carries `config` to the pass.

    Every field that is set becomes one parameter_map entry named after it.
    """
    entry = rewriter_config_pb2.RewriterConfig.CustomGraphOptimizer(name=PASS_NAME)
    for field, value in config.ListFields():
        attr = attr_value_pb2.AttrValue()
        if _is_repeated(field):
            attr.list.s.extend(v.encode() for v in value)
        elif field.type == _FD.TYPE_BOOL:
            attr.b = value
        elif field.type in (_FD.TYPE_INT64, _FD.TYPE_INT32):
            attr.i = value
        elif field.type == _FD.TYPE_DOUBLE:
            attr.f = value
        elif field.type == _FD.TYPE_ENUM:
            attr.s = field.enum_type.values_by_number[value].name.encode()
        else:
            attr.s = value.encode()
        entry.parameter_map[field.name].CopyFrom(attr)
    return entry


def with_entry(rewrite_options, entry):
    """Replaces any TfMemOpt entry of `rewrite_options` with `entry` (in place)."""
    kept = [c for c in rewrite_options.custom_optimizers if c.name != PASS_NAME]
    del rewrite_options.custom_optimizers[:]
    rewrite_options.custom_optimizers.extend(kept)
    if entry is not None:
        rewrite_options.custom_optimizers.add().CopyFrom(entry)
    return rewrite_options


def rewriter_config(budget=None, base=None, **fields):
    """A RewriterConfig that runs TfMemOpt after TF's built-in optimizers.

    `base` (a RewriterConfig) is copied first; everything it sets, including
    `memory_optimization`, is kept. Other fields: see make_config().
    """
    if base is not None and not isinstance(base, rewriter_config_pb2.RewriterConfig):
        raise TypeError(
            f"tfmemopt: base={type(base).__name__}; allowed: a tf RewriterConfig or None"
        )
    result = rewriter_config_pb2.RewriterConfig()
    if base is not None:
        result.CopyFrom(base)
        from tfmemopt.explanation import warn_if_meta_optimizer_off

        warn_if_meta_optimizer_off(base)
    return with_entry(result, custom_optimizer_entry(make_config(budget, **fields)))


def config_proto(budget=None, base=None, **fields):
    """A tf.compat.v1.ConfigProto for Sessions, with TfMemOpt enabled.

    `base` (a ConfigProto) is copied first and keeps all its settings.
    """
    if base is not None and not isinstance(base, config_pb2.ConfigProto):
        raise TypeError(
            f"tfmemopt: base={type(base).__name__}; allowed: a tf ConfigProto or None"
        )
    result = config_pb2.ConfigProto()
    if base is not None:
        result.CopyFrom(base)
        from tfmemopt.explanation import warn_if_pruned

        warn_if_pruned(base)
    rewrite = result.graph_options.rewrite_options
    # The base's own checks (above) named its field as a ConfigProto's; building
    # from a fresh RewriterConfig keeps rewriter_config from telling it again.
    with_entry(rewrite, custom_optimizer_entry(make_config(budget, **fields)))
    return result


def schema():
    """The fields as the proto defines them: {name: (type, default, enum names)}."""
    out = {}
    for field in MemoryOptimizerConfig.DESCRIPTOR.fields:
        if _is_repeated(field):
            out[field.name] = ("repeated_string", [], [])
            continue
        type_name = {
            _FD.TYPE_INT64: "int64", _FD.TYPE_INT32: "int32", _FD.TYPE_DOUBLE: "double",
            _FD.TYPE_BOOL: "bool", _FD.TYPE_STRING: "string", _FD.TYPE_ENUM: "enum",
        }[field.type]
        default = field.default_value
        values = []
        if field.type == _FD.TYPE_ENUM:
            values = [v.name for v in field.enum_type.values]
            default = field.enum_type.values_by_number[default].name
        out[field.name] = (type_name, default, values)
    return out
