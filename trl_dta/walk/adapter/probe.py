"""The construction probe: the walk's own operations on a tiny input, compared with the model's dense forward.

A 13-token sequence is cut the way the walk cuts a trie: a 6-token prefix forwarded as two segments (the
second on the first's K/V and states), then three sibling leaves of 2-4 tokens on the prefix, one by one and
as a padded batch, then packed into one row with a hand-made mask. Every forward runs as the walk runs it,
on a :class:`~trl_dta.walk.path_kv.PathKV`. What each comparison catches:

* two dense forwards of the same input: a model that draws random numbers in eval mode;
* the prefix's logits against a dense forward of a longer sequence: a model that is not causal;
* the first segment's logits: an LM-head transform the walk does not reproduce (a value model: its head's
  outputs against the model's own ``.logits``; a sequence-classification one is compared per token with its
  decoder's dense forward through the head, and that at the token it pools with its own ``.logits``);
* the second segment and the leaves: a cache the model ignores, a state it does not carry, anything that
  depends on how a sequence is cut into calls;
* packed leaves (only where packing is possible): a model that applies its own window or an attention bias
  built from key indices (ALiBi). Packing that differs is not refused: leaves are padded instead;
* attention per segment (sdpa models: :mod:`trl_dta.walk.attention.segment_attention`): the same calls again
(the
  prefix's two segments, each leaf alone, the leaves packed, a packed subtree), through the walk's attention
  function: a model with attention code of its own, or a variant the function does not apply. Where they
  differ or fail, the model's own attention runs with a mask instead.

Running out of memory anywhere in the probe is raised unchanged (:data:`~trl_dta.walk.errors.MEMORY_ERRORS`),
never reported as a refusal of the model or as packing that differs.

Tolerances are relative (:func:`trl_dta.compare.relative_error`) and per dtype: a structural mistake is
>= 1e-3, while HF computes eager softmax, RMSNorm and some attention variants in float32 even in a float64
model, which leaves ~1e-7 between two exact computations.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import transformers

from ...compare import relative_error
from ..attention.packing import PackedRow, packed_mask
from ..attention.segment_layout import SegmentLayout
from ..errors import MEMORY_ERRORS, UnsupportedModelError
from ..path_kv import PathKV
from .cache import HAS_STATE_API, STATE_API_VERSION, expand_states, states_of
from .determinism import check_deterministic

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# transformers' state-layer kernels (chunked delta rule, Mamba2 scan) compute in float32 even in a float64
# model: two exact computations of a float64 hybrid differ like float32 ones (~1e-5 over 13 tokens)
STATE_DTYPE_FLOOR = torch.float32

_SEQUENCE_LENGTH, _PREFIX, _SPLIT = 13, 6, 4  # the prefix is forwarded as [0, 4) then [4, 6)

# A trainer probes its models when it is built (preflight), and each executor, built at the first step, would
# probe again: a verdict kept by preflight is taken, once, by the next probe of the same model object.
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _walks_as(lm) -> tuple:
    """What a verdict holds for besides the model's code: its LM head (object, shape) and attention backend
    (the binding), its modules' count, its parameters' devices and dtypes, the LM head's precision, whether
    packing was tried."""
    placed = frozenset((p.device, p.dtype) for p in lm.model.parameters())
    return lm._bound, len(list(lm.model.modules())), placed, lm.lm_head_fp32, lm._may_pack, lm._may_segment


def keep_verdict(lm) -> None:
    """Keep the probe's verdict on ``lm`` (a probed :class:`~trl_dta.walk.adapter.model.CausalLM`:
    ``can_pack``,
    ``segment_attention``) for the next probe of its model."""
    _VERDICTS[lm.model] = (_walks_as(lm), (lm.can_pack, lm.segment_attention))


def kept_verdict(lm) -> tuple[bool, bool] | None:
    """The verdict kept for ``lm``'s model (whether packing is exact, whether attention per segment is), taken
    once; None if none was kept or the model no longer walks as probed (an LM head or attention backend
    replaced, modules added, moved, cast)."""
    kept = _VERDICTS.pop(lm.model, None)
    return kept[1] if kept is not None and kept[0] == _walks_as(lm) else None


@contextlib.contextmanager
def _unsupported_on_failure(name: str):
    """Turn a model's failure in a forward on the walk's cache into a refusal; the walk's own refusals and
    running out of memory pass unchanged."""
    try:
        yield
    except (UnsupportedModelError, *MEMORY_ERRORS):
        raise
    except Exception as e:
        raise UnsupportedModelError(
            f"{name} fails when run on a given KV cache ({type(e).__name__}: {e}). Models whose layers "
            "keep another state than K/V (state-space, linear attention), or that cannot take a cache, are "
            "not supported."
        ) from e


class _Probe:
    """The probe's input, its dense references and the walk's cache positions."""

    def __init__(self, lm):
        self.lm, self.name, self.device = lm, lm.name, lm.device
        dtype = lm.lm_head.weight.dtype
        self.tolerance = PROBE_TOLERANCE.get(dtype, 5e-2)
        if lm.has_states and dtype == torch.float64:
            self.tolerance = PROBE_TOLERANCE[STATE_DTYPE_FLOOR]
        self.where = f"(relative; tolerance {self.tolerance:g} for {dtype}, autocast off)"
        vocab = lm.vocab_size if lm.value_head else lm.lm_head.weight.shape[0]
        seq = ((torch.arange(_SEQUENCE_LENGTH, device=self.device) * 7919 + 11) % vocab).tolist()
        self.prefix, self.leaves = seq[:_PREFIX], [seq[6:8], seq[8:11], seq[9:13]]
        self.kv = PathKV(capacity=_PREFIX + sum(map(len, self.leaves)))

    def ids(self, tokens) -> torch.Tensor:
        return torch.tensor(tokens, device=self.device)[None]

    def dense(self, tokens) -> torch.Tensor:
        # the class's own forward: accelerate (mixed precision) and TRL (fused LM head) patch the instance's
        # forward, and accelerate's patch turns autocast back on inside it
        base = self.lm.base
        logits = type(base).forward(base, input_ids=self.ids(tokens), use_cache=False).logits
        if self.lm.value_head and logits.dim() == 2:  # a sequence-classification value model: [1, 1], pooled
            return self._pooled(tokens, logits[0])
        return logits[0].to(torch.float64)  # [L, V], or a value model's [L, 1]

    def _pooled(self, tokens, pooled) -> torch.Tensor:
        """Per-token values of a sequence-classification model: its decoder's dense forward through its head,
        whose value at the token the model pools (the last one that is not padding) must be ``pooled``."""
        decoder = self.lm.decoder
        hidden = type(decoder).forward(decoder, input_ids=self.ids(tokens), use_cache=False).last_hidden_state
        values = self.lm.logits(hidden, 1.0)[0].to(torch.float64)
        pad = getattr(self.lm.base.config, "pad_token_id", None)
        last = max((i for i, t in enumerate(tokens) if t != pad), default=0)
        err = relative_error(values[last], pooled.to(torch.float64))
        if not err <= self.tolerance:
            raise UnsupportedModelError(
                f"{self.name}: its decoder + value head differs from the value its own forward pools by "
                f"{err:.2e} {self.where}: the model transforms its values in a way the tree walk does not "
                "reproduce; not supported."
            )
        return values

    def logits(self, hidden) -> torch.Tensor:
        with _unsupported_on_failure(self.name):
            return self.lm.logits(hidden, 1.0)[0].to(torch.float64)

    def forward(self, ids, start: int, states, **packing):
        """The walk's forward of ``ids`` at ``start`` (a failure of the model there is a refusal)."""
        with _unsupported_on_failure(self.name):
            return self.lm.forward(ids, start, self.kv, states, **packing)


