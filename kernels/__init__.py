"""pdserve.kernels: attention and KV-cache kernels (torch reference, CPU extension, GPU)."""
