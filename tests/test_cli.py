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
    assert "--cap-mb" in result.stdout and "--batch" in result.stdout


def test_bad_usage_exits_2_with_a_message():
    result = tfmemopt_cli("demo", "--batch", "0")
    assert result.returncode == 2
    assert "--batch must be a positive integer, got 0" in result.stderr
    result = tfmemopt_cli("nonsense")
    assert result.returncode == 2
    assert "invalid choice: 'nonsense'" in result.stderr


def test_demo_trains_with_and_without_the_pass_and_reports():
    result = tfmemopt_cli("demo", "--batch", "64", "--cap-mb", "512", "--steps", "2", "--json")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    without, with_opt = data["without"], data["with"]
    assert without["ok"] and with_opt["ok"]
    assert without["losses"] == with_opt["losses"]
    report = with_opt["report"]
    assert report["status"] == "ok"
    device = report["devices"][0]
    assert device["memory_source"] == "TF_CPU_BFC_MEM_LIMIT_IN_MB"
    assert device["memory_bytes"] == 512 * 2**20
    assert device["budget_bytes"] == int(0.9 * 512 * 2**20)
    assert with_opt["measured_peak_bytes"] > 0
    assert "predicted peak" in result.stdout and "bitwise equal" in result.stdout
