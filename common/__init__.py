"""pdserve.common: the engine shared by prefill and decode workers."""
