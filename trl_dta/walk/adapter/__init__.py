"""What the walk needs from a Hugging Face causal LM, and what it refuses.

``model.py`` (:class:`CausalLM`: a decoder forward on a cached path, the output head), ``cache.py`` (the cache
object a forward hands to the model, and what it records), ``checks.py`` (which models the walk computes
exactly), ``determinism.py`` (randomness: found, turned off, or refused), ``probe.py`` (the construction
probe: the walk's own operations on a tiny input against the model's dense forward), ``preflight.py`` (every
refusal that needs no sequence, before the first walk).
"""
