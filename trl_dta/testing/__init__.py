"""Tiny offline fixtures shared by the tests and the benchmarks (as ``accelerate.test_utils`` is for
accelerate):

* ``grpo.py``: a scripted offline ``GRPOTrainer`` setup (tiny Qwen3, a tokenizer trained on the fly,
  scripted multi-turn tool rollouts);
* ``memory.py``: a meter of the tensors autograd saves;
* ``architectures.py``: a tiny random model of every causal-LM architecture of transformers;
* ``exactness.py``: the walk's log-probs and gradients against such a model's own dense forward/backward;
* ``flash_parity.py``: the flash path's bf16 exactness at a real shape (the GPU suite's first step; on a CPU
  with ``varlen.py``'s stand-in kernel);
* ``cpu_distributed.py``: a test device that makes accelerate prepare DeepSpeed and FSDP2 on CPU processes;
* ``torchrun.py``: launching a test's multi-process workers, and ending them without an abort at exit.

Nothing here is imported by the library itself, and nothing here downloads anything.

Who imports whom (no cycles): ``tests/`` and ``benchmarks/`` both import ``trl_dta.testing``; it imports
only ``trl_dta``. ``benchmarks/`` never imports ``tests/``. ``tests/`` imports ``benchmarks/`` only where a
test checks benchmark code (``tests/test_architectures.py``'s full sweep runs ``benchmarks/arch_sweep.py``;
``tests/test_peers_bench.py`` checks ``benchmarks/peer_bench/tree_mask.py``), through pytest's
``pythonpath``: a one-way edge.
"""
