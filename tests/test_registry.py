"""Finding backends: entry points, plug-ins, and options given in a backend's name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.contract.registry import RegistryError, discover, select, split_names
from difftest.run.runner import Status, run_case


def test_split_names_keeps_commas_inside_options() -> None:
    assert split_names("torch-ref, aiter-gluon@emulated[k_trim=off,revision=v0.1.20],x!y") == [
        "torch-ref", "aiter-gluon@emulated[k_trim=off,revision=v0.1.20]", "x!y"]


def test_options_in_a_name_configure_the_registered_backend() -> None:
    known = discover()
    [trimless] = select(known, ["aiter-gluon@emulated[revision=v0.1.20,k_trim=off]"])
    assert trimless.name == "aiter-gluon@emulated[k_trim=off,revision=v0.1.20]"
    assert trimless.versions()["k_trim"] == "off"
    assert select(known, ["aiter-gluon@emulated"])[0].versions()["k_trim"] == "on"


@pytest.mark.parametrize(("name", "message"), [
    ("aiter-gluon@emulated[k_trim=of]", "k_trim='of' is not one of on, off, before-stride"),
    ("aiter-gluon@emulated[trim=off]", "unknown option 'trim'"),
    ("aiter-gluon@emulated[k_trim]", "option 'k_trim' is not key=value"),
    ("torch-ref[a=b]", "backend 'torch-ref' takes no options"),
    ("no-such-kernel", "unknown backend 'no-such-kernel'; known backends: "),
])
def test_bad_names_say_what_is_allowed(name: str, message: str) -> None:
    with pytest.raises(RegistryError) as error:
        select(discover(), [name])
    assert message in str(error.value)


class WrongShape(TorchReference):
    """Returns one query row too few."""

    name = "wrong-shape"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        return self.reference(inputs).output[1:].clone()


def test_an_output_of_the_wrong_shape_is_an_error_not_a_lost_case() -> None:
    case = Case(num_blocks=3, seq_lens=(130, 5), block_tables=((0, 1), (2,)),
                selections=((0, 1), (0, -1)))
    result = run_case(case, TorchReference(), [WrongShape()], torch.device("cpu")).results[0]
    assert result.status is Status.ERROR
    assert "its output could not be compared" in result.detail
    assert "returned shape (1, 16, 128), expected (2, 16, 128)" in result.detail


def test_a_plugin_that_fails_to_import_is_a_registry_error(tmp_path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import nosuchdep\n")
    with pytest.raises(RegistryError, match=r"importing .*broken.py failed: "
                                            r"ModuleNotFoundError: No module named 'nosuchdep'"):
        discover([str(broken)])


def test_a_module_plugin_is_found_in_the_current_directory(tmp_path: Path) -> None:
    """``--plugin pkg.module`` from the console script finds a module of the directory it runs
    in (a checkout's ``mutants.catalog``), as ``python -m`` would."""
    (tmp_path / "myplugins").mkdir()
    (tmp_path / "myplugins" / "__init__.py").write_text("")
    (tmp_path / "myplugins" / "ref.py").write_text(
        "from difftest.backends.torch_ref import TorchReference\n\n\n"
        "class Mine(TorchReference):\n    name = 'mine'\n\n\nDIFFTEST_BACKENDS = [Mine()]\n")
    script = Path(sys.executable).with_name("difftest")
    result = subprocess.run([str(script), "backends", "--plugin", "myplugins.ref"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert any(line.split()[:2] == ["mine", "available"] for line in result.stdout.splitlines())
