"""TreePPOTrainer: TRL's GRPOTrainer with the policy forward/backward replaced by a prefix-trie walk.

Everything else is TRL's own: generation (tools and environments included), rewards, advantages,
gradient accumulation, logging, checkpointing, saving. Two methods change:

* ``_get_per_token_logps_and_entropies`` (TRL's no-grad log-prob passes: old-policy and reference
  log-probs) runs :meth:`TreeExecutor.logprobs` on the rows' prefix trie instead of padded dense batches.
* ``compute_loss`` walks the micro-batch's trie with :meth:`TreeExecutor.backward`, each row's loss being
  :class:`~trl_dta.losses.RowLoss` (TRL's loss, written per row), so the gradients land in ``.grad``
  during the walk. TRL's ``_compute_loss`` then runs once on the walk's (detached) log-probs: it logs
  exactly TRL's metrics, advances TRL's adaptive-entropy state, and its loss value must equal the sum of
  the row losses (checked). The returned loss is that value on a fresh graph leaf, so the ``backward`` the
  Trainer calls next adds nothing to the parameters.

Rows keep TRL's micro-batch composition (no reordering across micro-batches), so options whose statistics
are per micro-batch (bnpo, ``top_entropy_quantile``, entropy bonus) keep their meaning.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from accelerate.utils import DistributedType
from trl import GRPOTrainer

from . import distributed
from .config import TreePPOConfig
from .executor import TreeExecutor
from .losses import LossSettings, RowLoss
from .router_loss import load_balancing_loss, node_weights
from .trie import PrefixTrie

_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
               "token_type_ids", "mm_token_type_ids", "image_position_ids")  # fmt: skip


class TreePPOTrainer(GRPOTrainer):
    """A drop-in replacement for ``trl.GRPOTrainer`` (same arguments) that trains on a prefix trie of each
    micro-batch's rollouts: shared prefixes are forwarded and backpropagated once, with exactly the dense
    gradients. Takes a :class:`~trl_dta.TreePPOConfig` (a plain ``GRPOConfig`` is accepted and gets the
    tree options' defaults)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        self._tree_options = {
            "block_size": getattr(a, "tree_block_size", TreePPOConfig.tree_block_size),
            "batch_tokens": getattr(a, "tree_batch_tokens", None),
            "lm_head_fp32": a.cast_lm_head_to_fp32,
        }
        self._tree_check = getattr(a, "tree_check_gradients", False)
        self._tree_check_tolerance = getattr(a, "tree_check_tolerance", TreePPOConfig.tree_check_tolerance)
        self._executors: dict[int, TreeExecutor] = {}
        self._tree_detached = None  # (logps, entropies, aux) served to TRL's _compute_loss for its metrics
        self._loss_settings = LossSettings.from_trainer(self)
        if a.fp16:
            raise ValueError("fp16 mixed precision (gradient scaling) is not supported by the tree walk; use bf16.")
        if getattr(a, "use_liger_kernel", False):
            raise ValueError("use_liger_kernel replaces the loss computation; it is not supported by the tree walk.")
        kind = self.accelerator.distributed_type
        if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            raise ValueError(
                f"{kind} is not supported: the tree walk makes many forward calls per step, and sharded "
                "training (FSDP, DeepSpeed ZeRO-3) gathers parameters on each; use single process or DDP "
                "(multi-GPU / multi-CPU)."
            )
        self._multi_process = self.accelerator.num_processes > 1
        if self._multi_process and self._tree_check:
            raise ValueError("tree_check_gradients runs on a single process only.")
        # Re-partition the global batch along the DFS order, unless the loss has per-micro-batch statistics
        # (bnpo, top_entropy_quantile, entropy bonus): those keep TRL's per-rank batches.
        self._repartition = self._multi_process and not (
            self.loss_type == "bnpo" or self.top_entropy_quantile < 1.0 or self._entropy_bonus_enabled
        )

    # ------------------------------------------------------------------ helpers
    def _executor(self, model) -> TreeExecutor:
        model = self.accelerator.unwrap_model(model)
        if id(model) not in self._executors:
            self._executors[id(model)] = TreeExecutor(model, **self._tree_options)
        return self._executors[id(model)]

    @staticmethod
    def _rows(prompt_ids, prompt_mask, completion_ids, completion_mask, keep_prompt_only=False):
        """Each row's real tokens (prompt without left padding + completion up to its last unmasked token)
        and its prompt length; rows with no completion token to score are None (their loss is 0), unless
        ``keep_prompt_only`` (MoE: TRL's load-balancing loss counts every token of the attention mask, the
        prompt of such a row too)."""
        rows = []
        for i, (p_ids, p_mask, c_ids, c_mask) in enumerate(
            zip(prompt_ids, prompt_mask, completion_ids, completion_mask, strict=True)
        ):
            prompt = p_ids[p_mask.bool()]
            real = c_mask.nonzero()
            length = int(real[-1]) + 1 if real.numel() else 0
            if prompt.numel() == 0 or (length == 0 and not keep_prompt_only):
                rows.append(None)
                continue
            if prompt.numel() + length < 2:
                raise ValueError(f"row {i} has a single token; the tree walk needs at least two per row.")
            rows.append((torch.cat([prompt, c_ids[:length]]).tolist(), prompt.numel()))
        return rows

    @staticmethod
    def _trie(rows):
        kept = [i for i, r in enumerate(rows) if r is not None]
        return (PrefixTrie.from_sequences([rows[i][0] for i in kept]) if kept else None), kept

    # ------------------------------------------------------------------ multi-process: DFS re-partition
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._repartition and self.model.training:
            output, info = distributed.repartition(output, multiple=self.args.steps_per_generation)
            self._metrics["train"]["tree/rank_rows"].append(info["rows"])
        return output

    # ------------------------------------------------------------------ TRL's no-grad log-prob passes
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):  # fmt: skip
        if self._tree_detached is not None:  # TRL's _compute_loss, run for its metrics on the walk's values
            return self._tree_detached
        if any(multimodal.get(k) is not None for k in _MULTIMODAL):
            raise ValueError("multimodal inputs are not supported by the tree walk.")
        if torch.is_grad_enabled():
            raise RuntimeError("TreePPOTrainer computes gradients through the tree walk, not the dense path.")
        prompt_len = input_ids.shape[1] - logits_to_keep
        rows = self._rows(input_ids[:, :prompt_len], attention_mask[:, :prompt_len],
                          input_ids[:, prompt_len:], attention_mask[:, prompt_len:])  # fmt: skip
        logps = torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        trie, kept = self._trie(rows)
        if trie is not None:
            with self.accelerator.autocast():
                out = self._executor(model).logprobs(trie, self.temperature, entropies=compute_entropy)
            lps, ents = out if compute_entropy else (out, None)
            for k, i in enumerate(kept):
                start = rows[i][1] - 1
                logps[i, : lps[k].numel() - start] = lps[k][start:]
                if compute_entropy:
                    entropies[i, : ents[k].numel() - start] = ents[k][start:]
        return logps, entropies, None

    # ------------------------------------------------------------------ the training loss
    def _row_loss(self, model, inputs, training: bool) -> RowLoss:
        """TRL's loss for this micro-batch, per row: the micro-batch constants are settled here."""
        mask = inputs["completion_mask"]
        mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:  # couples rows: the whole micro-batch's entropies come first
            with torch.no_grad():
                _, entropies, _ = self._get_per_token_logps_and_entropies(
                    model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
                    inputs["completion_ids"].shape[1], compute_entropy=True,
                )  # fmt: skip
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        entropy_coef = 0.0
        if self._entropy_bonus_enabled:  # TRL applies the coefficient set at the end of the previous step
            entropy_coef = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
                entropy_coef = 0.0
        accumulation = self.current_gradient_accumulation_steps if training else 1
        rows = self.args.per_device_train_batch_size if (self._repartition and training) else None
        return RowLoss(self._loss_settings, inputs, accumulation, entropy_mask, entropy_coef, training, rows)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The TreePPOTrainer does not support returning outputs")
        multimodal = [k for k in _MULTIMODAL if inputs.get(k) is not None]
        if multimodal:
            raise ValueError(f"multimodal inputs ({', '.join(multimodal)}) are not supported by the tree walk.")
        mode = "train" if self.model.training else "eval"
        training = mode == "train" and torch.is_grad_enabled()
        rows = self._rows(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                          inputs["completion_mask"], keep_prompt_only=self.aux_loss_enabled)  # fmt: skip
        trie, kept = self._trie(rows)
        row_loss = self._row_loss(model, inputs, mode == "train")

        # the walk's values, padded like TRL's (B, T) tensors, for TRL's metrics
        logps = torch.zeros(inputs["completion_ids"].shape, device=inputs["completion_ids"].device)
        entropies = torch.zeros_like(logps)
        magnitudes = []

        def loss_fn(index, lp, ent):
            i = kept[index]
            start = rows[i][1] - 1  # the completion's log-probs: positions after the prompt
            n = lp.numel() - start
            if n == 0:  # a prompt-only row, kept for the MoE load-balancing loss: no policy loss
                return lp.new_zeros(())
            logps[i, :n], entropies[i, :n] = lp[start:].detach(), ent[start:].detach()
            loss = row_loss(i, lp[start:], ent[start:])
            magnitudes.append(loss.detach().abs())
            return loss

        dense_grads = self._dense_gradients(model, inputs) if (self._tree_check and training) else None
        started = time.perf_counter()
        row_total, aux, router_grad = 0.0, None, None
        if trie is not None:
            executor = self._executor(model)
            with self.accelerator.autocast():
                if self.aux_loss_enabled:  # MoE: TRL's load-balancing loss, exactly (see trl_dta/router_loss.py)
                    weights = node_weights(trie, range(len(trie)))
                    aux, v = load_balancing_loss(executor.router_stats(trie), weights, executor.lm.num_experts)
                    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
                    scale = self.router_aux_loss_coef / accumulation
                    router_grad = {node: scale * x for node, x in v.items()}
                    row_total += scale * float(aux)
                if training:
                    row_total += executor.backward(
                        trie, loss_fn, self.temperature, entropies=True, router_grad=router_grad
                    )
                else:
                    lps, ents = executor.logprobs(trie, self.temperature, entropies=True)
                    row_total += sum(
                        float(loss_fn(k, lp, ent)) for k, (lp, ent) in enumerate(zip(lps, ents, strict=True))
                    )
        elapsed = time.perf_counter() - started
        if training and self._multi_process and self.accelerator.sync_gradients:
            # the walk ran on the unwrapped module (no DDP hooks): average the accumulated gradients once
            distributed.all_reduce_gradients([p for p in model.parameters() if p.requires_grad])
        if dense_grads is not None:
            self._compare_with_dense(dense_grads)
            self._tree_check = False

        if self.aux_loss_enabled and aux is None:  # nothing to walk: TRL still reads an aux value
            aux = torch.zeros((), device=logps.device)
        with self._serve_detached(logps, entropies, aux):
            loss = GRPOTrainer._compute_loss(self, model, inputs).detach()  # TRL's metrics and state
        if row_loss.rows != inputs["completion_mask"].shape[0]:  # TRL's value counts zero-weight padding rows
            loss = torch.tensor(row_total, device=loss.device, dtype=loss.dtype)
        magnitude = float(torch.stack(magnitudes).sum()) if magnitudes else 0.0
        if abs(float(loss) - row_total) > 1e-4 * magnitude + 1e-7:  # fp32 rounding of a sum of terms
            raise RuntimeError(
                f"TRL's loss on the walk's log-probs ({float(loss):.8g}) differs from the sum of the per-row losses "
                f"({row_total:.8g}): trl_dta's RowLoss no longer mirrors this TRL version's loss."
            )
        if trie is not None:
            metrics = self._metrics[mode]
            metrics["tree/tokens"].append(float(trie.num_tokens))
            metrics["tree/unique_tokens"].append(float(trie.num_unique_tokens))
            metrics["tree/dedup_ratio"].append(trie.dedup_ratio)
            metrics["tree/time"].append(elapsed)
        if training:  # the gradients are already in .grad: the Trainer's backward on a fresh leaf adds none
            return torch.zeros((), device=loss.device, requires_grad=True) + loss
        return loss

    @contextmanager
    def _serve_detached(self, logps, entropies, aux):
        self._tree_detached = (logps, entropies, aux)
        try:
            yield
        finally:
            self._tree_detached = None

    # ------------------------------------------------------------------ optional self-check
    def _dense_gradients(self, model, inputs):
        """The micro-batch's gradients by TRL's dense path (parameters' .grad and TRL's state untouched)."""
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        state = (self._metrics, self.entropy_coef, getattr(self, "_entropy_window_stats", None),
                 getattr(self, "_last_world_entropy", None))  # fmt: skip
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            for p in params:
                p.grad = None
            with self._dense_logps():
                loss = GRPOTrainer._compute_loss(self, model, inputs)
            loss.backward()
            dense = [None if p.grad is None else p.grad.detach().clone() for p in params]
        finally:
            self._metrics, self.entropy_coef, self._entropy_window_stats, self._last_world_entropy = state
            for p, g in zip(params, saved):
                p.grad = g
        self._check_params = params
        self._saved_grads = [None if g is None else g.clone() for g in saved]
        for p in params:
            p.grad = None
        return dense

    @contextmanager
    def _dense_logps(self):
        self._get_per_token_logps_and_entropies = super()._get_per_token_logps_and_entropies
        try:
            yield
        finally:
            del self._get_per_token_logps_and_entropies

    def _compare_with_dense(self, dense):
        refs = [d if d is not None else torch.zeros_like(p) for p, d in zip(self._check_params, dense)]
        overall = max((r.abs().max().item() for r in refs), default=0.0)
        worst = 0.0
        for p, ref, before in zip(self._check_params, refs, self._saved_grads):
            tree = p.grad if p.grad is not None else torch.zeros_like(p)
            scale = max(ref.abs().max().item(), 1e-6 * overall, 1e-30)
            worst = max(worst, (tree - ref).abs().max().item() / scale)
            if before is not None:
                p.grad = tree + before
        if worst > self._tree_check_tolerance:
            raise RuntimeError(
                f"tree_check_gradients: the tree walk's gradients differ from the dense path's by {worst:.3e} "
                f"(relative, worst tensor; tolerance {self._tree_check_tolerance}). Please report this model."
            )
