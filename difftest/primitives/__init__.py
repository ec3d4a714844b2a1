"""Numbers, random streams, strict JSON files, signals, CUDA-graph replay: no difftest imports."""
