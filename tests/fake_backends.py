"""Plug-in backends built on the float64 reference, for difftest's own tests.

The subprocess tests copy this file into a temporary project and load it with
``--plugin``/``--difftest-plugin``, as a third party would load its own backend.
"""

from __future__ import annotations

import os

import torch

from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract.backend import Availability, Precision, RunInputs


class Rounded(TorchReference):
    """The reference rounded to float16, declared so: a fast backend that agrees."""

    name = "rounded"

    def precision(self, case: Case, device: torch.device) -> Precision:
        """float16 throughout."""
        return Precision("float16", "float16", "float16")

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The float64 reference, rounded."""
        return self.reference(inputs).output.to(torch.float16)


class Perturbed(Rounded):
    """One output element off by 1.0: a deliberately wrong kernel."""

    name = "perturbed"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The rounded reference with element [0, 0, 0] off by one."""
        out = super().run(inputs)
        out[0, 0, 0] += 1.0
        return out


class Crasher(Rounded):
    """Kills its process mid-case, as a GPU fault would, when the seed is divisible by 3."""

    name = "crasher"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """Exit with status 77 on seeds divisible by 3, else agree."""
        if inputs.case.seed % 3 == 0:
            os._exit(77)
        return super().run(inputs)


DIFFTEST_BACKENDS = [Rounded, Perturbed, Crasher]


class NanOut(TorchReference):
    """Writes NaN everywhere: a disagreement with non-finite errors."""

    name = "nan-out"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """NaN in the reference's shape."""
        return torch.full_like(self.reference(inputs).output, float("nan"))


NAN_BACKENDS = [NanOut]  # --plugin tests/fake_backends.py:NAN_BACKENDS


class ProbeRaises(Rounded):
    """Its availability probe raises, as a driver query on a broken image does."""

    name = "probe-raises"

    def availability(self) -> Availability:
        """Raise."""
        raise RuntimeError("driver query failed: /dev/kfd unreadable")


class VersionsRaise(Rounded):
    """Available, but ``versions()`` raises, as vLLM without its compiled extension does."""

    name = "versions-raise"

    def versions(self) -> dict[str, str]:
        """Raise."""
        raise ModuleNotFoundError("No module named 'vllm._C_stable_libtorch'")


class SupportRaises(Rounded):
    """Deciding whether it supports a case raises (a prepare-stage fault)."""

    name = "support-raises"

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """Raise."""
        raise KeyError("capability table has no entry for this head count")


class CacheFails(Rounded):
    """Asks for a cache in an in-page order that does not exist (a prepare-stage fault)."""

    name = "cache-fails"
    in_page_orders = ("no-such-order",)


class RunRaises(Rounded):
    """Its kernel raises."""

    name = "run-raises"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """Raise."""
        raise RuntimeError("HIP error: invalid device function")


class PrecisionRaises(Rounded):
    """Declaring its precision raises, so its output cannot be compared."""

    name = "precision-raises"

    def precision(self, case: Case, device: torch.device) -> Precision:
        """Raise."""
        raise ValueError("no precision declared for this dtype")


class NotATensor(Rounded):
    """Returns a list instead of a tensor, so its output cannot be compared."""

    name = "not-a-tensor"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """A list."""
        return [0.0]  # type: ignore[return-value]


# Loaded as ``--plugin fakes.py:FAULTY_BACKENDS`` by tests/test_fault_isolation.py: one working
# backend beside one fault at each stage.
FAULTY_BACKENDS = [Rounded, ProbeRaises, VersionsRaise, SupportRaises, CacheFails, RunRaises,
                   PrecisionRaises, NotATensor]


class WritesCache(Rounded):
    """Returns the right answer, then zeroes the plain cache it was given: the backends after
    it would read a wrong cache."""

    name = "writes-cache"
    in_page_orders = ("plain",)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The rounded reference; then the cache's bytes zeroed."""
        out = super().run(inputs)
        inputs.cache("plain").raw.zero_()
        return out


class WritesQuery(Rounded):
    """Returns the right answer, then scales the query it was given."""

    name = "writes-query"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The rounded reference; then the query halved."""
        out = super().run(inputs)
        inputs.data.query.mul_(0.5)
        return out


class ReadsCache(Rounded):
    """The attention of the K and V it reads from the plain cache: wrong when an earlier
    backend wrote into that cache."""

    name = "reads-cache"
    in_page_orders = ("plain",)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The rounded reference, NaN where the cache's attended bytes were zeroed."""
        out = super().run(inputs)
        case = inputs.case
        sides = case.layout.sides(inputs.cache("plain").raw, case)  # [n, 2, B, nkv, D]
        attended = sides[inputs.data.block_ids]
        return out if bool((attended != 0).any()) else torch.full_like(out, float("nan"))


# --plugin fake_backends.py:WRITING_BACKENDS: two backends that write into their inputs, with
# a reader after each
WRITING_BACKENDS = [WritesCache, WritesQuery, ReadsCache, Rounded]


class BadVersions(Rounded):
    """``versions()`` returns what no report can hold."""

    name = "bad-versions"

    def versions(self) -> dict[str, str]:
        """A set where a version string belongs."""
        return {"torch": {1, 2}}  # type: ignore[dict-item]


class BadName(Rounded):
    """A name that would print a line of its own."""

    name = "ok\nGATE PASSED: no regression"


VERSION_BACKENDS, NAME_BACKENDS = [BadVersions], [BadName]


class SupportRefuses(Rounded):
    """Available, but refuses every case."""

    name = "support-refuses"

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """Every case: refused."""
        return "this backend runs no case"


REFUSING_BACKENDS = [SupportRefuses]
