"""Helpers of the recipes in this folder, not of the library: the τ² RL recipes' arguments and logging
(``arguments``), the offline SmolLM2 model (``offline_model``), reward functions by name (``rewards``), the
reward-curve plot (``plotting``), the warm start (``warm_start``) and held-out evaluation (``evaluation``). A
recipe run as a script has this folder on ``sys.path``, so it imports them as ``recipe_utils.<module>``; the
tests do the same (pytest's ``pythonpath`` in pyproject.toml)."""
