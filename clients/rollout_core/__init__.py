"""The rules the server runs and a trainer replays, in one place: the step math and its sampler
registry (``steps``), the noise rule (``noise``), the transformer call and guidance (``transformer_call``)
and tensors on the wire (``codec``, with the one dtype table).

Imports torch, safetensors and the generated ``rollout.v1`` messages, never diffusers or grpc.
"""
