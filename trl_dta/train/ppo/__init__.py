""":class:`TreePPOTrainer`: TRL's ``GRPOTrainer`` trained on one prefix trie of each optimizer step's
rollouts.

``config.py`` (:class:`TreePPOConfig`), ``trainer.py`` (TRL's hooks), ``sequences.py`` (a step's TRL
micro-batches as trie sequences, and the walk's values back in TRL's shapes), ``losses.py`` (TRL's loss per
row), ``rows.py`` (a TRL batch's rows as token sequences; batches merged and re-cut row-wise),
``repartition.py`` (a step's rollouts re-split across ranks).
"""
