"""The walk: forward and backward of every sequence of a prefix trie through a causal LM, each shared prefix
once. It knows nothing of TRL.

Read in this order: ``plan.py`` (the schedule of pushes, leaf batches, packed subtrees and pops, from the trie
alone), ``executor.py`` (:class:`TreeExecutor`, the loop that runs a plan), ``state.py`` (what one walk
keeps: its stack of frames), ``forwards.py`` (one step's model call: a segment, sibling leaves padded or
packed), ``scoring.py`` (which positions get the LM head, a sequence's log-probs along the stack),
``heads.py`` (what a scored position gives: log-probs, values, or the hidden states for a loss that applies
the output head itself),
``router.py`` (MoE router terms). The model side: ``model.py`` (:class:`CausalLM`, the adapter over a
``transformers`` model), ``cache.py`` (the cache object the model writes into), ``path_kv.py`` (the path's
K/V in one buffer per layer), ``packing.py`` (positions and mask of a packed row), ``checks.py``,
``determinism.py`` and ``probe.py`` (what is refused, randomness, and the construction probe),
``preflight.py`` (every refusal that needs no sequence, run before the first walk),
``errors.py`` (:class:`UnsupportedModelError`, out-of-memory errors). Around the walk: ``budgets.py``
(:class:`~trl_dta.walk.budgets.Budgets`: the token budgets, from a memory budget, halved and grown back),
``memory_budget.py`` (the memory budget as users type it: "auto", None, "8GiB", "80%"),
``costs.py`` (what a call costs: which calls the plan merges), ``recovery.py`` (a walk that runs out of
memory, walked again with halved budgets), ``peak.py`` (the memory a walk peaks at), ``sharding.py`` and
``lockstep.py`` (FSDP2: gather once, or per layer with every rank's calls in step), ``flops.py`` (the
FLOP-weighted ideal speedup).
"""

from __future__ import annotations

from .errors import UnsupportedModelError
from .executor import TreeExecutor

__all__ = ["TreeExecutor", "UnsupportedModelError"]
