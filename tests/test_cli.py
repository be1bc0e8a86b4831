"""The command line: help, usage errors, and the demo end to end."""

import json

from conftest import tfmemopt_cli


def test_no_arguments_prints_help():
    result = tfmemopt_cli()
    assert result.returncode == 0
    assert "usage: tfmemopt" in result.stdout
    assert "demo" in result.stdout and "analyze" in result.stdout


def test_demo_help():
    result = tfmemopt_cli("demo", "--help")
    assert result.returncode == 0
    assert "--cap-mb" in result.stdout and "--batch" in result.stdout and "--blocks" in result.stdout


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