@torch.no_grad()
def probe(lm, try_packing: bool, try_segments: bool = False) -> tuple[bool, bool]:
    """Run the probe on ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`): raise
    :class:`UnsupportedModelError` naming the cause if an unpacked path differs from the dense forward;
    return whether packing sibling leaves is exact (tried only if ``try_packing``) and whether attention per
    segment is (only if ``try_segments``; packing is then exact too)."""
    p = _Probe(lm)
    try:
        dense_leaves = [p.dense(p.prefix + leaf) for leaf in p.leaves]
        dense_prefix = p.dense(p.prefix)
    except (UnsupportedModelError, *MEMORY_ERRORS):
        raise  # a refusal that names its cause (a pooled value); out of memory is not a refusal
    except Exception as e:
        raise UnsupportedModelError(
            f"{p.name}'s own forward fails on a plain input of token ids ({type(e).__name__}: {e}); "
            "not supported."
        ) from e
    # (eval mode: randomness here cannot be switched off by the caller)
    check_deterministic(p.lm.model, p.lm.base, p.device, p.name, exc=UnsupportedModelError)
    err = relative_error(dense_prefix, dense_leaves[0][:_PREFIX])
    if not err <= p.tolerance:
        raise UnsupportedModelError(
            f"{p.name} is not causal: its outputs at a position change with later tokens ({err:.2e} "
            f"{p.where}), as in an encoder or a model configured without a causal mask (e.g. "
            "is_decoder=False); not supported."
        )
    states = _check_segments(p, dense_prefix, dense_leaves)
    if try_segments and _segments_are_exact(p, dense_prefix, dense_leaves):
        return True, True
    return try_packing and _packing_is_exact(p, states, dense_leaves), False


