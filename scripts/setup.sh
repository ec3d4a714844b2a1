#!/usr/bin/env bash
# Set up the venv for difftest, reusing whatever torch, Triton, vLLM and AITER the machine has.
#
#   bash scripts/setup.sh          the main job's needs (difftest run): torch, triton, vLLM and
#                                  the small packages they and difftest import
#   bash scripts/setup.sh --test   those plus the test tools: pytest (required), pytest-xdist,
#                                  ruff, matplotlib and jsonschema (skipped when offline and
#                                  missing)
#
# Every requirement is looked up in the venv's python first and installed only when missing;
# one summary line says what was reused and what was installed. On ROCm/CUDA runner images
# torch, vLLM and AITER come preinstalled: the venv sees them (--system-site-packages, or
# exactly the site directories of the given python where that is itself a venv) and pip is
# constrained to their versions, so it never replaces them.
# On a bare machine it installs the CPU build of torch 2.13.0, triton 3.8.0 (the interpreter
# version that runs vLLM's kernels, docs/findings.md F2) and vLLM 0.33.0's sources without its
# serving dependencies. Never installs the PyPI package "aiter" (an unrelated project).
# Offline (PIP_NO_INDEX=1) it succeeds when the needs are present, installing nothing.
# Where vLLM was already there (an image's, installed without its serving dependencies), it
# checks that vLLM's MiniMax-M3 kernel modules import and names the backends left unavailable.
#
# Environment: PYTHON (the interpreter the venv is made from, default python3), DIFFTEST_VENV
# (the venv directory, default .venv in the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DIFFTEST_VENV:-.venv}
case "${1:-}" in
  "") GROUPS_WANTED=runtime ;;
  --test) GROUPS_WANTED=runtime,test ;;
  *) echo "setup: unknown argument '$1' (allowed: none, or --test)" >&2; exit 2 ;;
esac

VENV_NOTE=""
if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    # The site directories of a python that is itself a venv (an image built as one): a new
    # venv made from it would see its base interpreter's packages instead, not its own.
    parents=$("$PYTHON" -c "import os, sys
if sys.prefix != sys.base_prefix:
    print(repr([p for p in sys.path if os.path.basename(p) in ('site-packages', 'dist-packages')]))")
    # Without pip of its own: the venv uses the image's pip and setuptools, which a bundled
    # older copy (Python <= 3.11) would shadow, making setup want a download.
    if [ -n "$parents" ]; then
      # Exactly that venv's view: its site directories in its order (processing their .pth
      # files, so editable installs such as an AITER checkout stay visible), and none of its
      # base interpreter's unless it sees them itself.
      "$PYTHON" -m venv --without-pip "$VENV"
      purelib=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
      echo "import site; list(map(site.addsitedir, $parents))" \
        > "$purelib/_difftest_parent_env.pth"
    else
      "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
    fi
    "$VENV/bin/python" -c "import pip" >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip -q
    VENV_NOTE="new $VENV over the packages of $PYTHON"
  else
    "$PYTHON" -m venv "$VENV"
    VENV_NOTE="new $VENV"
  fi
fi

GROUPS_WANTED=$GROUPS_WANTED VENV_NOTE=$VENV_NOTE exec "$VENV/bin/python" - <<'PY'
"""Install what the venv lacks, then the project (editable), and print one summary line."""
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# (import name, pip requirement, group, how): "keep" = never replaced when present, whatever
# its version (the image's build), installed without dependencies when absent; "nodeps" =
# installed without dependencies; "deps" = installed with them; "optional" = like "deps", but
# skipped with a note when offline.
REQUIREMENTS = [
    ("torch", "torch==2.13.0", "runtime", "keep+deps"),
    ("triton", "triton==3.8.0", "runtime", "keep"),
    ("vllm", "vllm==0.33.0", "runtime", "keep"),
    ("numpy", "numpy", "runtime", "deps"),
    ("packaging", "packaging", "runtime", "deps"),
    ("regex", "regex", "runtime", "deps"),
    ("dill", "dill", "runtime", "deps"),
    ("hypothesis", "hypothesis>=6.100", "runtime", "deps"),
    ("coverage", "coverage>=7.4", "runtime", "deps"),
    ("setuptools", "setuptools>=68", "runtime", "deps"),
    ("pytest", "pytest>=7.4", "test", "deps"),
    ("xdist", "pytest-xdist>=3.5", "test", "optional"),
    ("ruff", "ruff>=0.6", "test", "optional"),
    ("matplotlib", "matplotlib>=3.7", "test", "optional"),
    ("jsonschema", "jsonschema>=4.18", "test", "optional"),
]
KEPT_EXTRA = ("aiter",)  # reported and pinned when present, never installed
IGNORED_LOCATION = re.compile(r"WARNING: Location '[^']*' is ignored: it is neither a file nor")
OFFLINE = os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on")


def numeric(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def installed(module: str) -> tuple[str, str] | None:
    """(distribution, version) providing an importable module, without importing it."""
    if importlib.util.find_spec(module) is None:
        return None
    for dist in DISTRIBUTIONS.get(module, []):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return module, "(no metadata)"


def pip(*args: str) -> None:
    """Run pip quietly; its errors stay visible and stop setup.

    --no-warn-conflicts drops the resolver's report that the --no-deps vLLM lacks its serving
    dependencies; an index configured as a local folder without the package ("Location ... is
    ignored") is not an error either. Every other line pip writes is passed on.
    """
    command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--no-warn-conflicts", "--progress-bar", "off", *args]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if not IGNORED_LOCATION.match(line):
            sys.stderr.write(line)
    if process.wait() != 0:
        hint = " (offline: PIP_NO_INDEX is set)" if OFFLINE else ""
        sys.exit(f"setup: pip could not install {' '.join(args)}{hint}")


sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]  # the checkout is no site
DISTRIBUTIONS = md.packages_distributions()
groups = os.environ["GROUPS_WANTED"].split(",")
reused, kept_pins, missing = [], [], []
for module in KEPT_EXTRA:
    if (found := installed(module)) is not None:
        reused.append(f"{found[0]} {found[1]}")
        kept_pins.append(found)
for module, requirement, group, how in REQUIREMENTS:
    if group not in groups:
        continue
    found = installed(module)
    minimum = re.search(r">=(.+)$", requirement)
    too_old = (found is not None and "keep" not in how and minimum is not None
               and found[1] != "(no metadata)" and numeric(found[1]) < numeric(minimum[1]))
    if found is not None and not too_old:
        reused.append(f"{found[0]} {found[1]}")
        if "keep" in how:
            kept_pins.append(found)
    else:
        missing.append((requirement, how))

skipped: list[str] = []
with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="difftest-keep-") as pins:
    # What the image brought stays: pip may not replace it to satisfy another package.
    pins.write("".join(f"{dist}=={version}\n" for dist, version in kept_pins
                       if version != "(no metadata)"))
    pins.flush()
    with_deps = [req for req, how in missing if how in ("keep+deps", "deps")]
    optional = [req for req, how in missing if how == "optional"]
    if OFFLINE:
        skipped, optional = optional, []
    if with_deps + optional:
        pip("-c", pins.name, *with_deps, *optional)
    no_deps = [req for req, how in missing if how == "keep"]
    if no_deps:
        pip("--no-deps", *no_deps)
