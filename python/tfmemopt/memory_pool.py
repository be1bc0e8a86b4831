"""Reserving the CPU test bed's BFC pool (docs/allocator.md#reserving-the-pool).

TF's BFC allocator grows in regions of 2 MiB, 4 MiB, 8 MiB, ... when it may grow, and a
tensor must fit in one free chunk of one region, so a step whose live bytes fit can
still be refused one large tensor. The CPU test bed (TF_CPU_ALLOCATOR_USE_BFC=true)
always grows. tfmemopt.enable(reserve_memory=True) reserves its pool before the first
step: the small regions growth starts with, then the rest of the limit as one region,
close to the layout a GPU has without memory growth (TF's default), and tells the
pass (the config field allocator_region_bytes), whose allocator model then places
the step in that layout.
"""

import threading

from tfmemopt._loader import load_extension

_ext = load_extension()

# Less than this still free for regions is not worth a reservation: the pool's own
# growth makes regions of that size.
MIN_REGION_BYTES = 64 << 20

_lock = threading.Lock()
_reservation = None  # the first reservation made in this process (dict)


def reserve_cpu_pool():
    """Reserves the CPU BFC allocator's pool, once per process: in an empty pool the
    2, 4, ... MiB regions growth starts with (up to an eighth of the limit), then what
    the limit still allows as one region. Returns a dict: region_bytes (the large
    region; 0 when nothing was reserved, then `reason` says why), limit_bytes,
    pool_bytes. Touches no page of the regions and does not initialize TF's eager
    context (safe before any other TF call); the allocator's peak
    (tf.config.experimental.get_memory_info) does not count it.
    """
    global _reservation
    with _lock:
        if _reservation is not None and _reservation["region_bytes"] > 0:
            return dict(_reservation)
        result = dict(_ext.reserve_cpu_pool(MIN_REGION_BYTES))
        if result["region_bytes"] > 0:
            _reservation = result
        return result


def reserved_region_bytes():
    """The region reserve_cpu_pool() made in this process, in bytes (0: none)."""
    return _reservation["region_bytes"] if _reservation else 0
