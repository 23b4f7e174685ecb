"""Models written with ``dtorch.nn``, laid out by their device mesh: one program on one device
or any mix of data, tensor, pipeline and context parallelism.

- ``dtorch.models.llama``: ``LlamaForCausalLM``, equal to HF transformers' on the same weights.
"""
