"""``PreferenceSPMixin``: what the DPO, reward and KTO trainers add to ``SequenceParallelMixin``.

The base mixin does construction, data (one batch per SP group), evaluation gathers and teardown. Preference batches
are not sharded before the trainer sees them: TRL's loss code reads whole padded batches (masks, lengths, labels), so
the model hooks (``hooks.py``) shard inside each forward and hand back full-batch outputs. Every SP rank therefore
computes TRL's loss and metrics on identical tensors.
"""

from __future__ import annotations

from typing import Any

from ...model.decoder import unwrap_peft
from ...model.vlm import is_multimodal
from ...multimodal.features import MediaFeatures
from ...validate import validate_model_for_sp
from ..base import SequenceParallelMixin
from .hooks import LogProbHooks


def refuse(options: dict[str, Any], why: str, fix: str) -> None:
    """One ValueError naming every option set to an unsupported value (raised on every rank, before collectives)."""
    bad = [f"{name}={value!r}" for name, value in options.items() if value]
    if bad:
        raise ValueError(f"Sequence parallelism (sp_size > 1) does not support {', '.join(bad)}: {why}. {fix}")


def refuse_precomputed_reference(config: Any) -> None:
    """DPO / KTO configs: TRL's precomputed reference log-probs would come from unsharded forwards (``"auto"``: may)."""
    if config.sp_size != 1:
        refuse(
            {"precompute_ref_log_probs": config.precompute_ref_log_probs},
            "TRL precomputes the reference log-probs with unsharded forwards inside the trainer's constructor",
            "Set precompute_ref_log_probs=False (the reference then runs sharded, without gradients, each step).",
        )


class PreferenceSPMixin(SequenceParallelMixin):
    """SP for TRL trainers whose loss is built from sequence-level terms (DPO, KTO: log-probs; reward: scores)."""

    sp_fuses_lm_loss = True  # TRL's fused LM head (or a classification head): fused_loss has nothing to do
    sp_rows_per_example = 2  # chosen and rejected (KTO: completion and KL) rows per example (sp_size="auto")
    sp_shards_batch = False  # the model hooks shard inside each forward
    sp_hooks_cls: type = LogProbHooks
    sp_vision_data = False  # TRL's vision batches (DPO, KTO): see tests/test_multimodal_dpo.py

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sp_hooks = []
        if self.sp is not None:
            self._sp_attach_hooks()

    def sp_default_collator(self, processing_class: Any):
        return None  # TRL's own (right-padded) preference collator; the hooks pack its batches

    def sp_after_init(self) -> None:
        refuse(
            {"compute_metrics": self.compute_metrics},
            "it needs full [seq, vocab] logits, which the fused log-prob forward never builds",
            "Use the logged reward / logp metrics, or evaluate with sp_size=1.",
        )
        model = unwrap_peft(self.model)
        vision = getattr(self, "_is_vision_dataset", False)
        refuse(
            {"vision datasets": vision and not (self.sp_vision_data and is_multimodal(model))},
            f"{type(self).__name__} with {type(model).__name__} shards text tokens only"
            + ("" if self.sp_vision_data else " (vision data: SPDPOTrainer, SPKTOTrainer)"),
            "Use a text-only dataset, or sp_size=1.",
        )

    def _sp_attach_hooks(self) -> None:
        """Hooks on the policy (also the reference when LoRA adapters are disabled) and an SP reference model."""
        if getattr(self, "aux_loss_enabled", False) and self.sp.router_loss is None:
            raise ValueError(
                f"Sequence parallelism (sp_size > 1) makes the MoE router aux loss exact through the model's "
                f"load_balancing_loss_func; {type(unwrap_peft(self.model)).__name__} has none. Set "
                "router_aux_loss_coef=0.0, or sp_size=1."
            )
        policy = self._sp_hook(unwrap_peft(self.model))
        policy.router_loss = self.sp.router_loss  # the policy's aux loss, exact; the reference's is discarded
        self._sp_hooks.append(policy)
        ref = getattr(self, "ref_model", None)
        if ref is not None:
            ref = unwrap_peft(self.accelerator.unwrap_model(ref))
            args, topo = self.args, self.sp.topology
            split = validate_model_for_sp(ref, args.sp_size, topo.ring_size, self.sp.attention.kernel)
            if split != (topo.ulysses_size, topo.ring_size):
                raise ValueError(
                    f"The reference model splits sp_size={args.sp_size} as ulysses x ring {split}, the policy as "
                    f"{(topo.ulysses_size, topo.ring_size)}; give a reference model with the policy's attention heads."
                )
            # The policy's attention object (one is registered per process): its layout is set by whichever runs
            self.sp.attention.attach(ref)
            if is_multimodal(ref):  # its own encoder, the same placeholder rows per rank
                self._sp_ref_media = MediaFeatures(ref, topo, self.sp.sharding, args.sp_split_media)
            if args.tiled_mlp:  # the reference runs at the same sequence length as the policy
                from ...memory.tiled_mlp import apply_tiled_mlp

                apply_tiled_mlp(ref, args.tiled_mlp_num_shards)
            self._sp_hooks.append(self._sp_hook(ref))
        # TRL counts tokens over all ranks and divides by the ranks sharing a batch: the SP ranks share theirs
        self._tp_size = getattr(self, "_tp_size", 1) * self.sp.topology.sp_size

    def _sp_hook(self, model):
        hooks = self.sp_hooks_cls(self.sp, self._sp_pad_id)
        hooks.attach(model)
        return hooks

    def _sp_gather_sequence(self, x):
        return x  # the hooks' outputs are whole batches already (identical on every SP rank)
