"""A value model trained beside the policy (``value_model=`` of :class:`~trl_dta.TreePPOTrainer` and
:class:`~trl_dta.AsyncTreePPOTrainer`): PPO with a critic.

``value_model.py`` (:class:`~trl_dta.train.critic.value_model.ValueModel`: the object the trainers call, its
walks, optimizer and checkpoints, and the Trainer hooks that reach it), ``args.py`` (its options,
:class:`~trl_dta.train.critic.args.ValueArguments`), ``gae.py`` (GAE over the policy's own tokens,
whitening, the clipped value loss), ``model.py`` (loading it, building one from the policy, its weights).
"""
