"""The machine a run is on: GPUs present and visible, the device, worker pinning, Triton's
interpreter, the environment fingerprint."""
