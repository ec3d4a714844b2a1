"""What finding a backend that wrote into its inputs costs: a digest against a copy.

``python -m benchmarks.read_only [--mib N] [--device cpu|cuda]`` times, on a buffer the size
of a case's cache, :func:`difftest.run.read_only.digest` (taken before and after every
backend) against what a copy per backend would cost (a clone, then ``torch.equal`` after),
and prints the peak extra memory of each; on a GPU also torch's two reductions the digest's
one-read kernel replaces. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from difftest.run.read_only import WIDTH, digest


def _timed(fn: object, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Time a digest and a clone-and-compare of one buffer; print both."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="buffer size (MiB)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    buffer = torch.randn(args.mib << 18, device=device)  # float32: 4 bytes each
    taken = digest(buffer)
    copied = buffer.clone()
    seconds_digest = _timed(lambda: digest(buffer), args.repeats, device)
    seconds_copy = _timed(lambda: torch.equal(buffer.clone(), copied), args.repeats, device)
    extra = sum(t.numel() * t.element_size() for t in taken)
    print(f"{args.mib} MiB on {device}: digest {seconds_digest * 1e3:.2f} ms "
          f"({extra / 2**20:.2f} MiB kept); clone + torch.equal {seconds_copy * 1e3:.2f} ms "
          f"({args.mib} MiB kept per backend)")
    if device.type == "cuda":
        grid = buffer.view(torch.int64).view(-1, WIDTH)
        seconds_torch = _timed(lambda: (grid.sum(dim=1), grid.sum(dim=0)), args.repeats, device)
        print(f"  torch's row and column reductions of the same words: "
              f"{seconds_torch * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
