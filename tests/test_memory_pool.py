"""Reserving the CPU test bed's BFC pool as one region (tfmemopt.memory_pool).

With allow_growth, which the test bed always has, BFC's pool is regions of 2 MiB,
4 MiB, ... that a tensor cannot straddle: seed000's CNN runs out of memory at batch
1821 under a 1024 MiB cap with its peak far below the cap (test_memory_model.py).
tfmemopt.enable(reserve_memory=True) reserves the rest of the limit as one region, the
layout of a GPU without memory growth, and plans for it (allocator_region_bytes).
"""

import json
import os
import subprocess
import sys

from conftest import BENCHMARKS, capped_allocator_env, run_python, subprocess_result

MIB = 2**20


def reserved_region_mib(limit_mib):
    """The large region reserve_cpu_pool() makes in an empty pool: the limit less the
    regions growth starts with (2, 4, ... MiB) up to an eighth of it."""
    small, size = 0, 2
    while small + size <= limit_mib / 8:
        small, size = small + size, size * 2
    return limit_mib - small


def test_a_reserved_pool_holds_three_tensors_that_the_growing_pool_cannot():
    # 3 x 290 MiB = 870 MiB under a 1024 MiB cap: the growing pool's largest regions
    # (512 and 256 MiB) hold two; the reserved region (898 MiB, the rest in the 2 to
    # 64 MiB regions growth starts with) holds all three.
    held = {}
    for flag in ([], ["--reserve"]):
        proc = subprocess.run(
            [sys.executable, f"{BENCHMARKS}/bfc_regions.py", "--cap-mb", "1024", "--count",
             "3", "--mib", "290", "--json", *flag], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["reserve"] == bool(flag)
        held[bool(flag)] = result["trials"][0]["held"]
    assert held == {False: 2, True: 3}


_ENABLE_CODE = r"""
import json, sys
import tfmemopt
config = tfmemopt.enable(enable_split=False, reserve_memory=True)
import tensorflow as tf
# Setup calls that must precede TF's start still work: the reservation does not start it.
tf.config.threading.set_inter_op_parallelism_threads(2)
out = {"region": config.allocator_region_bytes, "again": tfmemopt.memory_pool.reserve_cpu_pool(),
       "later_config": tfmemopt.make_config(0.5).allocator_region_bytes,
       "peak_after_reserving": tf.config.experimental.get_memory_info("CPU:0")["peak"]}
sys.path.insert(0, sys.argv[1])
import models
step, (x, y) = models.seed_cnn(int(sys.argv[2]))
out["losses"] = [float(step(x, y)) for _ in range(2)]
report = [r for r in tfmemopt.reports() if r.graph_changed or r.num_nodes > 100][-1]
device = report.to_dict()["devices"][0]
out.update(refused=device["allocator_refused_bytes"], fits=report.fits,
           split=report.split.get("slices", 0), text=report.to_text(),
           region_in_report=device["allocator_region_bytes"])
print("RESULT " + json.dumps(out))
"""

_PLAIN_CODE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import models
step, (x, y) = models.seed_cnn(int(sys.argv[2]))
print("RESULT " + json.dumps({"losses": [float(step(x, y)) for _ in range(2)]}))
"""


def test_enable_reserves_the_pool_and_seed_cnn_trains_past_the_region_limit_with_ops_whole():
    # Batch 2000 needs three 281.25 MiB tensors at once (the max-pool gradient's
    # inputs and output): no growing pool under 1024 MiB holds them, whatever is
    # swapped or recomputed, and splitting is off here. In the reserved region they fit.
    batch = 2000
    proc = run_python(_ENABLE_CODE, BENCHMARKS, batch,
                      env=capped_allocator_env(1024, TF_CPP_MIN_LOG_LEVEL="2"), timeout=900)
    result = subprocess_result(proc)
    # The large region, after the regions growth starts with (2 + 4 + ... + 64 MiB).
    region = reserved_region_mib(1024) * MIB
    assert region == 898 * MIB
    assert result["region"] == region
    # Reserving is once per process; TF's peak does not count the reservation.
    assert result["again"]["region_bytes"] == region
    # Every config built afterwards in the process (analyze(), tfmemopt.function, the
    # Keras callback) plans for the reserved region too.
    assert result["later_config"] == region
    assert result["peak_after_reserving"] == 0
    assert result["region_in_report"] == region
    assert result["refused"] == 0 and result["fits"] and result["split"] == 0
    assert "its pool holds one region of 898.00 MiB" in result["text"]
    # The same losses as plain TF without a cap, to the bit.
    plain = subprocess_result(run_python(_PLAIN_CODE, BENCHMARKS, batch, timeout=900))
    assert result["losses"] == plain["losses"]


def test_the_growing_pool_still_refuses_it_without_the_reservation():
    # The counterpart, by default: enable() leaves the pool to grow, and the model
    # refuses the max-pool gradient's tensor at batch 2000 (splitting off).
    code = r"""
import json, sys
import tfmemopt
config = tfmemopt.enable(enable_split=False)
sys.path.insert(0, sys.argv[1])
import models
step, (x, y) = models.seed_cnn(2000)
report = tfmemopt.analyze(step, x, y, log_level=0, enable_split=False)
device = report.to_dict()["devices"][0]
print("RESULT " + json.dumps({"has_region": config.HasField("allocator_region_bytes"),
      "refused": device["allocator_refused_bytes"], "fits": report.fits}))
"""
    result = subprocess_result(run_python(
        code, BENCHMARKS, env=capped_allocator_env(1024, TF_CPP_MIN_LOG_LEVEL="2")))
    assert not result["has_region"]
    assert result["refused"] == 2000 * 24 * 24 * 64 * 4 and result["fits"] is False


def test_reserve_memory_is_checked_and_does_nothing_without_a_bfc_allocator():
    code = r"""
import json
import tfmemopt
try:
    tfmemopt.enable(reserve_memory="yes")
    error = ""
except ValueError as e:
    error = str(e)
config = tfmemopt.enable()
print("RESULT " + json.dumps({"error": error, "has_region": config.HasField("allocator_region_bytes"),
      "reservation": tfmemopt.memory_pool.reserve_cpu_pool()}))
"""
    result = subprocess_result(run_python(code, env={"TF_CPP_MIN_LOG_LEVEL": "2"}))
    assert result["error"] == "tfmemopt.enable: reserve_memory='yes'; allowed: True or False"
    assert not result["has_region"]
    assert result["reservation"]["region_bytes"] == 0
    assert "not BFC" in result["reservation"]["reason"]
    # BFC without a cap: its 64 GiB default limit is not reserved (nor tried, which
    # would log an out-of-memory dump).
    proc = run_python(code, env={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "1"})
    result = subprocess_result(proc)
    assert "ran out of memory" not in proc.stderr
    if os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 64 * 1024 * MIB:
        assert not result["has_region"] and result["reservation"]["region_bytes"] == 0
        assert "above the host's RAM" in result["reservation"]["reason"]
    else:  # a host with more RAM than the default limit reserves all of it
        assert result["reservation"]["region_bytes"] == reserved_region_mib(64 * 1024) * MIB
