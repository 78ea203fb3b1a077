"""The parts of `benchmarks/gpu_check.py`, one module each (environment, kernels, engine,
speed, disaggregation, expert_parallel), the fork-per-part runner and the carried payload
(`payload.py`: wheels, tokenizer files and gRPC stubs for a GPU machine without network)."""
