"""The rules the server runs and a trainer replays, in one place: the step math and its sampler
registry (``steps``), the noise rule (``noise``), the transformer call and guidance (``transformer_call``),
tensors on the wire (``codec``, with the one dtype table) and the names of everything streamed or saved
(``wire``); what else both ends agree on: the metadata names and token files (``transport``), the shapes
task's scenes (``scenes``) and how a process starts a server of its own (``local_server``). The server
and the client library import this package, and nothing of each other.

Imports torch, safetensors, numpy, PIL and the generated ``rollout.v1`` messages, never diffusers or grpc.
"""
