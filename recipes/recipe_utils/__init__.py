"""Helpers of the recipes in this folder, not of the library: the offline SmolLM2 model (``offline_model``),
reward functions by name (``rewards``) and the reward-curve plot (``plotting``). A recipe run as a script has
this folder on ``sys.path``, so it imports them as ``recipe_utils.<module>``; the tests do the same (pytest's
``pythonpath`` in pyproject.toml)."""
