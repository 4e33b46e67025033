"""The cache object a forward of the walk hands to a ``transformers`` model, and what it records.

Two words, used throughout the walk:

* a *layer type* is transformers' per-layer string (``"full_attention"``, ``"sliding_attention"``,
  ``"linear_attention"``, ``"conv"``, ...), read from the config the way transformers builds its caches
  (:func:`trl_dta.walk.adapter.checks.layer_types` for the attention pattern);
* a *cache kind* is what the walk keeps for a layer (:func:`cache_kinds`): ``"attention"`` (K/V),
  ``"state"`` (conv / recurrent states), ``"hybrid"`` (both, e.g. Falcon-H1) or ``"none"`` (no cache).

A forward attends to the K/V of every segment on its path, which live in the walk's
:class:`~trl_dta.walk.path_kv.PathKV`, and starts from the states the last forwarded segment left. The model
writes its new K/V and states through the cache API; :class:`RecordingCache` records them per layer as a
:data:`LayerCache`.

States go through transformers' own state API (``get_conv_state``, ``update_recurrent_state``, ...), so the
model's own kernels run (PyTorch fallbacks on CPU; flash-linear-attention / causal-conv1d / mamba-ssm on GPU,
which take an initial state): a conv state is the last kernel-width inputs, joined with the new ones; a
recurrent state is handed in as the kernel's initial state, and its final state is recorded.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # transformers < 5.23: no layer type "dummy", so no cache kind "none" (cache_kinds)
    DummyLayer = None

from ..errors import UnsupportedModelError
from ..path_kv import PathKV

# What a forward leaves to the tokens after it, per layer, every tensor [B, ...] (batch first):
# * attention layers: "k", "v" [B, kv_heads, L, head_dim], the new tokens' K/V (also written into the walk's
#   PathKV, where later forwards read them);
# * state layers (linear attention, state-space, short convolutions): the layer's states after the last
#   token, "conv0", "recurrent0" (more indices if the layer keeps several), in transformers' cache layout
#   (a later forward starts from the last segment's states only);
# * hybrid layers: both.
LayerCache = dict[str, torch.Tensor]

KV = ("k", "v")

_CACHE_KINDS = {"conv": "state", "linear_attention": "state", "hybrid": "hybrid", "hybrid_sliding": "hybrid"}


# transformers' state API (get_conv_state, get_recurrent_state, ...), through which the walk hands a segment's
# conv / recurrent states to the next: new in transformers 5.21. Before it, models that read a carried state
# (Qwen3.5's Gated DeltaNet, Mamba2) read the cache's layers, which the walk does not fill: the construction
# probe refuses them, naming this version (:mod:`trl_dta.walk.adapter.probe`); models that only write states
# through ``update_conv_state`` (LFM2) walk exactly there too.
STATE_API_VERSION = "5.21"
HAS_STATE_API = hasattr(Cache, "get_recurrent_state")


def cache_kinds(config) -> list[str]:
    """Per layer, its cache kind (see the module docstring), read the way transformers builds a model's
    cache."""
    types, _ = get_layer_types_and_kwargs(config)
    return [_CACHE_KINDS.get(t, "none" if t == "dummy" else "attention") for t in types]


def states_of(caches: list[LayerCache]) -> list[LayerCache]:
    """The state entries of per-layer caches (everything but K/V, which the walk keeps in its PathKV)."""
    return [{k: t for k, t in layer.items() if k not in KV} for layer in caches]


def expand_states(states: list[LayerCache] | None, rows: int) -> list[LayerCache] | None:
    """States seen by ``rows`` rows at once (a batch of sibling leaves): every tensor expanded, no copy."""
    if not states:
        return states
    return [{k: t.expand(rows, *t.shape[1:]) for k, t in layer.items()} for layer in states]


class PathLayer(DynamicLayer):
    """One attention layer of a walk's cache: the path's K/V are the positions below ``past_length`` of the
    walk's buffer for this layer; the new tokens' K/V are written there too (:meth:`PathKV.join`), so the
    past is never copied for a one-row forward."""

    def __init__(self, kv: PathKV, index: int, past_length: int):
        super().__init__()
        self.kv, self.index, self.past_length = kv, index, past_length

    def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
        # (transformers' makes empty tensors from Python lists: a host-device copy per layer and call)
        self.device, self.is_initialized = key_states.device, True
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.kv.join(self.index, key_states, value_states, self.past_length)
        self.past_length = self.keys.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.past_length


class StatePathLayer(PathLayer, LinearAttentionCacheLayerMixin):
    """A layer with conv / recurrent states (and K/V if it also attends): transformers' state API for them is
    answered by :class:`RecordingCache` itself, from the last segment's states."""

    def __init__(self, kv: PathKV, index: int, past_length: int):
        PathLayer.__init__(self, kv, index, past_length)
        LinearAttentionCacheLayerMixin.__init__(self)
        self.record_past = True  # keeps models off their in-place single-token conv update

    def lazy_initialization(self, *args, **kwargs):  # K/V only: states never go through the layer
        if len(args) == 2:
            PathLayer.lazy_initialization(self, *args)

    def update_conv_state(self, *args, **kwargs):  # pragma: no cover - the cache answers these
        raise NotImplementedError

    update_recurrent_state = update_conv_state


