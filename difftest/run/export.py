"""``difftest export``: a failure as a script a kernel maintainer runs without difftest.

The backend runs the recorded case once more and states its kernel call by value
(:mod:`difftest.contract.exported_call`); the script holds that call (its scalar arguments
written out, its tensors in a file beside it, or inline when small), the case's plain page
views, page table and context lengths for a float64 reference computed in the script
(:mod:`difftest.run.exported_script`), and the per-element tolerance of the backend's declared
precision (docs/tolerance.md). It needs torch and the kernel's own package; it prints where
and how much the kernel is off, exits 1 when it is and 0 when it agrees, and holds a pytest
function, so it can go into an upstream issue or test suite as it is (docs/workflows.md).
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import math
import re
import textwrap
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftest.contract.backend import RunInputs, serves_as_reference
from difftest.contract.exported_call import ExportedCall
from difftest.contract.tolerance import Tolerance
from difftest.judgement.expectations import known_bug
from difftest.judgement.expectations import load as load_expectations
from difftest.results.artifacts import output_digest
from difftest.results.records import FAILING, ResultRecord, Status
from difftest.run import exported_script
from difftest.run.replay import load_source

INLINE_LIMIT = 40_000  # characters of base64: above it the tensors go to a file beside
DEFAULT_REFERENCE = "torch-ref"


class ExportError(ValueError):
    """The failure cannot be exported as asked; the message says why (exit 2)."""


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: the script, the tensors file (``None``: inline), the backend
    exported, the known bug it reproduces (if any) and notes for the user."""

    script: Path
    tensors: Path | None
    backend: str
    known_bug: str | None
    notes: tuple[str, ...]


def export(source: Path, output: Path | None = None, backend_name: str | None = None,
           plugins: Sequence[str] = (), device: str = "auto") -> Exported:
    """Export the kernel call of ``backend_name`` (default: the failing backend) on the case
    at ``source`` (a failure directory, a case file or a pending file) as a script at
    ``output`` (default: ``<failure directory>/test_<kernel>_<case id>.py``)."""
    from difftest.contract import registry
    from difftest.machine import devices

    case, recorded, environment = load_source(source)
    results = [ResultRecord.from_dict(r, f"results[{i}]")
               for i, r in enumerate((recorded or {}).get("results", []))]
    name = backend_name or _failing_backend(results, source)
    result = next((r for r in results if r.backend == name), None)
    resolved = devices.resolve(device)
    devices.prepare_runtime(resolved)
    known = registry.discover(plugins)
    reference_name = (recorded or {}).get("reference") or DEFAULT_REFERENCE
    reference, backend = registry.select(known, [reference_name, name])
    if not serves_as_reference(reference):
        raise ExportError(f"{reference_name!r} cannot serve as the reference")
    available = backend.availability()
    if not available.available:
        raise ExportError(f"{name} is unavailable here: {available.reason}")
    where = torch.device(resolved)
    refused = backend.unsupported_reason(case, where)
    if refused:
        raise ExportError(f"{name} does not run case {case.case_id} here: {refused}")
    inputs = RunInputs(case, where, exported=[])
    out = backend.run(inputs)
    if not inputs.exported:
        raise ExportError(f"{name} states no kernel call by value (RunInputs.export_call, "
                          "difftest/contract/exported_call.py), so it cannot be exported")
    if len(inputs.exported) > 1:
        raise ExportError(f"{name} made {len(inputs.exported)} kernel calls on case "
                          f"{case.case_id}; a script reproduces one")
    (call,) = inputs.exported
    notes = []
    if result is not None and result.output_sha256 and output_digest(out) != result.output_sha256:
        notes.append(f"this export's run of {name} gave other output bits than the recorded "
                     "run (another machine or release?); the script holds this run's call")
    truth = reference.reference(inputs)
    tolerance = Tolerance.of(backend.precision(case, where), case).bound(truth)
    views = inputs.cache("plain")
    table, context_lens = inputs.sparse_table
    tensors = {
        "arguments": {k: v for k, v in call.arguments.items() if isinstance(v, torch.Tensor)},
        "reference": {"query": inputs.data.query, "key_cache": views.k,
                      "value_cache": views.v, "block_table": table,
                      "context_lens": context_lens, "tolerance": tolerance},
    }
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    packed = base64.b64encode(zlib.compress(buffer.getvalue(), 9)).decode()
    script = output or (source if source.is_dir() else source.parent) / (
        f"test_{call.kernel}_{case.case_id}.py")
    tensors_file = None if len(packed) <= INLINE_LIMIT else script.with_suffix(".pt")
    bug = known_bug(load_expectations(), recorded["case"] if recorded else case.to_dict(),
                    result) if result is not None and result.status in FAILING else None
    text = render(call, case.to_dict(), _versions(result, environment, backend), name,
                  result, bug, backend.empty_row_output(case).value, script.name,
                  tensors_file.name if tensors_file else None,
                  None if tensors_file else packed)
    script.parent.mkdir(parents=True, exist_ok=True)
    if tensors_file is not None:
        tensors_file.write_bytes(buffer.getvalue())
    script.write_text(text)
    return Exported(script, tensors_file, name, bug, tuple(notes))


