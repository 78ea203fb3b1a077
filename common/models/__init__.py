"""Model definitions: our own forward passes, one module per architecture family."""