class RecordingCache(DynamicCache):
    """The cache one forward of the walk runs on: the path's K/V (in ``kv``) and the states the last
    forwarded segment left (``states``, per layer, ``None`` at the root); records what each layer writes
    (:attr:`new`: new K/V, new states).

    States are handed to the model as fresh copies (autograd still reaches the segment they came from), so a
    model that updates a state it was given in place never touches the path's tensors."""

    def __init__(self, states: list[LayerCache] | None, kinds: list[str], start: int, kv: PathKV):
        layers = []
        self.incoming: list[LayerCache] = list(states) if states else [{} for _ in kinds]
        for i, kind in enumerate(kinds):
            if kind == "attention":
                layers.append(PathLayer(kv, i, start))
            elif kind in ("state", "hybrid"):
                layers.append(StatePathLayer(kv, i, start))
            else:
                layers.append(DummyLayer())
        Cache.__init__(self, layers=layers)
        self.kinds = kinds
        self.new: list[LayerCache] = [{} for _ in kinds]
        self.handed: dict[tuple[int, str], torch.Tensor] = {}  # state copies given out, not written back
        self.handed_versions: dict[tuple[int, str], int] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new[layer_idx].update(k=key_states, v=value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # transformers' state API (linear attention, state-space and convolution layers)
    def _state(self, layer_idx: int, key: str) -> torch.Tensor | None:
        state = self.incoming[layer_idx].get(key)
        if state is None:
            return None
        copy = state.clone()
        self.handed[(layer_idx, key)] = copy
        self.handed_versions[(layer_idx, key)] = copy._version
        return copy

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._state(layer_idx, f"conv{state_idx}")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._state(layer_idx, f"recurrent{state_idx}")

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kw):
        key = f"conv{state_idx}"
        previous = self.incoming[layer_idx].get(key)
        full = conv_states
        if previous is not None:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], -1)
        width = conv_kernel_size or (conv_states.shape[-1] if previous is None else previous.shape[-1])
        if full.shape[-1] < width:  # as transformers keeps it: left-padded with zeros to the kernel width
            full = nn.functional.pad(full, (width - full.shape[-1], 0))
        self.new[layer_idx][key] = full[..., -width:]
        self.handed.pop((layer_idx, key), None)
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        key = f"recurrent{state_idx}"
        self.new[layer_idx][key] = recurrent_states
        self.handed.pop((layer_idx, key), None)
        return recurrent_states

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return any(self.incoming)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # models then run their multi-token path, which calls update_conv_state

    def finish(self, name: str) -> None:
        """States a model read and updated in place (as decode kernels do; the walk never runs those, but a
        model's multi-token path might) without writing them back are the new states; a state read and
        neither written back nor updated is refused."""
        for (layer_idx, key), copy in self.handed.items():
            if copy._version == self.handed_versions[(layer_idx, key)]:
                raise UnsupportedModelError(
                    f"{name}: layer {layer_idx} read its {key} state from the cache but neither wrote a new "
                    "one through the cache API nor updated it in place; the tree walk cannot carry its state."
                )
            if copy.requires_grad and copy.grad_fn is not None and "Clone" in type(copy.grad_fn).__name__:
                raise UnsupportedModelError(
                    f"{name}: layer {layer_idx} updated its {key} state in place with a kernel autograd does "
                    "not see (e.g. an inference-only decode kernel): gradients through the state would be "
                    "lost. Not supported with this kernel; uninstall it to use transformers' PyTorch path."
                )
            self.new[layer_idx][key] = copy

    def check_written(self, name: str, keyword: str) -> None:
        """Refuse a forward (of model ``name``, its cache passed as ``keyword``) whose layers did not write
        through this cache what the walk carries."""
        if not any(self.new):
            raise UnsupportedModelError(
                f"{name} ignores the passed KV cache (keyword {keyword!r}); the tree walk "
                "needs a model that attends to a given past."
            )
        carried = torch.is_grad_enabled() and any(t.requires_grad for s in self.incoming for t in s.values())
        for i, (kind, new) in enumerate(zip(self.kinds, self.new, strict=True)):
            # a recurrent state always depends on the one it started from: no graph means no backward
            lost = [k for k, t in new.items() if k.startswith("recurrent") and not t.requires_grad]
            if lost and carried:
                raise UnsupportedModelError(
                    f"{name}: layer {i} returned its {lost[0]} state without an autograd graph (a "
                    "kernel without backward): gradients through the state would be lost; not supported "
                    "with this kernel."
                )
            if kind in ("attention", "hybrid") and "k" not in new:
                raise UnsupportedModelError(
                    f"{name}: layer {i} wrote no K/V to the passed cache; models that share or skip K/V "
                    "across layers are not supported."
                )
            if kind in ("state", "hybrid") and not set(new) - set(KV):
                raise UnsupportedModelError(
                    f"{name}: layer {i} keeps a recurrent or convolution state but wrote none through "
                    "transformers' cache API (update_conv_state / update_recurrent_state); not supported."
                )
