""":class:`TreeSFTTrainer`: TRL's ``SFTTrainer`` trained on one prefix trie of each optimizer step's samples.

``config.py`` (:class:`TreeSFTConfig`), ``trainer.py`` (TRL's hooks), ``samples.py`` (TRL's SFT batches as
samples: padded, padding-free and packed rows).
"""
