"""Project conftest: the difftest plugin itself is loaded through its pytest11 entry point."""

from __future__ import annotations

import pytest

from difftest.session import Session


@pytest.fixture(scope="session")
def device_name(difftest_session: Session) -> str:
    """The device this test process runs kernels on (``cpu`` or ``cuda``).

    Tests that start a CLI run or a session in-process pass it on instead of ``cpu``: the CPU
    runtime (``TRITON_INTERPRET=1``, no visible CUDA device) lasts for the whole process, so
    a GPU worker that prepared it once would interpret every later kernel.
    """
    return difftest_session.device.type
