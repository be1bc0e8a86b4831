"""The proto is the one schema: Python and the C++ pass agree on it, and every bad
input is rejected, with the field, the value and what is allowed."""

import json

import pytest
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

import tfmemopt
from tfmemopt import config as tmconfig


def test_cpp_and_python_know_the_same_fields_types_and_defaults():
    cpp = json.loads(tfmemopt._ext.option_schema())
    py = tmconfig.schema()
    assert sorted(cpp) == sorted(py)
    for name, (type_name, default, values) in py.items():
        assert cpp[name]["type"] == type_name, name
        assert cpp[name]["values"] == values, name
        if type_name == "double":
            assert cpp[name]["default"] == pytest.approx(default), name
        else:
            assert cpp[name]["default"] == default, name


def test_issue_fields_are_in_the_schema():
    required = {
        "budget_bytes", "budget_fraction", "mode", "enable_swap", "enable_recompute",
        "enable_schedule", "min_tensor_bytes", "exclude_scopes", "include_scopes",
        "exclude_op_types", "include_op_types", "host_bandwidth_bytes_per_sec",
        "fail_on_infeasible", "log_level",
    }
    assert required <= set(tmconfig.schema())
    assert tmconfig.schema()["mode"][2] == ["AUTO", "ANALYZE_ONLY", "MANUAL"]


@pytest.mark.parametrize(
    "budget, field, value",
    [
        (6 * 2**30, "budget_bytes", 6 * 2**30),
        ("6GiB", "budget_bytes", 6 * 2**30),
        ("512MB", "budget_bytes", 512 * 10**6),
        ("1.5 KiB", "budget_bytes", 1536),
        ("2048", "budget_bytes", 2048),
        (0.5, "budget_fraction", 0.5),
        (1.0, "budget_fraction", 1.0),
    ],
)
def test_budget_forms(budget, field, value):
    config = tfmemopt.make_config(budget)
    assert getattr(config, field) == pytest.approx(value)
    other = {"budget_bytes": "budget_fraction", "budget_fraction": "budget_bytes"}[field]
    assert not config.HasField(other)


def test_config_reaches_parameter_map_by_field_name():
    entry = tmconfig.custom_optimizer_entry(
        tfmemopt.make_config(
            "1GiB", mode="ANALYZE_ONLY", exclude_scopes=["a/", "b/"],
            enable_swap=False, host_bandwidth_bytes_per_sec=1e10,
        )
    )
    assert entry.name == "TfMemOpt"
    params = entry.parameter_map
    assert params["budget_bytes"].i == 2**30
    assert params["mode"].s == b"ANALYZE_ONLY"
    assert list(params["exclude_scopes"].list.s) == [b"a/", b"b/"]
    assert params["enable_swap"].b is False
    assert params["host_bandwidth_bytes_per_sec"].f == pytest.approx(1e10)
    assert "budget_fraction" not in params  # only what was set travels


BAD_INPUTS = [
    # (kwargs, exception, words the message must contain)
    (dict(budget=-1), ValueError, ["budget=-1", "positive"]),
    (dict(budget=0), ValueError, ["budget=0", "positive"]),
    (dict(budget=1.5), ValueError, ["budget=1.5", "(0, 1]"]),
    (dict(budget=0.0), ValueError, ["budget=0.0", "(0, 1]"]),
    (dict(budget="12 parsecs"), ValueError, ["budget='12 parsecs'", "GiB"]),
    (dict(budget="GiB"), ValueError, ["budget='GiB'", "not a size"]),
    (dict(budget="0.5"), ValueError, ["budget='0.5'", "more than 0 bytes", "the float 0.5"]),
    (dict(budget=True), TypeError, ["budget=True", "bool"]),
    (dict(budget=[1]), TypeError, ["budget=[1]", "list"]),
    (dict(bogus_field=1), ValueError, ["'bogus_field'", "allowed fields"]),
    (dict(budget_byte=1), ValueError, ["'budget_byte'", "did you mean 'budget_bytes'"]),
    (dict(min_tensor_bytes=-5), ValueError, ["min_tensor_bytes", "-5", "an int >= 0"]),
    (dict(min_tensor_bytes=1.5), TypeError, ["min_tensor_bytes=1.5", "an int"]),
    (dict(enable_swap="yes"), TypeError, ["enable_swap='yes'", "a bool"]),
    (dict(enable_swap=1), TypeError, ["enable_swap=1", "a bool"]),
    (dict(mode="FAST"), ValueError, ["mode='FAST'", "'AUTO', 'ANALYZE_ONLY', 'MANUAL'"]),
    (dict(mode=7), ValueError, ["mode=7", "'AUTO'"]),
    (dict(mode=None), TypeError, ["mode=None", "'AUTO'"]),
    (dict(log_level=3), ValueError, ["log_level", "3", "0..2"]),
    (dict(budget_fraction=2.0), ValueError, ["budget_fraction", "2", "(0, 1]"]),
    (dict(host_bandwidth_bytes_per_sec=-1.0), ValueError, ["host_bandwidth_bytes_per_sec", ">= 0"]),
    (dict(exclude_scopes=[1, 2]), TypeError, ["exclude_scopes=[1, 2]", "a list of str"]),
    (dict(exclude_scopes=[""]), ValueError, ["exclude_scopes", "non-empty"]),
    (dict(test_only_fail_stage="lunch"), ValueError, ["test_only_fail_stage", "lunch", "\"plan\""]),
    (dict(budget="1GiB", budget_bytes=5), ValueError, ["budget='1GiB'", "budget_bytes=5", "one of them"]),
    (dict(budget_bytes=5, budget_fraction=0.5), ValueError, ["budget_bytes", "budget_fraction", "one of them"]),
]


