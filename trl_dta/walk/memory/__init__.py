"""The memory a walk may use and what it uses: the token budgets and running out of memory.

``memory_budget.py`` (the budget as users type it: "auto", "8GiB", "80%"), ``memory_model.py`` (the bytes a
walk holds per token, the budgets that fit, a plan's peak on paper), ``budgets.py`` (:class:`Budgets`: the
budgets derived per trie, halved after running out of memory and grown back), ``recovery.py`` (a walk that
runs out of memory, walked again with halved budgets), ``peak.py`` (the memory a walk peaks at).
"""
