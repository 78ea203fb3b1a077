"""The prefill worker: computes prompts, returns each one's first token and a handle to its
KV blocks, and sends those blocks to the decode worker that pulls them."""
