"""How a call of the walk attends: each segment of a call only the keys it sees.

``segment_attention.py`` (the attention function registered in transformers' ``AttentionInterface``, and its
dispatch), ``segment_layout.py`` (one call's segments as a variable-length kernel takes them, and the sdpa
kernels on them), ``flash.py`` (torch's flash varlen kernel on CUDA, checked against sdpa), ``packing.py``
(a packed row's index tensors and its tree-shaped mask, for the model's own attention).
"""
