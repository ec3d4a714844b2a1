"""Putting an AITER release's tree in place, as ``scripts/fetch_aiter.sh`` does, from Python.

A name is a PyPI version of ``amd-aiter`` (``0.1.7.post2.dev18``: its wheel installed
``--no-deps`` into the destination) or a git tag (``v0.1.20.post1``: ``git archive TAG aiter``
of ``$DIFFTEST_AITER_REPO``, a local clone, bare or not, or a URL fetched at depth 1, default
AITER's public repository). The tree goes to ``$DIFFTEST_AITER_ROOT/<name>``
(:func:`difftest.backends.aiter_triton.source_root`), where ``aiter=<name>`` and
``$DIFFTEST_AITER`` find it; a tag's tree gets the ``difftest-aiter-version`` file naming its
version. The setup's wheel (``<venv>/difftest-aiter``) stands for its own version without a
download. :func:`fetch_missing` is what ``difftest bump aiter`` and the history benchmark
call; :class:`AiterFetchError` says what to run elsewhere when a fetch fails.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

from difftest.backends.aiter_triton import (
    VERSION_FILE,
    SourceError,
    resolve,
    source_root,
    wheel_source,
)

REPO_ENV = "DIFFTEST_AITER_REPO"
DEFAULT_REPO = "https://github.com/ROCm/aiter.git"
NAME = re.compile(r"v?\d+\.\d+\.\d+([.-][0-9A-Za-z.]+)?")


class AiterFetchError(RuntimeError):
    """An AITER tree a name asks for is missing and could not be put in place."""


def is_path(spec: str) -> bool:
    """Whether an ``aiter=`` value is a directory rather than a release name."""
    return "/" in spec or spec.startswith(".")


def in_place(spec: str) -> str:
    """The ``aiter=`` value that runs ``spec``: the setup's wheel directory for the wheel's
    own version when no tree of that name is fetched, else ``spec`` itself."""
    wheel = wheel_source()
    if not is_path(spec) and wheel is not None and spec == wheel.version:
        try:
            resolve(spec)
        except SourceError:
            return str(wheel.package.parent)
    return spec


def fetch(name: str) -> Path:
    """Put release ``name`` under :func:`source_root` (nothing when it is there); the
    destination. :class:`AiterFetchError` names the command to run elsewhere on failure."""
    if not NAME.fullmatch(name):
        raise AiterFetchError(f"aiter={name}: a release is an amd-aiter version like "
                              "0.1.7.post2.dev18 or a tag like v0.1.20.post1")
    destination = source_root() / name
    if (destination / "aiter" / "ops" / "triton").is_dir():
        return destination
    partial = destination.with_name(name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        what = _archive_tag(name, partial) if name.startswith("v") else _install(name, partial)
        if not (partial / "aiter" / "ops" / "triton").is_dir():
            raise AiterFetchError(f"aiter={name}: {what} has no aiter/ops/triton")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(destination, ignore_errors=True)
    partial.rename(destination)
    print(f"fetched AITER {what} into {destination}", file=sys.stderr)
    return destination


def _failed(name: str, how: str, said: str) -> AiterFetchError:
    return AiterFetchError(
        f"aiter={name}: {how} failed ({said}); on a machine with network run "
        f"bash scripts/fetch_aiter.sh {name} and copy {source_root() / name} here, or set "
        f"{REPO_ENV} to a local clone of ROCm/aiter")


def _run(command: list[str], name: str, how: str) -> bytes:
    done = subprocess.run(command, capture_output=True, check=False)
    if done.returncode != 0:
        said = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise _failed(name, how, said)
    return done.stdout


def _archive_tag(tag: str, into: Path) -> str:
    """``git archive TAG aiter`` of the repository, unpacked into ``into``."""
    repo = os.environ.get(REPO_ENV) or DEFAULT_REPO
    with tempfile.TemporaryDirectory() as temporary:
        git_dir = repo
        if not Path(repo).is_dir():
            git_dir = temporary
            _run(["git", "init", "-q", "--bare", git_dir], tag, "git init")
            _run(["git", "-C", git_dir, "fetch", "-q", "--depth", "1", repo,
                  f"refs/tags/{tag}:refs/tags/{tag}"], tag, f"fetching tag {tag} of {repo}")
        archive = _run(["git", "-C", git_dir, "archive", "--format=tar", tag, "aiter"], tag,
                       f"git archive {tag} aiter of {repo}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / VERSION_FILE).write_text(tag.removeprefix("v") + "\n")
    return f"tag {tag} of {repo}"


def _install(version: str, into: Path) -> str:
    """``amd-aiter==VERSION`` installed ``--no-deps`` into ``into``."""
    _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
          "--no-deps", "--no-compile", "--target", str(into), f"amd-aiter=={version}"],
         version, f"pip install amd-aiter=={version}")
    return f"amd-aiter {version}"


def fetch_missing(specs: Iterable[str]) -> list[str]:
    """Fetch every release among ``specs`` (names; paths and the setup's wheel version are
    left alone) that does not resolve yet; return the names fetched."""
    fetched = []
    for spec in dict.fromkeys(specs):
        if is_path(in_place(spec)):
            continue
        try:
            resolve(spec)
            continue
        except SourceError:
            pass
        fetch(spec)
        fetched.append(spec)
    return fetched
