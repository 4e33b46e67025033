"""Compressed prefix trie (radix tree) over the token sequences of one training step.

Why a trie
----------
RL rollouts share a lot of tokens: every completion of a prompt repeats the prompt,
multi-turn rollouts repeat earlier turns, and duplicates happen.  Putting the step's
sequences into a prefix trie lets the executor forward each *distinct* prefix once:
it walks the trie depth-first and forwards each node's tokens on top of the K/V
cache of its parent.

Shape of the trie
-----------------
* The root is virtual: it holds no tokens (``start == end == 0``, ``seq == -1``).
* Every other node holds the tokens at positions ``[start, end)`` of every sequence
  that passes through it.  The tokens are not copied into the node; ``node.seq`` names
  one sequence passing through it and :meth:`PrefixTrie.tokens` slices them out.
* The trie is *compressed*: a real node that is not a leaf either branches (two or
  more children) or is where some sequence ends (``terminals`` is non-empty).
* ``node.terminals`` lists the sequences that end exactly at ``node.end``.  Identical
  sequences share a node (several terminals); a sequence that is a prefix of another
  ends at an internal node.
* ``node.children`` is sorted by first token (the lexicographic order).

Construction (:meth:`PrefixTrie.from_sequences`)
------------------------------------------------
1. Validate and copy every sequence into a private int64 array.
2. Encode each sequence as big-endian uint32 bytes.  Comparing those byte strings
   (``memcmp``) gives the lexicographic order of the integer sequences, with a prefix
   before its extensions, so Python's ``sorted`` on them sorts the sequences.
3. For each pair of sorted neighbours compute the longest common prefix (LCP) with
   numpy (first mismatch over the shorter length).
4. Build the tree in one pass with a stack holding the path of the previous sequence:
   pop the nodes lying entirely below the LCP depth, split the node straddling it,
   then hang the rest of the new sequence there (or, if nothing is left, add the
   sequence as a terminal: it is identical to the previous one).
5. Record for every node its subtree height and the order its children are walked in.

Walk order (:meth:`PrefixTrie.walk_children`)
---------------------------------------------
The executor walks depth-first and at each node visits the children in this order:

1. **leaf children first**, by ascending length (``num_tokens``), ties by first token;
2. **then internal children**, by ascending subtree height measured from the parent:
   the largest ``end`` anywhere in the child's subtree, minus the parent's ``end``
   (equivalently ``child.num_tokens + child.height``); ties by first token.

Why: a leaf is finished as soon as it has been forwarded, so its activations can be
freed at once, and the leaves of one node can be batched into a single forward on
the shared prefix.  Among internal children the shallower subtrees go first, so the
deepest path is walked last: the end of the walk is one long uninterrupted run of
pops back to the root, and the stack of live K/V caches stays short for most of it.

:meth:`PrefixTrie.nodes` and :meth:`PrefixTrie.dfs_order` follow this same walk.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .token_sequences import convert, neighbour_lcp

__all__ = ["PrefixTrie", "TrieNode"]


class TrieNode:
    """One node of a :class:`PrefixTrie`.

    Attributes:
        parent: the parent node; ``None`` only for the virtual root.
        children: child nodes sorted by their first token.
        start: depth (position in the sequence) of the node's first token.
        end: exclusive end; the node holds positions ``[start, end)``.
        seq: index of one input sequence passing through this node (``-1`` at the root).
        terminals: indices of the sequences ending exactly at ``end``, ascending.
        height: subtree height in tokens, ``max(d.end for d in descendants) - end``
            (0 for a leaf); filled in when the trie is built.
    """

    __slots__ = ("parent", "children", "start", "end", "seq", "terminals", "height", "_walk")

    def __init__(self, parent: TrieNode | None, start: int, end: int, seq: int) -> None:
        self.parent = parent
        self.children: list[TrieNode] = []
        self.start = start
        self.end = end
        self.seq = seq
        self.terminals: list[int] = []
        self.height = 0
        self._walk: list[TrieNode] = []  # children in walk order, set by PrefixTrie

    @property
    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    @property
    def num_tokens(self) -> int:
        """Number of tokens the node holds (``end - start``)."""
        return self.end - self.start

    def __repr__(self) -> str:
        return (
            f"TrieNode([{self.start}, {self.end}), seq={self.seq}, "
            f"children={len(self.children)}, terminals={self.terminals})"
        )


class PrefixTrie:
    """Compressed prefix trie over a list of token sequences (see the module docstring).

    Build it with :meth:`from_sequences`.  The trie is read-only once built.
    """

    def __init__(self) -> None:
        # Use from_sequences(); __init__ only declares the attributes.
        self.root = TrieNode(None, 0, 0, -1)
        self.sequences: list[np.ndarray] = []
        self._lengths = np.zeros(0, dtype=np.int64)
        self._lex_order: list[int] = []
        self._lex_lcp: list[int] = []
        self._end_node: list[TrieNode] = []
        self._num_nodes = 0
        self._num_leaves = 0
        self._num_unique_tokens = 0
        self._leaf_depth_sum = 0

    # ------------------------------------------------------------------ building

    @classmethod
    def from_sequences(cls, sequences: Sequence[Any]) -> PrefixTrie:
        """Build the trie of ``sequences``.

        Each sequence may be a list/tuple of ints, a 1-D numpy integer array, a 1-D
        torch integer tensor, or anything ``numpy.asarray`` turns into a 1-D integer
        array.  Every sequence is copied; nothing passed in is modified.

        Raises:
            ValueError: no sequences; a sequence with fewer than 2 tokens; a non-integer
                dtype (float, bool, string, object); a negative id or an id >= 2**32; a
                sequence that is not 1-D.  The message names the offending index.
        """
        try:
            items = list(sequences)
        except TypeError:
            raise TypeError(
                f"sequences must be an iterable of token sequences, got {type(sequences).__name__}"
            ) from None
        if not items:
            raise ValueError("no sequences given: need at least one token sequence")
        # Building allocates tens of thousands of small objects, which triggers the
        # cyclic garbage collector; with the caller's big lists alive its full passes
        # cost ~40% of the build.  Everything allocated here stays alive, so pause it.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return cls._from_items(items)
        finally:
            if gc_was_enabled:
                gc.enable()

    @classmethod
    def _from_items(cls, items: list[Any]) -> PrefixTrie:
        """Steps 1-5 of the construction (see the module docstring)."""
        # 1. validated private int64 copies + 2. their big-endian uint32 encodings
        seqs: list[np.ndarray] = []
        keys: list[bytes] = []
        for i, item in enumerate(items):
            arr, key = convert(item, i)
            seqs.append(arr)
            keys.append(key)
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))

        # Sort by the byte keys: lexicographic order, prefix first; stable => ties by index.
        order = sorted(range(len(seqs)), key=keys.__getitem__)
        del keys
        # 3. LCP of each sorted sequence with its predecessor (lcp[0] = 0).
        lcp = neighbour_lcp(seqs, lengths, order)

        trie = cls()
        trie.sequences = seqs
        trie._lengths = lengths
        trie._lex_order = order
        trie._lex_lcp = lcp
        trie._build(order, lcp)
        return trie

    def _build(self, order: list[int], lcp: list[int]) -> None:
        """4. Stack pass over the sorted sequences, then 5. heights and walk order."""
        root = self.root
        lengths = self._lengths.tolist()
        end_node: list[TrieNode | None] = [None] * len(order)
        stack = [root]  # path of the previous sequence, root first
        num_nodes = 0
        for s, d in zip(order, lcp, strict=True):
            # Pop the nodes lying entirely below depth d (they are finished).
            while len(stack) > 1 and stack[-1].start >= d:
                stack.pop()
            top = stack[-1]
            if top.end > d:
                # `top` straddles depth d: split it into [start, d) and [d, end).
                upper = TrieNode(top.parent, top.start, d, top.seq)
                upper.children.append(top)
                top.parent.children[-1] = upper  # top was its parent's latest child
                top.parent = upper
                top.start = d
                stack[-1] = top = upper
                num_nodes += 1
            n = lengths[s]
            if n == d:
                # Nothing left: s equals the previous sequence (a prefix sorts first).
                top.terminals.append(s)
                end_node[s] = top
            else:
                node = TrieNode(top, d, n, s)
                node.terminals.append(s)
                top.children.append(node)
                stack.append(node)
                end_node[s] = node
                num_nodes += 1
        self._end_node = end_node  # type: ignore[assignment]
        self._num_nodes = num_nodes
        self._finish()

    def _finish(self) -> None:
        """Compute subtree heights, walk orders and summary counts."""
        # Pre-order list by plain child order; reversed it is a valid post-order.
        pre: list[TrieNode] = []
        todo = [self.root]
        while todo:
            node = todo.pop()
            pre.append(node)
            todo.extend(node.children)
        unique = leaves = leaf_depth = 0
        for node in reversed(pre):
            if node.children:
                node.height = max(c.end + c.height for c in node.children) - node.end
                leaf_kids = [c for c in node.children if not c.children]
                inner_kids = [c for c in node.children if c.children]
                # children are already sorted by first token and sort() is stable,
                # so ties fall back to lexicographic order.
                leaf_kids.sort(key=_node_end)
                inner_kids.sort(key=_node_max_end)
                node._walk = leaf_kids + inner_kids
            else:
                node.height = 0
                node._walk = []
                leaves += 1
                leaf_depth += node.end
            unique += node.end - node.start
        self._num_unique_tokens = unique
        self._num_leaves = leaves
        self._leaf_depth_sum = leaf_depth

    # ------------------------------------------------------------------ reading

    def tokens(self, node: TrieNode) -> np.ndarray:
        """The node's token ids: a view into ``sequences[node.seq][node.start:node.end]``."""
        if node.seq < 0:
            return self.sequences[0][:0]  # the root holds no tokens
        return self.sequences[node.seq][node.start : node.end]

    def walk_children(self, node: TrieNode) -> list[TrieNode]:
        """Children of ``node`` in the executor's depth-first walk order.

        Leaf children first, by ascending length then first token; then internal
        children by ascending subtree height measured from ``node`` (the largest
        ``end`` in the child's subtree minus ``node.end``), ties by first token.
        Leaves are finished (and freed) at once and can be batched in one forward on
        the shared prefix; walking the deepest subtree last keeps the stack of live
        caches short and ends the walk with one run of pops back to the root.
        The order is computed once at build time; the returned list is a fresh copy.
        """
        return list(node._walk)

    def nodes(self) -> Iterator[TrieNode]:
        """Every real node (the root excluded), in pre-order of the walk."""
        todo = list(reversed(self.root._walk))
        while todo:
            node = todo.pop()
            yield node
            todo.extend(reversed(node._walk))

    def dfs_order(self) -> list[int]:
        """Sequence indices in the order the walk finishes them.

        A sequence is finished when the walk reaches the node it ends at; the
        terminals of one node are listed in index order.
        """
        out: list[int] = []
        for node in self.nodes():
            out.extend(node.terminals)
        return out

    def lexicographic_order(self) -> list[int]:
        """Sequence indices sorted lexicographically (prefix before extension, ties by index)."""
        return list(self._lex_order)

    def lexicographic_lcp(self) -> list[int]:
        """``lcp[k]``: longest common prefix of the k-th sequence in :meth:`lexicographic_order` with the
        one before it (``lcp[0] = 0``). ``len(seq) - lcp`` is what a sequence adds to the trie's unique
        tokens after its lexicographic predecessor."""
        return list(self._lex_lcp)

    def sequence_length(self, i: int) -> int:
        return int(self._lengths[i])

    def path(self, i: int) -> list[TrieNode]:
        """The nodes from the root (excluded) down to the node where sequence ``i`` ends."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence index {i} out of range for {len(self)} sequences")
        out = []
        node: TrieNode | None = self._end_node[i]
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    # ------------------------------------------------------------------ statistics

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_sequences(self) -> int:
        """Number of input sequences."""
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        """Total number of tokens over all sequences (with repeats)."""
        return int(self._lengths.sum())

    @property
    def num_unique_tokens(self) -> int:
        """Tokens stored in the trie (sum of node lengths) = number of distinct prefixes."""
        return self._num_unique_tokens

    @property
    def dedup_ratio(self) -> float:
        """``num_tokens / num_unique_tokens`` (1.0 when nothing is shared)."""
        return self.num_tokens / self._num_unique_tokens

    @property
    def num_nodes(self) -> int:
        """Number of real nodes (the root excluded)."""
        return self._num_nodes

    @property
    def num_leaves(self) -> int:
        """Number of nodes without children."""
        return self._num_leaves

    @property
    def max_depth(self) -> int:
        """Length of the longest sequence."""
        return int(self._lengths.max())

    @property
    def mean_leaf_depth(self) -> float:
        """Mean ``end`` (depth in tokens) over the leaves."""
        return self._leaf_depth_sum / self._num_leaves

    def stats(self) -> dict[str, float]:
        """All the statistics above in a dict (e.g. for logging)."""
        return {
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "num_unique_tokens": self.num_unique_tokens,
            "dedup_ratio": self.dedup_ratio,
            "num_nodes": self.num_nodes,
            "num_leaves": self.num_leaves,
            "max_depth": self.max_depth,
            "mean_leaf_depth": self.mean_leaf_depth,
        }

    def __repr__(self) -> str:
        return (
            f"PrefixTrie(num_sequences={self.num_sequences}, num_tokens={self.num_tokens}, "
            f"num_unique_tokens={self.num_unique_tokens}, num_nodes={self.num_nodes})"
        )


def _node_end(node: TrieNode) -> int:
    return node.end


def _node_max_end(node: TrieNode) -> int:
    return node.end + node.height
