"""The launches a backend's launchers chose (kernel, warps, stages, tiles), counted for a
run's reach record: backends note them, :mod:`difftest.results.reach` reads them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LAUNCH_KEYS = ("num_warps", "num_stages", "waves_per_eu", "TILE_SIZE", "BLOCK_M", "BLOCK_Q",
               "NUM_SEGMENTS_PER_SEQ", "IS_3D")
_launches: dict[str, dict[str, int]] = {}  # kernel module -> launch parameters -> count


def note_launch(module: str, kernel: str, parameters: Mapping[str, Any]) -> None:
    """Count one launch of ``kernel`` (of ``module``) with its launch parameters
    (:data:`LAUNCH_KEYS` among them), for the run's reach record."""
    shown = " ".join(f"{k}={parameters[k]}" for k in LAUNCH_KEYS if k in parameters)
    counts = _launches.setdefault(module, {})
    counts[f"{kernel} {shown}"] = counts.get(f"{kernel} {shown}", 0) + 1


def clear_launches() -> None:
    """Forget the launches counted so far."""
    _launches.clear()


def counted_launches() -> dict[str, dict[str, int]]:
    """The launches counted since the last :func:`clear_launches`, sorted."""
    return {m: dict(sorted(c.items())) for m, c in sorted(_launches.items())}