installed_now = [req for req, _ in missing if req not in skipped]

# AITER's Triton ops for the aiter-unified backend where no AITER is installed: the PyPI wheel
# (pure Python) unpacked --no-deps into <venv>/difftest-aiter, never on sys.path, so it never
# shadows a real AITER (difftest/backends/aiter_triton.py).
AITER_WHEEL = "amd-aiter==0.1.7.post2.dev18"
side = Path(sys.prefix) / "difftest-aiter"
real = importlib.util.find_spec("aiter")
if real is None or not any((Path(d) / "ops" / "triton").is_dir()
                           for d in real.submodule_search_locations or ()):
    if (side / "aiter" / "ops" / "triton").is_dir():
        reused.append(f"{AITER_WHEEL.replace('==', ' ')} ({side.name})")
    elif OFFLINE:
        skipped.append(f"{AITER_WHEEL} (its backend is unavailable)")
    else:
        partial = side.with_name(side.name + ".partial")
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        pip("--no-deps", "--no-compile", "--target", str(partial), AITER_WHEEL)
        partial.rename(side)
        installed_now.append(f"{AITER_WHEEL} (into {side.name})")

# The project itself, editable; redone only when pyproject.toml or the checkout changed.
stamp = Path(sys.prefix) / "difftest-setup.stamp"
wanted = f"{hashlib.sha256(Path('pyproject.toml').read_bytes()).hexdigest()} {Path.cwd()}\n"
try:
    current = md.distribution("difftest").read_text("direct_url.json") or "{}"
    project_ok = (stamp.is_file() and stamp.read_text() == wanted
                  and json.loads(current).get("url") == Path.cwd().as_uri())
except md.PackageNotFoundError:
    project_ok = False
if project_ok:
    project = "difftest editable (unchanged)"
else:
    pip("--no-deps", "--no-build-isolation", "-e", ".")
    stamp.write_text(wanted)
    project = "difftest editable (installed)"

# A reused vLLM may lack modules its kernels import (an image's vLLM without its serving
# dependencies): ask the backends, once per vLLM install and project state.
KERNEL_PROBE = """
from difftest.contract import registry
from difftest.machine import devices
devices.prepare_runtime(devices.resolve("auto"))
lacking = [f"{name} ({b.availability().reason})" for name, b in registry.discover().items()
           if not b.availability().available and "which this environment lacks" in
           b.availability().reason]
print("; ".join(lacking))
"""
kernels = ""
vllm_found = installed("vllm")
if vllm_found is not None and "vllm==0.33.0" not in installed_now:
    key = f"{wanted.strip()} {vllm_found} {importlib.util.find_spec('vllm').origin}\n"
    note_file = Path(sys.prefix) / "difftest-kernels.note"
    if note_file.is_file() and note_file.read_text().startswith(key):
        lacking = note_file.read_text()[len(key):].strip()
    else:
        probe = subprocess.run([sys.executable, "-c", KERNEL_PROBE], capture_output=True,
                               text=True, check=False)
        if probe.returncode != 0:
            sys.exit(f"setup: probing the backends failed:\n{probe.stderr}")
        lacking = probe.stdout.strip()
        note_file.write_text(key + lacking + "\n")
    if lacking:
        kernels = f"vLLM {vllm_found[1]} kernels import partly, unavailable: {lacking}"

parts = [os.environ["VENV_NOTE"]] if os.environ["VENV_NOTE"] else []
parts.append("reused " + (", ".join(reused) or "nothing"))
parts.append("installed " + (", ".join(installed_now) or "nothing"))
if skipped:
    parts.append("not installed (offline; tests that need them skip): " + ", ".join(skipped))
parts.append(project)
if kernels:
    parts.append(kernels)
print(f"setup ({'+'.join(groups)}): " + "; ".join(parts))
PY
