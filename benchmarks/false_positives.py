"""False positives: correct backends on a long stretch of fitted examples, per profile.

    python -m benchmarks.false_positives --examples 2000 --workers 2 --json fp.json
    python -m benchmarks.false_positives --examples 100 --backends triton-unified
    python -m benchmarks.false_positives --profiles dev,nightly --examples 2000
    python -m benchmarks.false_positives --families sparse,dense --examples 2000 --json fp.json

``--profiles`` says how the examples are searched: ``derandomized`` (the default) draws
``difftest run``'s fixed set; ``dev`` and ``nightly`` search as ``pytest
tests/test_differential.py`` does under those Hypothesis profiles (their settings, with each
backend's error/tolerance as a ``target``, which steers the search toward the cases closest
to the tolerance: where a false positive would be), each part under its own ``@seed`` so a
stretch can be rerun.

The examples are what ``difftest run`` draws (:class:`difftest.generation.capabilities.
Capabilities`: every dtype combination and kernel mode some chosen backend runs, each example
fitted to every backend), with a smaller geometry by default (``--max-batch 2 --max-topk 4``)
so that thousands fit in minutes. They are drawn in ``--parts`` parts, part ``i`` of the
``j``-th profile named under seed ``seed + j * parts + i`` (profiles that searched the same
seeds would draw the same examples), each drawn and run by one worker process: the set
depends on the examples, the parts, the profiles and the seed, never on the number of workers.
Every backend is correct, so any disagreement, error or crash no known kernel bug explains is a
false positive: it is printed with its case JSON and the exit status is 1 (the known bugs met
are counted apart, :mod:`difftest.judgement.expectations`). The parameter audit of the stretch
(:mod:`difftest.judgement.audit`) is printed too, and its blind spots (an argument a backend accepts
that took a single value) also fail the run.
``--families sparse,dense`` draws the dense family too (:mod:`difftest.generation.dense`, its own
small geometry; ``--max-batch`` and ``--max-topk`` do not apply to it); every count is
reported per family and profile.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from difftest.contract.registry import split_names
from difftest.machine import devices

DEFAULT_BACKENDS = ("triton-unified", "vllm-triton-sparse", "vllm-paged-decode",
                    "vllm-decode-attention", "aiter-unified", "aiter-gluon@emulated",
                    "vllm-aiter@emulated")
FAMILIES = ("sparse", "dense")


def _prepare_worker(device: str, workers: int) -> None:
    devices.prepare_runtime(device)
    devices.share_cpu_threads(workers)


def run_part(examples: int, seed: int, names: Sequence[str], device: str, max_batch: int,
             max_topk: int, profile: str = "derandomized", family: str = "sparse"
             ) -> dict[str, Any]:
    """Draw ``examples`` examples under ``seed`` as ``profile`` searches (module docstring),
    fit them to the backends called ``names`` and run every fitted case: the records (as
    dicts), the failures no known kernel bug explains, the known bugs met and generation's
    summary."""
    import tempfile

    import torch

    from difftest.generation.capabilities import Capabilities
    from difftest.generation.generate import generated_cases
    from difftest.judgement.expectations import judge
    from difftest.judgement.expectations import load as load_expectations
    from difftest.run.runner import FAILING
    from difftest.run.session import Session

    expectations = load_expectations()

    with tempfile.TemporaryDirectory() as artifacts:
        session = Session.create(list(names), device=device, artifacts=artifacts)
        capabilities = Capabilities.probe(session.backends, torch.device(device))
        strategy = (capabilities.dense_strategy if family == "dense" else
                    functools.partial(capabilities.strategy, max_batch=max_batch,
                                      max_topk=max_topk))
        failures: list[dict[str, Any]] = []
        known: list[dict[str, str]] = []

        def run(fitted: Any) -> list[tuple[str, float]]:
            result = session.run(fitted.case, fitted.backends)
            judgement = judge([session.records[-1]], expectations)
            new = {r.backend for _, r in judgement.new}
            known.extend({"backend": r.backend, "finding": finding, "profile": profile,
                          "family": family, "case_id": fitted.case.case_id}
                         for finding, hits in judgement.known.items() for _, r in hits)
            failed = [r for r in result.results if r.status in FAILING]
            failures.extend({"backend": r.backend, "status": r.status.value,
                             "case": fitted.case.to_dict(), "message": message,
                             "profile": profile, "family": family}
                            for r, message in zip(failed, result.failure_messages(),
                                                  strict=True) if r.backend in new)
            return [(r.backend, r.comparison.max_ratio) for r in result.results
                    if r.comparison is not None]

        start = time.perf_counter()
        if profile == "derandomized":
            runs = capabilities.fit_all(generated_cases(examples, seed, strategy))
            drawn_seconds = time.perf_counter() - start
            for fitted in runs:
                run(fitted)
        else:
            _search(profile, examples, seed, strategy(), capabilities, run)
            drawn_seconds = 0.0  # drawn between the runs
        return {"records": [r.to_dict() for r in session.records], "failures": failures,
                "known": known,
                "lines": capabilities.lines(), "examples": capabilities.examples,
                "unfit": capabilities.examples_unfit, "drawn_seconds": drawn_seconds,
                "profile": profile, "family": family, "seed": seed}


def _search(profile: str, examples: int, seed: int, strategy: Any, capabilities: Any,
            run: Any) -> None:
    """``tests/test_differential.py``'s search under the ``difftest-<profile>`` settings
    (``examples`` examples, no example database, ``@seed(seed)``): each example fitted and
    run, each backend's error/tolerance targeted."""
    import math

    from hypothesis import given, target
    from hypothesis import seed as hypothesis_seed
    from hypothesis import settings as hypothesis_settings

    from difftest.frontends.pytest_run import register_profiles

    register_profiles()

    @hypothesis_seed(seed)
    @hypothesis_settings(hypothesis_settings.get_profile(f"difftest-{profile}"),
                         max_examples=examples, database=None)
    @given(strategy)
    def search(case: Any) -> None:
        for fitted in capabilities.fit_all([case]):
            for backend, ratio in run(fitted):
                if math.isfinite(ratio):
                    target(ratio, label=f"error/tolerance {backend}")

    search()


