"""How a call of the walk attends: each segment of a call only the keys it sees.

``kernel.py`` (the attention-kernel interface the dispatch, the plan, the memory model and the cost model
ask), ``kernels.py`` (which kernel a model gets), then a kernel per file: ``sdpa.py`` (sdpa per segment,
any device), ``varlen.py`` (what the flash varlen kernels share), ``torch_varlen.py`` (torch's, CUDA),
``flash_attn_varlen.py`` (flash-attn's, CUDA), ``masked.py`` (the model's own attention with the walk's
masks), ``flex.py`` (flex attention's tiles); ``check.py`` (a kernel checked once against sdpa),
``segment_attention.py`` (the function registered in transformers' ``AttentionInterface``: it runs the call's
kernel), ``segment_layout.py`` (one call's segments as a variable-length kernel takes them), ``packing.py``
(a packed row's index tensors and its tree-shaped mask).
"""
