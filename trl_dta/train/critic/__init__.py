"""A value model trained beside the policy (``value_model=`` of :class:`~trl_dta.TreePPOTrainer` and
:class:`~trl_dta.AsyncTreePPOTrainer`): PPO with a critic.

``args.py`` (its options, :class:`~trl_dta.train.critic.args.ValueArguments`), ``gae.py`` (GAE over the
policy's own tokens, whitening, the clipped value loss), ``model.py`` (loading it, building one from the
policy, its optimizer and checkpoint), ``hooks.py`` (the trainers' hooks).
"""
