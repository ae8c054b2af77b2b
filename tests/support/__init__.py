"""What the tests share, by concern; the fixtures built from it live in tests/conftest.py.

- ``servers``: real servers forked from the preloaded fork server (``forked``), examples and the command
  line run in this process, logs, metrics and memory;
- ``requests``: request builders, conditioning images, a stream split by event type;
- ``families``: the family table (``FAMILIES``, keyed by family name, of ``family_spec.Family`` rows)
  and each family's request;
- ``parity``: comparisons across paths and replay parity; ``reference``: the float64 step formulas;
- ``adapters``: an adapter's transformer called by hand;
- ``weights``: weight updates; ``errors``: gRPC errors and grpcurl; ``sglang``: SGLang's released code.
"""
