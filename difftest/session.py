"""A configured run: device, reference, backends under test and the artifact store.

Shared by the CLI and the pytest plugin so both resolve devices, plug-ins and backends the
same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from difftest import devices, registry
from difftest.artifacts import DEFAULT_ROOT, ArtifactStore
from difftest.backend import Backend
from difftest.case import Case
from difftest.runner import CaseResult, run_case

DEFAULT_REFERENCE = "torch-ref"


@dataclass
class Session:
    """Everything needed to run cases; collects their results."""

    device: torch.device
    reference: Backend
    backends: list[Backend]
    store: ArtifactStore
    results: list[CaseResult] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        backend_names: Iterable[str] | None = None,
        plugins: Iterable[str] = (),
        device: str = "auto",
        artifacts: str = DEFAULT_ROOT,
        reference: str = DEFAULT_REFERENCE,
    ) -> Session:
        """Resolve the device (preparing the CPU runtime first), then find the backends."""
        resolved = devices.resolve(device)
        devices.prepare_runtime(resolved)
        known = registry.discover(plugins)
        ref = registry.select(known, [reference])[0]
        if not hasattr(ref, "reference"):
            raise registry.RegistryError(f"{reference!r} cannot serve as the reference "
                                         "(it has no reference() method)")
        names = list(backend_names) if backend_names is not None else [
            n for n in sorted(known) if n != reference]
        chosen = registry.select(known, [n for n in names if n != reference])
        return cls(torch.device(resolved), ref, chosen, ArtifactStore(artifacts))

    def run(self, case: Case) -> CaseResult:
        """Run one case, keep and return its result."""
        result = run_case(case, self.reference, self.backends, self.device, self.store)
        self.results.append(result)
        return result

    def config(self) -> dict[str, object]:
        """The part of a report that says how this session was configured."""
        return {
            "device": str(self.device),
            "reference": self.reference.name,
            "backends": [b.name for b in self.backends],
        }