@pytest.mark.parametrize("kwargs, exc, words", BAD_INPUTS, ids=[str(b[0]) for b in BAD_INPUTS])
def test_bad_input_is_rejected_before_anything_runs(kwargs, exc, words):
    for api in (tfmemopt.enable, tfmemopt.make_config, tfmemopt.config_proto, tfmemopt.rewriter_config):
        with pytest.raises(exc) as info:
            api(**kwargs)
        for word in words:
            assert word in str(info.value), (api.__name__, str(info.value))
    assert tfmemopt.enabled_config() is None  # a failed enable() changed nothing


def test_bad_base_types():
    with pytest.raises(TypeError, match="base=dict"):
        tfmemopt.config_proto(base={})
    with pytest.raises(TypeError, match="base=ConfigProto"):
        tfmemopt.rewriter_config(base=config_pb2.ConfigProto())


def test_config_proto_keeps_what_the_user_set():
    base = config_pb2.ConfigProto(intra_op_parallelism_threads=3)
    rewrite = base.graph_options.rewrite_options
    rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.RECOMPUTATION_HEURISTICS
    rewrite.custom_optimizers.add(name="SomethingElse")
    rewrite.custom_optimizers.add(name="TfMemOpt")  # stale entry is replaced
    result = tfmemopt.config_proto("1GiB", base=base)
    assert result.intra_op_parallelism_threads == 3
    out = result.graph_options.rewrite_options
    assert out.memory_optimization == rewriter_config_pb2.RewriterConfig.RECOMPUTATION_HEURISTICS
    assert [c.name for c in out.custom_optimizers] == ["SomethingElse", "TfMemOpt"]
    assert out.custom_optimizers[1].parameter_map["budget_bytes"].i == 2**30
    # The base itself is not modified.
    assert [c.name for c in base.graph_options.rewrite_options.custom_optimizers] == [
        "SomethingElse", "TfMemOpt"]
    assert not base.graph_options.rewrite_options.custom_optimizers[1].parameter_map


def _entry(**params):
    entry = rewriter_config_pb2.RewriterConfig.CustomGraphOptimizer(name="TfMemOpt")
    for key, attr in params.items():
        entry.parameter_map[key].CopyFrom(attr)
    return entry.SerializeToString()


@pytest.mark.parametrize(
    "params, words",
    [
        ({"bogus": attr_value_pb2.AttrValue(i=1)}, ["unknown parameter_map key 'bogus'", "known keys", "budget_bytes"]),
        ({"budget_bytes": attr_value_pb2.AttrValue(s=b"1GiB")}, ["'budget_bytes'", "string \"1GiB\"", "an int >= 0"]),
        ({"budget_fraction": attr_value_pb2.AttrValue(f=0)}, ["'budget_fraction'", "float 0", "(0, 1]"]),
        ({"mode": attr_value_pb2.AttrValue(s=b"FAST")}, ["'mode'", "\"FAST\"", "\"AUTO\""]),
        ({"recompute_policy": attr_value_pb2.AttrValue(s=b"ALL")}, ["'recompute_policy'", "\"ALL\"", "\"SQRT\""]),
        ({"swapin_lead_ops": attr_value_pb2.AttrValue(i=-1)}, ["'swapin_lead_ops'", "int -1", "0..2147483647"]),
        ({"swapin_lead_ops": attr_value_pb2.AttrValue(i=9), "swapin_lag_ops": attr_value_pb2.AttrValue(i=3)},
         ["'swapin_lead_ops' (9)", "'swapin_lag_ops' (3)", "swapin_lead_ops <= swapin_lag_ops"]),
        ({"enable_swap": attr_value_pb2.AttrValue(i=1)}, ["'enable_swap'", "int 1", "a bool"]),
        ({"budget_bytes": attr_value_pb2.AttrValue(i=1), "budget_fraction": attr_value_pb2.AttrValue(f=0.5)}, ["both set"]),
    ],
)
def test_cpp_rejects_bad_parameter_map(params, words):
    message = tfmemopt._ext.check_custom_optimizer(_entry(**params))
    for word in words:
        assert word in message, message


def test_cpp_accepts_every_valid_field():
    entry = tmconfig.custom_optimizer_entry(tfmemopt.make_config(
        0.5, mode="MANUAL", enable_swap=False, enable_recompute=False,
        enable_schedule=False, enable_split=False, split_batch_statistics=False,
        min_tensor_bytes="4MiB", exclude_scopes=["x/"],
        include_scopes=["y/"], exclude_op_types=["Conv2D"], include_op_types=["Relu"],
        host_bandwidth_bytes_per_sec=8e9, fail_on_infeasible=True, log_level=2,
        assume_batch_size=32, test_only_fail_stage="plan", recompute_policy="SQRT",
        recompute_scopes=["block_3"], max_swapped_tensors=10, swapin_lead_ops=2,
        swapin_lag_ops=8, fuse_swapins=False, assume_trip_count=200, pace_loops=False,
        count_memory_held_outside=False, test_only_hold_bytes=1, allocator_region_bytes=1 << 30,
        observe_allocator=True, model_inter_op_threads=2, test_only_keep_merge_cycles=True,
    ))
    assert set(entry.parameter_map) == set(tmconfig.schema()) - {"budget_bytes"}
    assert tfmemopt._ext.check_custom_optimizer(entry.SerializeToString()) == ""