def _failing_backend(results: list[ResultRecord], source: Path) -> str:
    failing = [r.backend for r in results if r.status in FAILING and r.status is not
               Status.CRASH]
    if len(failing) == 1:
        return failing[0]
    if not failing:
        raise ExportError(f"{source}: no recorded disagreement or error to export; name the "
                          "backend with --backend")
    raise ExportError(f"{source}: {len(failing)} backends failed ({', '.join(failing)}); "
                      "name one with --backend")


def _versions(result: ResultRecord | None, environment: Mapping[str, Any] | None,
              backend: Any) -> dict[str, str]:
    """The versions the failure was recorded with: the backend's, torch's and Python's (the
    versions of this machine's backend where nothing was recorded)."""
    versions = dict(result.versions) if result is not None else dict(backend.versions())
    recorded = (environment or {}).get("versions", {})
    for key in ("torch", "triton"):
        if key in recorded:
            versions.setdefault(key, str(recorded[key]))
    if environment and environment.get("python"):
        versions.setdefault("python", str(environment["python"]))
    if environment and environment.get("gpu_arch"):
        versions.setdefault("gpu_arch", str(environment["gpu_arch"]))
    return versions


def literal(name: str, value: Any) -> str:
    """Python source of a scalar argument's value; :class:`ExportError` names an argument of
    a kind a script cannot hold."""
    if value is None or isinstance(value, bool | int | str):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, tuple | list):
        items = [literal(name, v) for v in value]
        inner = ", ".join(items) + ("," if isinstance(value, tuple) and len(items) == 1 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    raise ExportError(f"argument {name!r}: a {type(value).__name__} cannot be written into a "
                      "script")


def _mapping(values: Mapping[str, Any], indent: int = 4) -> str:
    pad = " " * indent
    return "{\n" + "".join(f"{pad}{k!r}: {literal(k, v)},\n" for k, v in values.items()) + "}"


def _tensor_comment(call: ExportedCall) -> str:
    shown = [f"#   {k}: {str(v.dtype).removeprefix('torch.')} {list(v.shape)}"
             for k, v in call.arguments.items() if isinstance(v, torch.Tensor)]
    return "\n".join(shown)


def render(call: ExportedCall, case: dict[str, Any], versions: Mapping[str, str],
           backend: str, result: ResultRecord | None, bug: str | None, empty_rows: str,
           script_name: str, tensors_name: str | None, packed: str | None) -> str:
    """The text of the script of ``call``."""
    loader = call.source.loader
    functions = [loader, exported_script.prepare_device, exported_script.ref_paged_attn,
                 exported_script.differences]
    sources = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in functions)
    sources = re.sub(r"\n{3,}", "\n\n", sources)
    scalars = {k: v for k, v in call.arguments.items() if not isinstance(v, torch.Tensor)}
    reference = {"scale": case.get("softmax_scale"), "k_scale": case.get("k_scale", 1.0),
                 "v_scale": case.get("v_scale", 1.0), "softcap": case.get("softcap", 0.0),
                 "sliding_window": case.get("sliding_window", 0)}
    status = ("recorded: " + result.status.value
              + (f", error/tolerance {result.comparison.max_ratio:.4g}"
                 if result.comparison is not None else "")) if result else "not recorded"
    known = (f"\nKnown bug {bug} of difftest's findings (docs/findings.md {bug} in difftest's "
             "repository).\n") if bug else ""
    tree = call.source.recorded_tree
    tree_help = (f"the recorded run loaded {call.source.package} from {tree}" if tree
                 else f"the recorded run imported the installed {call.source.package}")
    launch = f"kernel[{call.grid!r}]" if call.grid else "kernel"
    data = (f"TENSORS = Path(__file__).with_name({tensors_name!r})\nTENSORS_INLINE = None"
            if tensors_name else
            "TENSORS = None\n# torch.save of the tensors, zlib-compressed, base64\n"
            "TENSORS_INLINE = (\n" + "".join(f"    {packed[i:i + 88]!r}\n"
                                              for i in range(0, len(packed or ""), 88)) + ")")
    versions_line = ", ".join(f"{k} {v}" for k, v in versions.items())
    return f'''#!/usr/bin/env python3
"""{call.kernel} on case {case["id"]}: {backend}, {status}.

Recorded with {versions_line}.
{known}
The call below is the one difftest's `{backend}` made ({launch}(**arguments)), with the
same values; the float64 reference (ref_paged_attn) reads the same cache in its plain page
order through the case's page table. Tolerance: difftest's per-element bound for the
backend's declared rounding stages (docs/tolerance.md in difftest's repository).

Run:     python {script_name} [--device cpu|cuda] [--tree DIR]
Pytest:  pytest {script_name}   (REPRO_DEVICE=cpu|cuda, REPRO_TREE=DIR)
--tree DIR: take {call.source.package} from DIR instead of the installed package
({tree_help}).
Exit status 0: the kernel agrees with the reference; 1: it differs (printed: where, how much).
Needs torch and {call.source.package}; written by `difftest export`.

The case, as difftest's JSON (`difftest repro` replays it):
{json.dumps(case, separators=(",", ":"))}
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import io
import os
import sys
import zlib
from pathlib import Path

import torch

KERNEL = {call.kernel!r}
PACKAGE = {call.source.package!r}
RECORDED = {_mapping(versions)}
# how {loader.__name__} finds the kernel
KERNEL_OPTIONS = {_mapping(call.source.options)}
GRID = {call.grid!r}  # a Triton launch: kernel[GRID](**arguments); None: kernel(**arguments)
OUTPUT = {call.output!r}  # the argument the kernel writes its output into
# the call's tensors (load_tensors()["arguments"]):
{_tensor_comment(call)}
# its other arguments, as passed:
SCALARS = {_mapping(scalars)}
# the reference's parameters (the case's)
REFERENCE = {_mapping(reference)}
EMPTY_ROWS = {empty_rows!r}  # what the kernel writes on rows of no context
{data}


{sources}


def load_tensors(device: str) -> dict:
    """The call's tensors and the reference's, on ``device``."""
    raw = TENSORS.read_bytes() if TENSORS else zlib.decompress(base64.b64decode(
        "".join(TENSORS_INLINE)))
    return torch.load(io.BytesIO(raw), map_location=device, weights_only=True)


def check(device: str | None = None, tree: str | None = None) -> list[str]:
    """Make the recorded call on ``device`` (default: a GPU if torch sees one) and return
    what differs from the float64 reference (nothing: it agrees)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prepare_device(device)
    kernel = {loader.__name__}(tree, device, **KERNEL_OPTIONS)
    tensors = load_tensors(device)
    arguments = {{**SCALARS, **tensors["arguments"]}}
    result = kernel[GRID](**arguments) if GRID else kernel(**arguments)
    output = result if OUTPUT is None or result is not None else arguments[OUTPUT]
    ref = tensors["reference"]
    expected = ref_paged_attn(ref["query"], ref["key_cache"], ref["value_cache"],
                              ref["block_table"], ref["context_lens"], **REFERENCE)
    return differences(output, expected, ref["tolerance"], ref["context_lens"], EMPTY_ROWS)


def test_{call.kernel}_case_{case["id"]}() -> None:
    problems = check(os.environ.get("REPRO_DEVICE"), os.environ.get("REPRO_TREE"))
    assert not problems, "\\n".join(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="where the kernel runs (default: a GPU if torch sees one; cpu: "
                        "Triton's interpreter)")
    parser.add_argument("--tree", help=f"a directory holding the {{PACKAGE}} package to take "
                        "the kernel from (default: the installed one)")
    args = parser.parse_args(argv)
    print("recorded with: " + ", ".join(f"{{k}} {{v}}" for k, v in RECORDED.items()))
    problems = check(args.device, args.tree)
    here = [f"torch {{torch.__version__}}"]
    for name in ("triton", PACKAGE):
        try:
            here.append(f"{{name}} {{importlib.metadata.version(name)}}")
        except importlib.metadata.PackageNotFoundError:
            pass
    print("ran with: " + ", ".join(here) + (f", from {{args.tree}}" if args.tree else ""))
    if problems:
        print(f"{{KERNEL}} differs from the float64 reference:")
        print("\\n".join(problems))
        return 1
    print(f"{{KERNEL}} agrees with the float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
