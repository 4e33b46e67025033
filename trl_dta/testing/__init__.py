"""Tiny offline fixtures shared by the tests and the benchmarks (as ``accelerate.test_utils`` is for
accelerate): ``grpo.py``, a scripted offline ``GRPOTrainer`` setup (tiny Qwen3, a tokenizer trained on the
fly, scripted multi-turn tool rollouts), and ``memory.py``, a meter of the tensors autograd saves. Nothing
here is imported by the library itself, and nothing here downloads anything."""
