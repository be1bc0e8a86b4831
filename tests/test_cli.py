"""The command line: help, usage errors, and the demo end to end."""

import json
import os

import pytest

from conftest import tfmemopt_cli

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def test_no_arguments_prints_help():
    result = tfmemopt_cli()
    assert result.returncode == 0
    assert "usage: tfmemopt" in result.stdout
    for command in ("demo", "analyze", "maxbatch", "bench"):
        assert command in result.stdout


def test_demo_help():
    result = tfmemopt_cli("demo", "--help")
    assert result.returncode == 0
    assert "--cap-mb" in result.stdout and "--batch" in result.stdout and "--blocks" in result.stdout


@pytest.mark.parametrize("command", ["demo", "analyze", "maxbatch", "bench"])
def test_every_subcommand_has_help_with_its_exit_codes(command):
    result = tfmemopt_cli(command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: tfmemopt {command}")
    assert "Exit codes:" in result.stdout or command == "demo"


def test_bench_lists_the_benchmarks_and_refuses_an_unknown_one():
    result = tfmemopt_cli("bench", "--dir", BENCHMARKS, "--list")
    assert result.returncode == 0
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert {"deep_resnet", "resnet50_lms", "seed000", "plan_time", "peak_accuracy",
            "stress"} <= set(names)
    assert "models" not in names  # a helper module, not a benchmark
    result = tfmemopt_cli("bench", "--dir", BENCHMARKS, "deep_resnt")
    assert result.returncode == 2
    assert "no benchmark 'deep_resnt' in " in result.stderr and "did you mean 'deep_resnet'?" in \
        result.stderr
    result = tfmemopt_cli("bench", "--dir", "/nonexistent", "stress")
    assert result.returncode == 2 and "--dir /nonexistent: no such directory" in result.stderr


def test_bad_usage_exits_2_with_a_message():
    result = tfmemopt_cli("demo", "--batch", "0")
    assert result.returncode == 2
    assert "--batch must be a positive integer, got 0" in result.stderr
    result = tfmemopt_cli("nonsense")
    assert result.returncode == 2
    assert "invalid choice: 'nonsense'" in result.stderr


def test_demo_runs_out_of_memory_without_the_pass_and_trains_bitwise_equal_with_it():
    result = tfmemopt_cli("demo", "--blocks", "4", "--batch", "64", "--cap-mb", "40", "--json")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    without, mine, reference = data["without"], data["with"], data["reference"]
    assert without["status"] == "oom"
    assert mine["status"] == "ok" and reference["status"] == "ok"
    assert len(mine["outputs"]) == 3 and mine["outputs"] == reference["outputs"]
    # The uncapped reference run's peak moves with the executor's parallel order (it has
    # landed on exactly 40 MiB), so the OOM above is the proof that the cap is too small.
    assert mine["peak_bytes"] <= 40 * 2**20
    report = mine["report"]
    assert report["graph_changed"]
    assert report["predicted_peak_after_bytes"]["CPU:0"] <= int(0.9 * 40 * 2**20)
    assert "ran out of memory" in result.stdout and "bitwise equal" in result.stdout
