"""The rules the server runs and a trainer replays, in one place: the step math and its sampler
registry (``steps``), the noise rule (``noise``), the transformer call and guidance (``transformer_call``),
tensors on the wire (``codec``, with the one dtype table) and the names of everything streamed or saved
(``wire``).

Imports torch, safetensors and the generated ``rollout.v1`` messages, never diffusers or grpc.
"""
