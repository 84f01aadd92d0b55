"""The CPU's default thread count: every physical core on an idle machine, less one for each whole unit of the
load average at start-up (other work's runnable threads), at least one."""

from __future__ import annotations

import os

import pytest

from hybridkv.engine.runtime import cpu_threads, default_cpu_threads, physical_cores


@pytest.mark.parametrize(("cores", "load", "threads"), [
    (2, 0.0, 2), (2, 0.6, 2), (2, 1.0, 1), (2, 1.3, 1), (2, 3.0, 1), (8, 2.5, 6), (8, 0.99, 8), (1, 0.0, 1),
])
def test_the_default_takes_the_cores_the_load_average_leaves(cores, load, threads):
    assert default_cpu_threads(cores, load) == threads


def test_an_asked_count_is_kept_and_a_negative_one_refused():
    assert cpu_threads(3) == 3
    with pytest.raises(ValueError, match="cpu_threads must be >= 0"):
        cpu_threads(-1)


def test_the_default_is_within_the_physical_cores_this_process_may_use():
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert 1 <= cpu_threads(0) <= cores
