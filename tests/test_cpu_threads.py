"""Threads per rank: a setting or OMP_NUM_THREADS wins; otherwise the cores idle now, shared by
the local ranks, so a busy machine does not stall a run's OpenMP threads."""

import pytest

from meshtrain.operations import cpu_threads


@pytest.mark.parametrize("cores,busy,ranks,threads", [
    (2, 0.0, 1, 2), (2, 1.0, 1, 1), (2, 0.3, 1, 2), (2, 1.9, 1, 1), (16, 0.0, 8, 2),
    (16, 4.2, 4, 3), (16, 15.0, 4, 1), (4, 0.0, 8, 1)])
def test_the_idle_cores_are_shared_by_the_local_ranks(monkeypatch, cores, busy, ranks, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: busy)
    assert cpu_threads.threads_per_rank(ranks) == threads


def test_a_setting_then_omp_num_threads_win(monkeypatch):
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: pytest.fail("sampled"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.threads_per_rank(2) == 3
    assert cpu_threads.threads_per_rank(2, setting=5) == 5


def test_busy_cores_reads_this_machine():
    busy = cpu_threads.busy_cores()
    assert 0.0 <= busy <= (cpu_threads.os.cpu_count() or 1)
