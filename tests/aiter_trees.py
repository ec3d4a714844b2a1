"""AITER trees for difftest's own tests: the setup's wheel, or a tag put in place from
``$DIFFTEST_AITER_REPO`` (``scripts/fetch_aiter.sh``'s source: CI points it at the shared bare
repository of AITER's tags); a test skips, naming what is missing, where neither is there."""

from __future__ import annotations

import os

import pytest

from difftest.backends.aiter_release import REPO_ENV, AiterFetchError, fetch
from difftest.backends.aiter_triton import AiterSource, SourceError, resolve, wheel_source


def aiter_tree(tag: str) -> AiterSource:
    """The tree of ``tag``: fetched already, else put in place from ``$DIFFTEST_AITER_REPO``;
    a skip naming the command where that variable is unset."""
    try:
        return resolve(tag)
    except SourceError:
        if not os.environ.get(REPO_ENV):
            pytest.skip(f"AITER {tag} is not fetched and ${REPO_ENV} is unset "
                        f"(bash scripts/fetch_aiter.sh {tag})")
    try:
        fetch(tag)
    except AiterFetchError as exc:
        pytest.skip(str(exc))
    return resolve(tag)


def wheel_tree() -> AiterSource:
    """The PyPI wheel ``scripts/setup.sh`` unpacks into ``<venv>/difftest-aiter``, or a skip."""
    wheel = wheel_source()
    if wheel is None:
        pytest.skip("no amd-aiter 0.1.7.post2.dev18 wheel in <venv>/difftest-aiter (bash "
                    "scripts/setup.sh unpacks it where no AITER is installed)")
    return wheel
