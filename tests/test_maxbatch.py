"""find_max_batch, `tfmemopt maxbatch` and the benchmarks built on them: the search
finds where training stops fitting under a capped allocator, one subprocess per trial;
only ResourceExhaustedError counts as "too big"; bad arguments are refused up front."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tfmemopt
from tfmemopt import maxbatch
from tfmemopt.cli import main as cli_main

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
# Under this cap the MLP below trains 256 samples and runs out of memory at 1024
# (measured BFC peaks: 8.5, 14.7 and 23.9 MiB at 1, 2 and 4 units).
CAP_MB = 20


def wide_mlp_step(units, width=2048):
    """make_step: a one-hidden-layer MLP trained by SGD on 256 * units samples. The data
    comes from TF ops, so running out of memory raises ResourceExhaustedError (a
    tf.constant of a NumPy array that does not fit crashes TF instead)."""
    batch = 256 * units
    tf.random.set_seed(0)
    w1 = tf.Variable(tf.random.normal((256, width), stddev=0.05))
    w2 = tf.Variable(tf.random.normal((width, 10), stddev=0.05))
    x = tf.random.uniform((batch, 256))
    y = tf.random.uniform((batch,), maxval=10, dtype=tf.int32)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, [w1, w2])
        for variable, grad in zip([w1, w2], grads):
            variable.assign_sub(0.1 * grad)
        return loss

    return train_step, (x, y)


def step_with_a_bug(batch):
    raise KeyError("layer 'dense_7' not found")


def step_with_numpy_data(mib):
    """Its input is a tf.constant of a NumPy array: TF 2.21 crashes (SIGSEGV) instead of
    raising when that does not fit the cap."""
    import numpy as np

    x = tf.constant(np.ones((mib, 2**18), np.float32))
    return tf.function(lambda x: tf.reduce_sum(x)), (x,)


def test_the_search_finds_the_boundary_between_training_and_oom():
    # ANALYZE_ONLY: the pass reports but never changes the graph, so the boundary is
    # TF's own; the fields and the built-in level must reach every trial.
    result = tfmemopt.find_max_batch(
        wide_mlp_step, 1, 4, cap_mb=CAP_MB, progress=False, mode="ANALYZE_ONLY",
        log_level=0, memory_optimization="NO_MEM_OPT", grappler_log=True)
    ok = [t.size for t in result.trials if t.status == "ok"]
    oom = [t.size for t in result.trials if t.status == "oom"]
    assert sorted(ok + oom) == sorted(t.size for t in result.trials)  # nothing else
    assert 1 in ok and 4 in oom
    assert max(ok) < min(oom)
    assert result.max_batch == max(ok)
    assert result.min_failing_batch == min(oom) == result.max_batch + 1
    assert "OOM when allocating tensor" in result.trial(min(oom)).error

    best = result.trial(result.max_batch)
    assert 0 < best.peak_bytes <= CAP_MB * 2**20
    assert len(best.step_times) == 2 and best.step_seconds == best.step_times[1] > 0
    assert best.report["graph_id"].startswith("__inference_train_step")
    assert best.report["mode"] == "ANALYZE_ONLY"
    assert best.report["devices"][0]["memory_bytes"] == CAP_MB * 2**20
    assert "timeline" not in best.report
    assert best.rewrite_options == {"memory_optimization": "NO_MEM_OPT",
                                    "custom_optimizers": ["TfMemOpt"]}
    step_log = [runs for graph, runs in best.grappler.items()
                if graph.startswith("__inference_train_step")][0]
    names = [line.split(":")[0] for line in step_log]
    assert "TfMemOpt" in names and "memory_optimizer" not in names


def test_an_error_that_is_not_oom_stops_the_search_and_says_what_it_was():
    with pytest.raises(tfmemopt.TrialError) as info:
        tfmemopt.find_max_batch(step_with_a_bug, 1, 64, cap_mb=CAP_MB, progress=False,
                                use_tfmemopt=False)
    trial = info.value.trial
    assert trial.size == 1 and trial.status == "error"
    assert trial.error.startswith("KeyError: \"layer 'dense_7' not found\"")
    assert "step_with_a_bug" in trial.error  # the traceback
    assert "failed with error, not out of memory" in str(info.value)
    assert info.value.result.trials == [trial]
    assert info.value.result.max_batch is None and info.value.result.min_failing_batch is None


def test_a_crash_right_after_tf_ran_out_of_memory_counts_as_oom():
    trial = maxbatch.run_trial(step_with_numpy_data, 2 * CAP_MB, cap_mb=CAP_MB,
                               use_tfmemopt=False)
    assert trial.status == "oom"
    assert "ran out of memory trying to allocate" in trial.error
    assert "then the process died with exit code -11 (signal 11)" in trial.error


def test_any_other_death_of_the_trial_is_an_error():
    allocator = ("W0000 00:00:1795376045.472949    8665 bfc_allocator.cc:502] Allocator "
                 "(bfc_cpu_allocator_for_gpu) ran out of memory trying to allocate 32.00MiB")
    died = maxbatch._died(8, 1.0, None, -11, "WARNING: something\n" + allocator + "\n")
    assert died.status == "oom" and died.error.startswith("Allocator (bfc_cpu_allocator_for_gpu)")
    died = maxbatch._died(8, 1.0, None, -6, "F0000 check_op.h:42] Check failed: x == y\n")
    assert died.status == "error"
    assert died.error.startswith("the trial's interpreter exited with code -6 (signal 6) "
                                 "without a result; stderr: F0000 check_op.h:42] Check failed")


def _nested():
    def make_step(batch):
        return None
    return make_step


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(lo=5, hi=2), ValueError, "hi=2 is below lo=5; allowed: 1 <= lo <= hi"),
    (dict(lo=0, hi=2), ValueError, "lo=0; allowed: an int >= 1"),
    (dict(lo=1.5, hi=2), TypeError, "lo=1.5 has type float; allowed: an int >= 1"),
    (dict(cap_mb=0), ValueError, "cap_mb=0; allowed: an int >= 1"),
    (dict(steps=0), ValueError, "steps=0; allowed: an int >= 1"),
    (dict(timeout=-1), ValueError, "timeout=-1; allowed: seconds > 0, or None"),
    (dict(strategy="linear"), ValueError, "strategy='linear'; allowed: 'bisect', 'grow'"),
    (dict(memory_optimization="FAST"), ValueError,
     "memory_optimization='FAST'; allowed: None or one of DEFAULT_MEM_OPT, NO_MEM_OPT"),
    (dict(budget_byte=1), ValueError, "unknown field 'budget_byte' (did you mean 'budget_bytes'?)"),
    (dict(enable_swap="no"), TypeError, "enable_swap='no' has type str; allowed: a bool"),
    (dict(function_retries=-1), ValueError, "function_retries=-1; allowed: an int >= 0"),
    (dict(fit_retries=True), ValueError, "fit_retries=True; allowed: an int >= 0"),
    (dict(reserve_memory=1), ValueError, "reserve_memory=1; allowed: True or False"),
    (dict(use_tfmemopt=False, enable_swap=False), ValueError,
     "use_tfmemopt=False with fields enable_swap; allowed: fields only with use_tfmemopt=True"),
    (dict(step_kwargs={"width": object()}), TypeError, "must be JSON values"),
    (dict(make_step=lambda batch: None), TypeError, "cannot be imported by a fresh interpreter"),
    (dict(make_step=_nested()), TypeError, "cannot be imported by a fresh interpreter"),
    (dict(make_step=42), TypeError, "make_step=42 has type int"),
    (dict(make_step="no/such/script.py"), ValueError, "no such file"),
    (dict(make_step=__file__ + ":no_such_function"), ValueError,
     "defines no top-level 'no_such_function'"),
])
def test_bad_arguments_are_refused_before_anything_runs(kwargs, error, message):
    args = dict(make_step=wide_mlp_step, lo=1, hi=4, cap_mb=CAP_MB, progress=False)
    args.update(kwargs)
    with pytest.raises(error) as info:
        tfmemopt.find_max_batch(**args)
    assert message in str(info.value)


def test_a_script_reference_names_a_file_and_its_function(tmp_path):
    script = tmp_path / "my_model.py"
    script.write_text("def make_step(batch):\n    pass\n")
    assert maxbatch.step_reference(str(script)) == {
        "module": None, "qualname": "make_step", "file": str(script)}
    assert maxbatch.step_reference(f"{script}:make_step")["qualname"] == "make_step"
    assert maxbatch.step_reference(wide_mlp_step) == {
        "module": __name__, "qualname": "wide_mlp_step", "file": os.path.abspath(__file__)}
    (tmp_path / "broken.py").write_text("def make_step(batch)\n")
    with pytest.raises(ValueError, match=r"broken.py is not valid Python \(line 1\)"):
        maxbatch.step_reference(str(tmp_path / "broken.py"))


def test_cli_maxbatch_help(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["maxbatch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("SCRIPT", "--lo", "--hi", "--cap-mb", "--budget", "--json", "--no-baseline"):
        assert option in out
    assert "make_step(batch)" in out


def test_cli_maxbatch_bad_script_exits_2_with_one_line(capsys, tmp_path):
    assert cli_main(["maxbatch", str(tmp_path / "nosuch.py")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"tfmemopt maxbatch: make_step script {tmp_path / 'nosuch.py'}: "
                          f"no such file; allowed: a Python script that defines make_step")
    script = tmp_path / "empty.py"
    script.write_text("import tensorflow\n")
    assert cli_main(["maxbatch", str(script)]) == 2
    assert "defines no top-level 'make_step'" in capsys.readouterr().err
    script.write_text("def make_step(batch):\n    pass\n")
    assert cli_main(["maxbatch", str(script), "--lo", "8", "--hi", "4"]) == 2
    assert capsys.readouterr().err == ("tfmemopt maxbatch: --hi 4 is below --lo 8; "
                                       "expected 1 <= lo <= hi\n")
    assert cli_main(["maxbatch", str(script), "--budget", "2.0"]) == 2
    assert capsys.readouterr().err.startswith(
        "tfmemopt maxbatch: --budget 2.0: budget=2.0 is a float, i.e. a fraction of device "
        "memory, and must be in (0, 1]")


def test_deep_resnet_quick_json_is_the_last_line(tmp_path):
    plot = tmp_path / "peak_vs_depth.png"
    # Through the CLI, as a user runs it: `tfmemopt bench deep_resnet ARGS...`.
    proc = subprocess.run(
        [sys.executable, "-m", "tfmemopt", "bench", "--dir", BENCHMARKS, "deep_resnet",
         "--quick", "--json", "--plot", str(plot)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    searches = data["searches"]
    assert data["max_depth_baseline"] == searches["baseline"]["max_batch"]
    assert data["max_depth_tfmemopt"] == searches["tfmemopt"]["max_batch"]
    assert data["max_depth_auto"] == searches["auto"]["max_batch"]
    assert isinstance(data["max_depth_baseline"], int)
    assert isinstance(data["overhead_at_baseline_max"], float)
    assert isinstance(data["overhead_auto"], float)
    assert data["timed_size"] == data["max_depth_baseline"]
    for name in ("baseline", "tfmemopt", "auto"):
        trials = searches[name]["trials"]
        ok = [t["size"] for t in trials if t["status"] == "ok"]
        oom = [t["size"] for t in trials if t["status"] == "oom"]
        assert len(ok) + len(oom) == len(trials) and (not oom or max(ok) < min(oom))
        assert len(data["timing"][name]["step_times"]) == data["settings"]["rounds"]
    # The pass ran (and reported) only in the tfmemopt configurations.
    assert all("report" in t for t in searches["tfmemopt"]["trials"] + searches["auto"]["trials"])
    assert not any("report" in t for t in searches["baseline"]["trials"])
    assert plot.stat().st_size > 0
    assert "largest depth baseline" in proc.stdout


def test_timing_falls_back_to_smaller_sizes_each_below_the_last():
    from tfmemopt.maxbatch import MaxBatchResult, Trial, timing_sizes

    def search(ok_sizes, oom_sizes):
        trials = [Trial(size=s, status="ok") for s in ok_sizes]
        trials += [Trial(size=s, status="oom") for s in oom_sizes]
        return MaxBatchResult(max(ok_sizes, default=None), min(oom_sizes, default=None),
                              trials, lo=1, hi=256, cap_mb=None, config={}, seconds=0.0)

    # ResNet-50's search: 96 and 97 trained, 98 did not, and the timings at 97 and 96
    # both ran out of memory: the fall-back goes on below the search's trained sizes.
    assert timing_sizes(search([96, 97], [98, 192])) == [97, 96, 92, 87]
    # compare()'s eight attempts reach 0.65x (ResNet-50's plain baseline trained two
    # steps at 101 and ran out of memory when timed at 101, 100, 95 and 90).
    assert timing_sizes(search([96, 97], [98, 192]), attempts=8) == [
        97, 96, 92, 87, 82, 77, 72, 67]
    # A doubling search: the next trained size is far below; nearer sizes come first.
    assert timing_sizes(search([10, 20, 40], [80])) == [40, 38, 36, 34]
    assert timing_sizes(search([], [4])) == []
    assert timing_sizes(search([1], [2])) == [1]
