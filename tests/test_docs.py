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


# --- every command in the docs exists; every result table is its file's ------------

import argparse  # noqa: E402
import re  # noqa: E402

DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(
    r"(?:python (?:-m tfmemopt|(?:benchmarks|tools)/\w+\.py)"
    r"|(?<![\w/.-])tfmemopt (?:analyze|maxbatch|bench|demo)(?!:))[^`\n]*")


class _Captured(Exception):
    pass


def _parser_of_script(path):
    """The ArgumentParser a script's main() builds, without running the script."""
    source = path.read_text()
    if "def main(" not in source:
        return None  # a script that reads sys.argv itself: only its existence is checked
    spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    original = argparse.ArgumentParser.parse_args
    try:
        spec.loader.exec_module(module)

        def capture(self, *args, **kwargs):
            raise _Captured(self)

        argparse.ArgumentParser.parse_args = capture
        try:
            module.main()
        except _Captured as captured:
            return captured.args[0]
        raise AssertionError(f"{path}: main() did not parse arguments")
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.path.remove(str(path.parent))


def _options(parser, words):
    """Option strings a command may use: the parser's, and those of the subcommand
    named in `words`."""
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in words:
                if word in action.choices:
                    options |= _options(action.choices[word], [])
    return options


def documented_commands():
    found = []
    for path in DOC_FILES:
        for match in _COMMAND.finditer(path.read_text()):
            found.append((path.relative_to(ROOT), match.group(0).strip()))
    return found


def test_the_docs_show_commands():
    files = {str(path) for path, _ in documented_commands()}
    assert {"README.md", "docs/benchmarks.md", "docs/usage.md"} <= files


def test_every_documented_command_exists_and_its_flags_parse():
    from tfmemopt import cli

    parsers, problems = {}, []
    for path, command in documented_commands():
        words = command.split()
        if words[0] == "python" and words[1] == "-m":
            parser, rest = cli.build_parser(), words[3:]
        elif words[0] == "tfmemopt":
            parser, rest = cli.build_parser(), words[1:]
        else:
            script = ROOT / words[1]
            if not script.exists():
                problems.append(f"{path}: `{command}`: no file {words[1]}")
                continue
            if script not in parsers:
                parsers[script] = _parser_of_script(script)
            parser, rest = parsers[script], words[2:]
        if parser is None:
            continue
        known = _options(parser, rest)
        for word in rest:
            flag = word.split("=")[0].strip("[]")
            if flag.startswith("--") and flag not in known:
                problems.append(f"{path}: `{command}`: {flag} is not an option of it")
    assert not problems, "\n".join(problems)


def test_every_result_table_is_the_one_its_file_gives():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _gen_docs():
    """tools/gen_docs.py as a module."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    return gen_docs


def test_a_stale_result_table_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    gen_docs = _gen_docs()
    doc.write_text("<!-- results:plan_time -->\n| a typed figure |\n<!-- /results:plan_time -->\n")
    assert gen_docs.main(["--check", str(doc)]) == 1
    assert gen_docs.main([str(doc)]) == 0
    assert gen_docs.main(["--check", str(doc)]) == 0
    assert "| a typed figure |" not in doc.read_text()


def test_a_result_names_the_cpu_and_whether_onednn_ran():
    # Memory figures depend on the kernels: TF turns oneDNN on by the CPU's features.
    gen_docs = _gen_docs()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results
    finally:
        sys.path.pop(0)
    machine = results.machine()
    assert machine["cpu"] and isinstance(machine["onednn"], bool), machine
    record = {"command": "python benchmarks/x.py", "commit": "abc1234", "date": "2026-12-01",
              "machine": dict(machine, cpu="Some CPU", onednn=False)}
    assert ", on Some CPU with oneDNN off," in gen_docs.source(record)
    del record["machine"]["onednn"]
    assert "oneDNN" not in gen_docs.source(record)


def test_readme_stays_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    assert lines[3].startswith("python3 -m venv .venv") and "tfmemopt demo" in lines[3]
    assert lines[4].startswith("python3 -m venv .venv") and "pytest -q -n 2 tests" in lines[4]
