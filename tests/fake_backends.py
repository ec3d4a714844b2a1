"""Plug-in backends built on the float64 reference, for difftest's own tests.

The subprocess tests copy this file into a temporary project and load it with
``--plugin``/``--difftest-plugin``, as a third party would load its own backend.
"""

from __future__ import annotations

import os

import torch
from difftest.backends.torch_ref import TorchReference

from difftest.backend import Precision, RunInputs
from difftest.case import Case


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
