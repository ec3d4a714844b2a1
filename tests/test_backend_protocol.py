"""The Backend protocol's optional capabilities are declared types, checked by type."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftest.backends.aiter_gluon import AiterGluon
from difftest.backends.torch_ref import TorchReference
from difftest.contract.backend import (
    Backend,
    ConfigurableBackend,
    ReferenceBackend,
    serves_as_reference,
    takes_options,
)
from difftest.contract.registry import RegistryError, guard, load_plugin
from difftest.run.session import Session

PLAIN_PLUGIN = '''
from difftest.backends.torch_ref import TorchReference


class Plain:
    """A backend with the protocol's required members only."""

    name = "plain"
    in_page_orders = ()
    _ref = TorchReference()

    def availability(self):
        return self._ref.availability()

    def unsupported_reason(self, case, device):
        return None

    def precision(self, case, device):
        return self._ref.precision(case, device)

    def empty_row_output(self, case):
        return self._ref.empty_row_output(case)

    def versions(self):
        return {}

    def run(self, inputs):
        return self._ref.run(inputs)


DIFFTEST_BACKENDS = [Plain()]
'''


@pytest.fixture
def plain_plugin(tmp_path: Path) -> str:
    path = tmp_path / "plain_plugin.py"
    path.write_text(PLAIN_PLUGIN)
    return str(path)


def test_capabilities_are_recognised_by_type(plain_plugin: str) -> None:
    [plain] = load_plugin(plain_plugin)
    reference, configurable = TorchReference(), AiterGluon(True)
    assert all(isinstance(b, Backend) for b in (reference, configurable, plain))
    assert isinstance(reference, ReferenceBackend)
    assert not isinstance(reference, ConfigurableBackend)
    assert isinstance(configurable, ConfigurableBackend)
    assert not isinstance(configurable, ReferenceBackend)
    assert not isinstance(plain, (ReferenceBackend, ConfigurableBackend))
    assert configurable.with_options({"k_trim": "off"}).versions()["k_trim"] == "off"


def test_a_backend_without_reference_cannot_be_the_reference(tmp_path: Path,
                                                             plain_plugin: str) -> None:
    with pytest.raises(RegistryError, match=r"'plain' cannot serve as the reference \(it has "
                                            r"no reference\(\) and no working_bytes\(\) "
                                            r"method\)"):
        Session.create([], plugins=[plain_plugin], device="cpu", artifacts=str(tmp_path),
                       reference="plain")


def test_capabilities_are_seen_through_the_wrappers() -> None:
    """The registry's guard delegates through ``__getattr__``; Python 3.12's protocol
    ``isinstance`` reads attributes statically and would miss them, the helpers do not."""
    reference, configurable = guard(TorchReference()), guard(AiterGluon(True))
    assert serves_as_reference(reference) and not takes_options(reference)
    assert takes_options(configurable) and not serves_as_reference(configurable)
    assert Session.create([], device="cpu").reference.name == "torch-ref"
