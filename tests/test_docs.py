"""The README's configuration reference is the one tools/gen_config_reference.py
renders from protos/rewriter_config_ext.proto, and that tool reads the proto as
protoc does."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import tfmemopt.config

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gen_config_reference.py"
PROTO = ROOT / "protos" / "rewriter_config_ext.proto"
README = ROOT / "README.md"


def load_tool():
    spec = importlib.util.spec_from_file_location("gen_config_reference", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_tool()


def test_the_readme_table_is_the_one_generated_from_the_proto():
    readme = README.read_text()
    start = readme.index(gen.BEGIN) + len(gen.BEGIN) + 1
    end = readme.index(gen.END)
    assert readme[start:end] == gen.render(PROTO.read_text()), (
        "README.md's configuration table is stale: run python tools/gen_config_reference.py")


def test_the_table_has_one_row_per_field_group_and_every_field():
    table = gen.render(PROTO.read_text())
    for name in tfmemopt.MemoryOptimizerConfig.DESCRIPTOR.fields_by_name:
        assert f"`{name}`" in table
    assert "| `enable_swap`, `enable_recompute`, `enable_schedule` | bool | `true` |" in table
    assert "| `mode` | enum | `AUTO` | `AUTO`: Plan within the budget" in table


def value_of(field):
    """The parsed default as the Python value the descriptor holds."""
    text = field["default"]
    if field["repeated"]:
        return [] if text == "[]" else None
    if field["enum_values"]:
        return text
    if field["type"] == "bool":
        return {"true": True, "false": False}[text]
    if field["type"] == "string":
        return text[1:-1]
    return float(text) if field["type"] == "double" else int(text)


def test_the_parse_agrees_with_the_descriptor_protoc_built():
    # tfmemopt.config.schema() reads the descriptor set that the build made with protoc.
    schema = tfmemopt.config.schema()
    fields = gen.parse(PROTO.read_text())
    assert [f["name"] for f in fields] == list(schema)
    for field in fields:
        type_name, default, enum_values = schema[field["name"]]
        if field["repeated"]:
            assert type_name == "repeated_" + field["type"]
        elif enum_values:
            assert type_name == "enum"
        else:
            assert field["type"] == type_name
        assert [v for v, _ in field["enum_values"]] == enum_values, field["name"]
        assert value_of(field) == default, field["name"]


def test_check_mode_fails_on_a_stale_readme_and_the_tool_fixes_it(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(README, readme)
    readme.write_text(readme.read_text().replace("| `budget_bytes` | int64 | `0` |",
                                                 "| `budget_bytes` | int64 | `7` |"))

    def run(*args):
        return subprocess.run([sys.executable, str(TOOL), "--readme", str(readme), *args],
                              capture_output=True, text=True)

    stale = run("--check")
    assert stale.returncode == 1
    assert "configuration table differs" in stale.stderr
    assert run().returncode == 0
    assert run("--check").returncode == 0
    assert readme.read_text() == README.read_text()