PROFILES = ("derandomized", "dev", "nightly")


def _names_of(allowed: Sequence[str]) -> Any:
    """argparse type: comma-separated names out of ``allowed``."""
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"{text!r}: allowed {', '.join(allowed)} "
                                             "(comma-separated)")
        return names
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stretch; exit 1 on any false positive or blind spot."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.false_positives",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", type=int, default=16,
                        help="draw the examples in this many parts, part i of the j-th "
                        "profile under seed + j * parts + i")
    parser.add_argument("--backends", type=split_names, default=list(DEFAULT_BACKENDS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--max-topk", type=int, default=4)
    parser.add_argument("--profiles", type=_names_of(PROFILES), default=["derandomized"],
                        help="comma-separated: derandomized, dev, nightly (module docstring)")
    parser.add_argument("--families", type=_names_of(FAMILIES), default=["sparse"],
                        help="comma-separated case families drawn: sparse, dense "
                        "(default: sparse)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = devices.resolve(args.device)
    devices.prepare_runtime(device)
    import torch

    from difftest.contract.registry import discover, select
    from difftest.judgement.audit import audit_lines, blind_spots

    # resolved before the hour of work, from the code the workers will import
    backends = [b for b in select(discover(), args.backends) if b.availability().available]
    start = time.perf_counter()
    sizes = [len(range(i, args.examples, args.parts)) for i in range(args.parts)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context,
                                                initializer=_prepare_worker,
                                                initargs=(device, args.workers)) as pool:
        futures = [pool.submit(run_part, size, args.seed + j * args.parts + i, args.backends,
                               device, args.max_batch, args.max_topk, profile, family)
                   for family in args.families for j, profile in enumerate(args.profiles)
                   for i, size in enumerate(sizes) if size]
        parts = []
        for future in futures:  # each part on disk as it ends: a late failure loses nothing
            parts.append(future.result())
            if args.json:
                with open(f"{args.json}.parts", "a") as log:
                    log.write(json.dumps(parts[-1]) + "\n")
    wall = time.perf_counter() - start

    records = [r for part in parts for r in part["records"]]
    failures = [f for part in parts for f in part["failures"]]
    known = [k for part in parts for k in part["known"]]
    met = Counter((k["family"], k["profile"], k["backend"]) for k in known)
    examples = sum(part["examples"] for part in parts)
    unfit = sum(part["unfit"] for part in parts)
    statuses = Counter((r["backend"], r["status"]) for e in records for r in e["results"])
    names = sorted({backend for backend, _ in statuses})
    per_profile = Counter((part["family"], part["profile"], r["backend"], r["status"])
                          for part in parts for e in part["records"] for r in e["results"])
    found = Counter((f["family"], f["profile"], f["backend"]) for f in failures)
    blind = [f"{c.backend}: {c.argument}" for c in blind_spots(records, backends)]
    generation = [f"{part['family']} {part['profile']} (seed {part['seed']}): {line}"
                  for part in parts for line in part["lines"]]
    generation.append(f"examples some backend could not run, all parts: {unfit} of {examples} "
                      f"({unfit / max(examples, 1):.1%})")
    for line in generation:
        print(f"generation: {line}")
    print("\n".join(audit_lines(records, backends)))
    print(f"{'family':<7} {'profile':<13} {'backend':<24} {'runs':>6} {'agree':>6} "
          f"{'unsupp.':>7} {'known bugs':>10} {'false positives':>15}")
    table: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for family in args.families:
        for profile in args.profiles:
            for backend in names:
                count = {s: n for (f, p, b, s), n in per_profile.items()
                         if (f, p, b) == (family, profile, backend)}
                table.setdefault(family, {}).setdefault(profile, {})[backend] = count | {
                    "known bugs": met[family, profile, backend],
                    "false positives": found[family, profile, backend]}
                print(f"{family:<7} {profile:<13} {backend:<24} {sum(count.values()):>6} "
                      f"{count.get('agree', 0):>6} {count.get('unsupported', 0):>7} "
                      f"{met[family, profile, backend]:>10} "
                      f"{found[family, profile, backend]:>15}")
    by_profile: Counter[str] = Counter()
    for part in parts:
        by_profile[f"{part['family']} {part['profile']}"] += part["examples"]
    for failure in failures:
        print(f"FALSE POSITIVE {failure['backend']} {failure['status']}: "
              f"{json.dumps(failure['case'], sort_keys=True)}\n{failure['message']}")
    print(f"blind spots: {', '.join(blind) or 'none'}")
    findings = Counter(k["finding"] for k in known)
    print(f"known kernel bugs met (docs/findings.md; not false positives): "
          f"{', '.join(f'{f} x{n}' for f, n in sorted(findings.items())) or 'none'}")
    print(f"{len(failures)} false positives in {examples} examples ("
          f"{', '.join(f'{p} {n}' for p, n in by_profile.items())}) "
          f"({len(records)} fitted runs; {args.parts} parts from seed {args.seed}; max batch "
          f"{args.max_batch}, max top-k {args.max_topk}) on {', '.join(names)}; drawing "
          f"{sum(p['drawn_seconds'] for p in parts):.0f} s summed over parts, wall {wall:.0f} s "
          f"on {device} ({os.cpu_count()} cores, {args.workers} workers, "
          f"{platform.platform()}, Python {platform.python_version()}, torch "
          f"{torch.__version__})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"examples": examples, "families": table, "parts": args.parts,
                       "seed": args.seed,
                       "runs": len(records), "backends": names, "generation": generation,
                       "statuses": {f"{b} {s}": n for (b, s), n in sorted(statuses.items())},
                       "false_positives": failures, "known_bugs": known,
                       "blind_spots": blind,
                       "wall_seconds": wall, "command": " ".join(sys.argv)}, fh, indent=1)
    return 1 if failures or blind else 0


if __name__ == "__main__":
    sys.exit(main())
