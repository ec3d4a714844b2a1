"""Worker processes share the CPU cores instead of each taking all of them."""

from __future__ import annotations

import os

import pytest
import torch

from difftest.machine.devices import share_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_each_of_as_many_processes_as_cores_takes_one_thread(monkeypatch, restore_threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert share_cpu_threads(8) == 1
    assert share_cpu_threads(2) == 4
    assert share_cpu_threads(16) == 1


def test_an_explicit_omp_num_threads_wins(monkeypatch, restore_threads) -> None:
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert share_cpu_threads(64) == 2
