"""False positives: correct backends on a long derandomized stretch of fitted examples.

    python -m benchmarks.false_positives --examples 2000 --workers 2 --json fp.json
    python -m benchmarks.false_positives --examples 100 --backends triton-unified

The examples are what ``difftest run`` draws (:class:`difftest.cases.capabilities.
Capabilities`: every dtype combination and kernel mode some chosen backend runs, each example
fitted to every backend), with a smaller geometry by default (``--max-batch 2 --max-topk 4``)
so that thousands fit in minutes on a CPU. Every backend is correct, so any disagreement,
error or crash is a false positive: it is printed with its case JSON and the exit status is 1.
The parameter audit of the stretch (:mod:`difftest.audit`) is printed too, and its blind spots
(an argument a backend accepts that took a single value) also fail the run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from difftest import devices
from difftest.registry import split_names

DEFAULT_BACKENDS = ("triton-unified", "vllm-triton-sparse", "aiter-gluon@emulated",
                    "vllm-aiter@emulated")
CHUNKS_PER_WORKER = 8


def _prepare_worker(device: str, workers: int) -> None:
    devices.prepare_runtime(device)
    devices.share_cpu_threads(workers)


def _run_chunk(runs: list[tuple[str, tuple[str, ...]]], names: tuple[str, ...],
               device: str) -> list[dict[str, Any]]:
    """Run ``(case JSON, backends)`` pairs in this process; their records as dicts."""
    import tempfile

    from difftest.case import Case
    from difftest.session import Session

    with tempfile.TemporaryDirectory() as artifacts:
        session = Session.create(names, device=device, artifacts=artifacts)
        for case_json, backends in runs:
            session.run(Case.from_json(case_json), backends)
        return [record.to_dict() for record in session.records]


def stretch(examples: int, seed: int, names: Sequence[str], device: str, max_batch: int,
            max_topk: int) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """The fitted runs of ``examples`` derandomized examples, and generation's summary lines."""
    import torch
    from difftest.cases.capabilities import Capabilities
    from difftest.cases.generate import generated_cases

    from difftest.registry import discover, select

    backends = [b for b in select(discover(), list(names)) if b.availability().available]
    capabilities = Capabilities.probe(backends, torch.device(device))
    drawn = generated_cases(examples, seed, capabilities.strategy(max_batch=max_batch,
                                                                  max_topk=max_topk))
    runs = [(f.case.to_json(), f.backends) for f in capabilities.fit_all(drawn)]
    return runs, capabilities.lines()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stretch; exit 1 on any false positive or blind spot."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.false_positives",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", type=split_names, default=list(DEFAULT_BACKENDS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--max-topk", type=int, default=4)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = devices.resolve(args.device)
    devices.prepare_runtime(device)
    start = time.perf_counter()
    runs, generation = stretch(args.examples, args.seed, args.backends, device,
                               args.max_batch, args.max_topk)
    drawn_seconds = time.perf_counter() - start
    names = tuple(sorted({n for _, backends in runs for n in backends}))
    chunk = max(1, -(-len(runs) // (CHUNKS_PER_WORKER * args.workers)))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context,
                                                initializer=_prepare_worker,
                                                initargs=(device, args.workers)) as pool:
        futures = [pool.submit(_run_chunk, runs[i: i + chunk], names, device)
                   for i in range(0, len(runs), chunk)]
        records = [r for f in futures for r in f.result()]
    wall = time.perf_counter() - start
    import torch

    from difftest.audit import audit_lines, blind_spots
    from difftest.registry import discover, select

    statuses: Counter[tuple[str, str]] = Counter()
    failures = []
    for entry in records:
        for result in entry["results"]:
            statuses[(result["backend"], result["status"])] += 1
            if result["status"] in ("disagree", "error", "crash"):
                failures.append({"backend": result["backend"], "status": result["status"],
                                 "case": entry["case"], "detail": result.get("detail", "")})
    backends = [b for b in select(discover(), list(names)) if b.availability().available]
    blind = [f"{c.backend}: {c.argument.name}"
             for c in blind_spots(records, backends, torch.device(device))]
    for line in generation:
        print(f"generation: {line}")
    print("\n".join(audit_lines(records, backends, torch.device(device))))
    for (backend, status), count in sorted(statuses.items()):
        print(f"{backend:<24} {status:<12} {count}")
    for failure in failures:
        print(f"FALSE POSITIVE {failure['backend']} {failure['status']}: "
              f"{json.dumps(failure['case'], sort_keys=True)}\n{failure['detail']}")
    print(f"blind spots: {', '.join(blind) or 'none'}")
    print(f"{len(failures)} false positives in {args.examples} derandomized examples "
          f"({len(runs)} fitted runs, seed {args.seed}, max batch {args.max_batch}, max top-k "
          f"{args.max_topk}) on {', '.join(names)}; drawn in {drawn_seconds:.0f} s, wall "
          f"{wall:.0f} s on {device} ({os.cpu_count()} cores, {args.workers} workers, "
          f"{platform.platform()})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"examples": args.examples, "seed": args.seed, "runs": len(runs),
                       "backends": list(names), "generation": generation,
                       "statuses": {f"{b} {s}": n for (b, s), n in sorted(statuses.items())},
                       "false_positives": failures, "blind_spots": blind,
                       "wall_seconds": wall, "command": " ".join(sys.argv)}, fh, indent=1)
    return 1 if failures or blind else 0


if __name__ == "__main__":
    sys.exit(main())
