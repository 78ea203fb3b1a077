"""The decode worker: admits prefilled requests as blocks allow, pulls their KV from the
prefill worker over the KV transport, and continues them in its continuous batch."""
