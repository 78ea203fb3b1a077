"""pdserve.services: the processes (CLI, offline generation; coordinator, prefill, decode)."""