def _check_segments(p: _Probe, dense_prefix, dense_leaves):
    """The prefix as two segments, then each leaf on it alone and in a padded batch; returns the states the
    prefix leaves (hybrid models)."""
    lm = p.lm
    hidden, first, _ = p.forward(p.ids(p.prefix[:_SPLIT]), 0, None)
    err = relative_error(p.logits(hidden), dense_prefix[:_SPLIT])
    if not err <= p.tolerance:
        head = "value head" if lm.value_head else "LM head (with the config's logit scale and soft-capping)"
        raise UnsupportedModelError(  # (benchmarks/arch_sweep.py sorts refusals by "transforms its logits")
            f"{p.name}: its decoder + {head} differs from the dense forward by {err:.2e} {p.where}: the "
            f"model transforms its {'values' if lm.value_head else 'logits'} in a way the tree walk does not "
            "reproduce; not supported."
        )
    hidden, second, _ = p.forward(p.ids(p.prefix[_SPLIT:]), _SPLIT, states_of(first))
    errs = [relative_error(p.logits(hidden), dense_prefix[_SPLIT:])]
    states = states_of(second)
    for leaf, ref in zip(p.leaves, dense_leaves, strict=True):
        hidden, _, _ = p.forward(p.ids(leaf), _PREFIX, states)
        errs.append(relative_error(p.logits(hidden), ref[_PREFIX:]))
    batch = torch.zeros(len(p.leaves), max(map(len, p.leaves)), dtype=torch.long, device=p.device)
    for row, leaf in enumerate(p.leaves):
        batch[row, : len(leaf)] = torch.tensor(leaf, device=p.device)
    hidden, _, _ = p.forward(batch, _PREFIX, expand_states(states, len(p.leaves)))
    for row, (leaf, ref) in enumerate(zip(p.leaves, dense_leaves, strict=True)):
        errs.append(relative_error(p.logits(hidden[row : row + 1, : len(leaf)]), ref[_PREFIX:]))
    err = max(errs)
    if not err <= p.tolerance:
        cause = (
            "its multi-token kernel does not start from the given state (e.g. Mamba-1 layers restart from "
            "zero), or it ignores the passed cache"
            if lm.has_states
            else f"the model ignores the passed cache (keyword {lm.cache_keyword!r})"
        )
        if lm.has_states and not HAS_STATE_API:
            raise UnsupportedModelError(
                f"{p.name}: upgrade transformers to >= {STATE_API_VERSION} to walk it. Its states carried on "
                f"a cached prefix differ from the dense forward by {err:.2e} {p.where}: transformers "
                f"{transformers.__version__} has no cache state API (new in {STATE_API_VERSION}), and the "
                "model reads its states where the walk does not put them."
            )
        raise UnsupportedModelError(
            f"{p.name}: a forward on a cached prefix differs from the model's dense forward by {err:.2e} "
            f"{p.where}: {cause}, or computes something that depends on how the sequence is cut into calls; "
            "not supported."
        )
    return states


