"""Policy weight updates: what an update is, how it arrives, how it is checked and how it is applied.

An update is one of three kinds (rollout.v1 ``WeightsKind``):

* FULL: every tensor of the transformer's state dict, under its plain (checkpoint) name; the
  received tensors become the parameters' data (no copy; the old data is kept only until the update
  is complete, to restore it if a step fails); a loaded LoRA adapter is removed.
* SUBSET: some of those tensors, replaced the same way; the rest and any adapter stay.
* LORA: a PEFT LoRA adapter (``peft.get_peft_model_state_dict`` names) and its ``LoraConfig``, loaded
  through diffusers' PEFT integration on top of the base weights; it replaces the previous adapter.

One module per concern, in the order an update meets them:

* ``update``: the ``WeightUpdate`` record and its kinds;
* ``upload``: an UpdateWeights stream reassembled into tensors as its bytes arrive;
* ``payload``: the tensors of an HTTP ``update_weights_from_tensor`` body (safetensors bytes or
  SGLang's flattened bucket, never a pickle), assembled as an upload's are;
* ``files``: a LoadWeights path, resolved under the server's root and read;
* ``group``: an UpdateWeightsFromGroup manifest checked whole, then the trainer's broadcasts received
  on every rank;
* ``lora_config``: a LORA update's config JSON, checked against an allow-list;
* ``spec``: the checks against the loaded transformer, which touch no live tensor;
* ``ranks``: rank 0's update sent to the other sequence-parallel ranks, tensor by tensor;
* ``apply``: the checked update made the served weights.
"""
