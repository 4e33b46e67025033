"""The peer benchmark's pieces; ``benchmarks/peers.py`` is its entry point (command line, run loop).

* ``workloads.py``: the random-weight Qwen3 models and one optimizer step's rollouts per shape;
* ``context.py``: what every method shares: the model and its attention switch, the GRPO loss, padding;
* ``methods.py``: the methods by name (``METHODS``, ``RUNNERS``): dense ± checkpointing and the walk;
* ``prefix_grouping.py``: PrefixGrouper, and the bottom-right causal sdpa kernel it needs;
* ``tree_mask.py``: packed tree attention (unique tokens in one row, an ancestor mask);
* ``measure.py``: a metered run per method, the gradient check, the timed rounds;
* ``trainer_step.py``: where one TreePPOTrainer step spends its time (needs TRL);
* ``report.py``: tables, the result files and the plots.

Modules here import ``common`` (``benchmarks/common.py``) as a top-level module: ``benchmarks/`` is on
``sys.path`` when a script there runs, and on pytest's ``pythonpath``.
"""
