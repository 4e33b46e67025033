"""The walk: forward and backward of every sequence of a prefix trie through a causal LM, each shared prefix
once. It knows nothing of TRL.

Read its core first, at this folder's root: ``plan.py`` (the schedule of pushes, leaf batches, packed
subtrees and pops, from the trie alone), ``executor.py`` (:class:`TreeExecutor`, the loop that runs a plan),
``state.py`` (what one walk keeps: its stack of frames), ``steps.py`` (each step run on a walk),
``forwards.py`` (one step's model call: a segment, sibling leaves padded or packed), ``inputs.py`` (every
call's index tensors, copied once), ``path_kv.py`` (the path's K/V in one buffer per layer), ``scoring.py``
(which positions get the output head, a sequence's outputs along the stack), ``heads.py`` (what a scored
position gives: log-probs, values, or the hidden states for a loss that applies the output head itself),
``router.py`` (MoE router terms), ``call_checks.py`` and ``errors.py``. Then a folder per concern, each
``__init__.py`` saying what is in it: ``attention/`` (how a call attends: the kernel interface, a kernel
per file, a packed row's mask), ``memory/`` (budgets, the memory model, running out of memory, the peak),
``cost/`` (what a call costs, fitted online), ``distributed/`` (FSDP2 and DeepSpeed), ``adapter/`` (the
model adapter, its cache, what is refused, the construction probe).
"""

from __future__ import annotations

from .errors import UnsupportedModelError
from .executor import TreeExecutor

__all__ = ["TreeExecutor", "UnsupportedModelError"]
