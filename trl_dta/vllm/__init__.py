"""vLLM generation for the trainers (TRL's ``use_vllm=True``, colocate or server): :class:`VLLMMixin`
(``trainer.py``) and the CPU backend's narrow path (``cpu.py``). Importing this package does not import
vLLM."""

from .trainer import VLLMMixin

__all__ = ["VLLMMixin"]
