"""What a model call costs, so that the plan can decide which calls to merge.

``costs.py`` (:class:`CallCost`: a call's time from its tokens and attention pairs, the shipped constants per
device kind), ``cost_model.py`` (the constants fitted online to the walk's own timed calls), ``cost_fit.py``
(the fit, non-negative least squares), ``cost_cache.py`` (fitted constants kept between runs), ``flops.py``
(the FLOP-weighted ideal speedup of a walk).
"""
