""":class:`AsyncTreePPOTrainer`: TRL's ``AsyncGRPOTrainer`` trained on one prefix trie of each optimizer
step's samples.

``config.py`` (:class:`AsyncTreePPOConfig` and its checks), ``trainer.py`` (TRL's hooks), ``data.py``
(TRL's rollout queue as micro-batches, none dropped), ``loss.py`` (TRL's asynchronous loss per sample,
AReaL's decoupled objective), ``metrics.py`` (TRL's per-micro-batch metrics from the walk's values),
``values.py`` (a value model's targets on the step's samples). The package imports nothing itself: TRL's
asynchronous trainer needs the ``async`` extra, and ``trl_dta.AsyncTreePPOTrainer`` imports it when used.
"""