def _packing_is_exact(p: _Probe, states, dense_leaves) -> bool:
    lengths = [len(x) for x in p.leaves]
    try:
        row = PackedRow.siblings(lengths, _PREFIX, p.device)
        mask = packed_mask(row, _PREFIX, p.lm.lm_head.weight.dtype)
        tokens = p.ids([t for leaf in p.leaves for t in leaf])
        hidden, _, _ = p.lm.forward(
            tokens, _PREFIX, p.kv, states, positions=row.positions[None], attention_mask=mask
        )
        got = p.lm.logits(hidden, 1.0)[0].to(torch.float64).split(lengths)  # (a value model's [L, 1])
        err = max(relative_error(g, ref[_PREFIX:]) for g, ref in zip(got, dense_leaves, strict=True))
    except MEMORY_ERRORS:
        raise  # not a sign that packing differs
    except Exception as e:  # noqa: BLE001 - e.g. ALiBi built from a 2-D mask fails on a 4-D one
        logger.info("%s: sibling leaves are forwarded as a padded batch; packing them fails: %r", p.name, e)
        return False
    if not err <= p.tolerance:
        logger.info(
            "%s: sibling leaves are forwarded as a padded batch; packed into one row they differ from the "
            "dense forward by %.2e (positions or an attention bias built from key indices, e.g. ALiBi).",
            p.name,
            err,
        )
        return False
    return True


def _segments_are_exact(p: _Probe, dense_prefix, dense_leaves) -> bool:
    """The walk's calls through its attention per segment: the prefix's two segments, each leaf alone, the
    leaves packed (attended per segment and as a row), a packed subtree (a chain under one of two roots)."""
    lm, errs = p.lm, []
    chain = p.prefix + p.leaves[0] + p.leaves[1]  # (the sequence up to token 11: leaf 1 follows leaf 0)
    calls = [
        ([p.prefix[:_SPLIT]], (-1,), 0, [dense_prefix[:_SPLIT]]),
        ([p.prefix[_SPLIT:]], (-1,), _SPLIT, [dense_prefix[_SPLIT:]]),
    ]
    calls += [
        ([leaf], (-1,), _PREFIX, [ref[_PREFIX:]]) for leaf, ref in zip(p.leaves, dense_leaves, strict=True)
    ]
    calls.append((p.leaves, (-1, -1, -1), _PREFIX, [ref[_PREFIX:] for ref in dense_leaves]))
    sub = (p.leaves[0], p.leaves[1], p.leaves[2])
    refs = [dense_leaves[0][_PREFIX:], p.dense(chain)[_PREFIX + 2 :], dense_leaves[2][_PREFIX:]]
    calls.append((sub, (-1, 0, -1), _PREFIX, refs))
    lm.segment_attention, kernel = True, lm.walk_kernel()  # (the weights' dtype: autocast is off)
    try:
        for segments, parents, start, refs in calls:
            lengths = [len(x) for x in segments]
            row = _row(lengths, parents, start, p.device) if len(segments) > 1 else None
            for split in (True, False) if row is not None else (True,):
                layout = SegmentLayout.build(lengths, parents, start, p.device, row=row, kernel=kernel)
                layout.split = split
                positions = None if row is None else row.positions[None]
                tokens = p.ids([t for x in segments for t in x])
                hidden, _, _ = lm.forward(tokens, start, p.kv, positions=positions, layout=layout)
                got = p.logits(hidden).split(lengths)
                errs += [relative_error(g, r) for g, r in zip(got, refs, strict=True)]
    except MEMORY_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - a model whose attention the function cannot take
        logger.info("%s: attends with its own attention and a mask; per segment it fails: %r", p.name, e)
        return False
    finally:
        lm.segment_attention = False
    if not max(errs) <= p.tolerance:
        err = max(errs)
        logger.info(
            "%s: attends with its own attention and a mask; per segment it differs by %.2e.", p.name, err
        )
        return False
    return True


def _row(lengths, parents, start, device) -> PackedRow:
    """A packed row's index tensors, built here (the walk builds its rows in :mod:`.inputs`)."""
    ancestor = torch.eye(len(lengths), dtype=torch.bool)
    for k, parent in enumerate(parents):
        if parent >= 0:
            ancestor[k] |= ancestor[parent]
    offsets = [start] * len(lengths)
    for k, parent in enumerate(parents):  # (a child starts where its parent ends)
        if parent >= 0:
            offsets[k] = offsets[parent] + lengths[parent]
    positions = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, lengths, strict=True)])
    segment = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
    return PackedRow(positions.to(device), segment.to(device), ancestor.to(device))
