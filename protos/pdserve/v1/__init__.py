"""The wire contract's Python stubs (`pdserve.v1`), generated next to the .proto files by
`make protos`; nothing here is edited by hand."""
