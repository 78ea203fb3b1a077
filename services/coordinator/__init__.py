"""The coordinator: the public `GenerateService`. It validates and tokenizes each request,
routes it through a prefill worker then a decode worker (or one colocated worker), and
relays the tokens back as they come."""
