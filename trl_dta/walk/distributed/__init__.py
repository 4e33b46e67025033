"""The walk on a sharded model: every rank's collectives matched, parameters gathered and gradients reduced
once per walk (or per layer).

``sharding.py`` (FSDP2: gather once, or per layer), ``lockstep.py`` (per-layer gathering with every rank's
calls in step), ``deepspeed.py`` (DeepSpeed ZeRO-2/3), ``ranks.py`` (what the ranks agree on: how many they
are, how each one's walk ended).
"""
