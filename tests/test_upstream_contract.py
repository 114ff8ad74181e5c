"""The private upstream members hf_sp_trainer relies on, in one table, checked against the installed versions.

Every private member (and every undocumented module-level function we patch or call) of transformers, TRL,
accelerate, torch, DeepSpeed and the interpreter that the package uses is a row of ``CONTRACT``: where it is, what
shape we rely on (leading parameters, the names its code refers to, or what it must be), and where we use it. A
release that moves or changes one fails here, naming the member and the installed version, instead of as an obscure
error inside a training run. ``test_every_private_override_is_named`` keeps the table complete for the methods our
classes override; ``hf_sp_trainer.patches`` checks each swap's behaviour when it is applied.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import pathlib
import re
import types
from dataclasses import dataclass, replace

import pytest

from hf_sp_trainer import patches
from hf_sp_trainer.model import hub_functions

pytestmark = pytest.mark.unit  # in-process


@dataclass(frozen=True)
class Member:
    """``path``: the member (dotted: its longest importable module, then attributes). ``params``: the leading
    parameter names of its signature, in order. ``refers``: names (attributes, globals, string constants) its code
    still uses. ``is_``: the path of the object it must be. ``kind``: ``property`` / ``cached_property`` /
    ``staticmethod`` / ``classmethod`` as defined. ``imports``: modules to import first (op registration)."""

    path: str
    used_by: str
    params: tuple[str, ...] | None = None
    refers: tuple[str, ...] = ()
    is_: str | None = None
    kind: str | None = None
    imports: tuple[str, ...] = ()
    transformers: str | None = None  # the transformers versions it exists in (a specifier), where not all supported

    def applies(self) -> bool:
        from packaging.specifiers import SpecifierSet

        installed = importlib.metadata.version("transformers")
        return self.transformers is None or SpecifierSet(self.transformers).contains(installed, prereleases=True)


QWEN35 = "transformers.models.qwen3_5.modeling_qwen3_5"
KIMI = "transformers.models.kimi_linear.modeling_kimi_linear"
BAMBA = "transformers.models.bamba.modeling_bamba"
MIXTRAL = "transformers.models.mixtral.modeling_mixtral"
MINIMAX = "transformers.models.minimax.modeling_minimax"
JAMBA = "transformers.models.jamba.modeling_jamba"
MAMBA = "transformers.models.mamba.modeling_mamba"
RGEMMA = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
V32 = "transformers.models.deepseek_v32.modeling_deepseek_v32"
GLM5 = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"
AXK2 = "transformers.models.axk2.modeling_axk2"
DOTS3 = "transformers.models.dots3_note.modeling_dots3_note"
M3 = "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl"
ML4 = "transformers.models.mistral_large4.modeling_mistral_large4"
HY4, HY4VL = "transformers.models.hy_v4.modeling_hy_v4", "transformers.models.hy_v4_vl.modeling_hy_v4_vl"
G5N = "transformers.models.glm5_next.modeling_glm5_next"
DOGE = "transformers.models.doge.modeling_doge"
INDEXER = ("n_heads", "head_dim", "qk_rope_head_dim", "index_topk", "wq_b", "wk", "k_norm", "weights_proj")
GRPO, RLOO = "trl.trainer.grpo_trainer.GRPOTrainer", "trl.trainer.rloo_trainer.RLOOTrainer"
VLLMGEN = "trl.generation.vllm_generation.VLLMGeneration"
SFT, DPO, KTO, REWARD = (
    "trl.trainer.sft_trainer.SFTTrainer",
    "trl.trainer.dpo_trainer.DPOTrainer",
    "trl.trainer.kto_trainer.KTOTrainer",
    "trl.trainer.reward_trainer.RewardTrainer",
)
KERNEL = ("hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias")
DELTA = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state")

CONTRACT: list[Member] = [
    # -- transformers: the checkpoint function, the trainer's private hooks, configs and models -------------------
    Member("transformers.modeling_layers.GradientCheckpointingLayer.__init_subclass__",
           "memory/checkpointing.py wraps the layer's checkpoint function",
           refers=("_gradient_checkpointing_func", "gradient_checkpointing"), transformers=">=5.24"),
    Member("transformers.modeling_layers.GradientCheckpointingLayer.__call__",
           "memory/checkpointing.py wraps the layer's checkpoint function (called here before 5.24)",
           refers=("_gradient_checkpointing_func", "gradient_checkpointing"), transformers="<5.24"),
    Member("transformers.modeling_utils.PreTrainedModel._set_gradient_checkpointing",
           "memory/checkpointing.py: transformers assigns the layer's checkpoint function here",
           refers=("_gradient_checkpointing_func",)),
    Member("transformers.training_args.TrainingArguments._setup_devices", "trainers/arguments.py brings up gloo first",
           kind="cached_property"),
    Member("transformers.trainer.Trainer._prepare_input", "trainers/base.py: no copy of CPU batches",
           params=("self", "data")),
    Member("transformers.trainer.Trainer._prepare_inputs", "trainers/base.py shards each batch",
           params=("self", "inputs")),
    Member("transformers.trainer.Trainer.get_batch_samples", "trainers/base.py: one token count per SP group",
           params=("self", "epoch_iterator", "num_batches", "device")),
    Member("transformers.trainer.Trainer._get_train_sampler", "trainers/base.py: batch_rebalance over DP ranks",
           params=("self", "train_dataset"), refers=("BatchRebalanceSampler", "train_sampling_strategy")),
    *(Member(f"{trainer}._get_train_sampler", "trainers/base.py: returned unchanged unless a BatchRebalanceSampler",
             params=("self", arg)) for trainer, arg in ((GRPO, "dataset"), (RLOO, "dataset"), (KTO, "train_dataset"))),
    # -- checkpoints: completion marker (trainers/preemption.py), another layout (trainers/resume.py) ---------------
    *(Member(f"{trainer}._save_checkpoint", "trainers/preemption.py wraps the save: marker written last, rotation ours",
             params=("self", "model", "trial"))
      for trainer in ("transformers.trainer.Trainer", SFT, DPO, KTO, REWARD, GRPO, RLOO)),
    Member("transformers.trainer.Trainer._save_rng_state", "trainers/resume.py writes sp_layout.json beside it",
           params=("self", "output_dir"), refers=("process_index",)),
    Member("transformers.trainer.Trainer._load_rng_state",
           "trainers/resume.py: on another layout each rank loads the matching saved rank's file",
           params=("self", "checkpoint"), refers=("python", "numpy", "cpu", "process_index")),
    Member("transformers.trainer.Trainer._load_optimizer_and_scheduler",
           "integrations/ds_universal.py repairs ZeRO-3's universal load after it", params=("self", "checkpoint")),
    Member(f"{GRPO}._load_optimizer_and_scheduler", "trainers/base.py (calls it first)", params=("self", "checkpoint")),
    Member("transformers.trainer.Trainer._prepare_for_training",
           "integrations/ds_universal.py: the engine loads the checkpoint, then _load_optimizer_and_scheduler",
           refers=("deepspeed_load_checkpoint", "_load_optimizer_and_scheduler")),
    Member("transformers.trainer.Trainer._init_training_state",
           "trainers/resume.py: the data skipped on resume is global_step x gradient_accumulation_steps batches",
           refers=("steps_trained_in_current_epoch", "gradient_accumulation_steps")),
    Member("transformers.integrations.deepspeed.deepspeed_load_checkpoint",
           "integrations/ds_universal.py: the engine picks the tag (latest_universal)", refers=("load_checkpoint",)),
    Member("transformers.trainer_pt_utils.safe_globals", "trainers/resume.py loads an RNG file as the Trainer does"),
    Member("deepspeed.checkpoint.ds_to_universal.main", "integrations/ds_universal.py converts a ZeRO checkpoint",
           params=("args",), refers=("input_folder", "output_folder", "inject_missing_state")),
    Member("deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint",
           "integrations/ds_universal.py: with checkpoint.load_universal it reads latest_universal",
           refers=("load_universal_checkpoint",)),
    Member("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3",
           "integrations/ds_universal.py repairs its param groups and shared step tensor",
           refers=("param_groups", "step")),
    Member("transformers.trainer.Trainer._get_dataloader",
           "trainers/base.py: a BatchRebalanceSampler is the batch sampler, its shard wrapper a passthrough",
           refers=("BatchRebalanceSampler", "batch_sampler", "num_processes", "process_index")),
    Member("transformers.trainer_pt_utils.BatchRebalanceSampler._assign",
           "trainers/rebalance.py: each step's examples split over DP ranks by packed rows' cost",
           params=("self", "indices", "lengths")),
    Member("transformers.trainer_pt_utils.BatchRebalanceSampler._yield_global_batch",
           "trainers/rebalance.py: upstream's step calls _assign and yields this rank's micro-batches",
           params=("self", "batch_indices"), refers=("_assign", "rank", "grad_accum")),
    Member("transformers.trainer.Trainer.__init__", "trainers/base.py: get_total_train_batch_size",
           refers=("_train_batch_size",)),
    Member("transformers.trainer.Trainer.create_accelerator_and_postprocess",
           "trainers/base.py and integrations/cpu_backend.py wrap the accelerator's creation",
           params=("self",), refers=("accelerator",)),
    Member("transformers.configuration_utils.PreTrainedConfig._attn_implementation",
           "parallel.py, validate.py, attention/ulysses.py: the model's attention kernel", kind="property"),
    Member("transformers.modeling_utils.PreTrainedModel._supports_attention_backend",
           "model/mixers.py, validate.py: attention through the registry"),
    Member("transformers.modeling_utils.PreTrainedModel.reset_kernels",
           "mixers/swap.py names it in its refusal of a hub-replaced mixer layer", params=("self",),
           transformers=">=5.25"),
    Member("transformers.modeling_utils.PreTrainedModel.train",
           "mixers/swap.py: kernelizes again (a mode change), so DocumentHook checks the mixer layers every forward",
           refers=("kernels_mode",), transformers=">=5.25"),
    # -- kernels (transformers >= 5.25): what model/hub_functions.py reads of a hub function ----------------------
    Member("kernels._internals.layer.layer._create_func_module",
           "model/hub_functions.py: a hub function's decorated function is its forward's closure cell `func`",
           params=("func",), refers=("func", "forward", "_ACTIVE_KERNEL_FUNCS"), transformers=">=5.25"),
    Member("kernels._internals.layer.layer.replace_kernel_forward_from_hub",
           "model/hub_functions.py: a hub function's class has kernel_layer_name", refers=("kernel_layer_name",),
           transformers=">=5.25"),
    Member("kernels._internals.layer.layer._replace_forward",
           "model/hub_functions.py: kernelize binds a forward on the instance (the class's where it found no kernel)",
           params=("module", "layer"), refers=("forward",), transformers=">=5.25"),
    Member("transformers.modeling_utils.PreTrainedModel.loss_function", "losses/fused.py checks it is its loss",
           kind="property"),
    # -- transformers: the modeling-module functions the registry swaps (hybrid mixers, MoE router loss) -----------
    Member(f"{MIXTRAL}.load_balancing_loss_func", "losses/router.py swaps it (behaviour-checked)",
           params=("gate_logits", "num_experts", "top_k", "attention_mask")),
    Member(f"{QWEN35}.causal_conv1d_fn", "mixers/swap.py swaps it (behaviour-checked)",
           params=("hidden_states", "weight", "bias", "activation")),
    Member(f"{QWEN35}.torch_chunk_gated_delta_rule", "mixers/swap.py swaps it (behaviour-checked)", params=DELTA),
    Member(f"{QWEN35}.torch_chunk_gated_delta_rule.__wrapped__", "mixers/swap.py checks the hub wrapper's torch path"),
    *(Member(f"{m}.causal_conv1d_forward", "mixers/swap.py: under SP the function beneath the hub one (read: it calls "
             "causal_conv1d_fn)", params=("conv1d", "hidden_states", "cache", "layer_idx", "activation"),
             refers=("causal_conv1d_fn",), transformers=">=5.25") for m in (QWEN35, BAMBA, JAMBA, MAMBA)),
    Member(f"{BAMBA}.mamba2_scan_forward", "mixers/swap.py: under SP the function beneath the hub one",
           params=("module", "hidden_states", "B", "C", "dt", "cache"), refers=("mamba2_chunk_scan",),
           transformers=">=5.25"),
    Member(f"{JAMBA}.mamba_scan_forward", "mixers/swap.py: under SP the function beneath the hub one",
           params=("module", "hidden_states", "time_step", "B", "C", "gate", "cache"),
           refers=("mamba_selective_scan",), transformers=">=5.25"),
    Member(f"{QWEN35}.causal_conv1d_update", "mixers/swap.py: refused under SP (cached decoding)"),
    Member(f"{QWEN35}.torch_recurrent_gated_delta_rule", "mixers/swap.py: refused under SP (cached decoding)"),
    Member(f"{KIMI}.chunk_kimi_delta_attention", "mixers/swap.py swaps it (behaviour-checked)", params=DELTA),
    Member(f"{KIMI}.recurrent_kimi_delta_attention", "mixers/swap.py: refused under SP (cached decoding)"),
    Member(f"{BAMBA}.mamba2_chunk_scan", "mixers/swap.py swaps it (behaviour-checked)", params=KERNEL),
    Member(f"{BAMBA}.mamba2_split_conv1d_scan_combined", "mixers/swap.py switches the fused path off (checked)",
           params=("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "chunk_size")),
    Member(f"{BAMBA}.mamba2_selective_state_update", "mixers/swap.py: refused under SP (cached decoding)"),
    Member(f"{JAMBA}.mamba_selective_scan", "mixers/swap.py swaps it (behaviour-checked)",
           params=("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus")),
    Member(f"{JAMBA}.mamba_selective_scan.__wrapped__", "mixers/checks.py checks the hub wrapper's torch path"),
    Member(f"{JAMBA}.mamba_selective_state_update", "mixers/swap.py: refused under SP (cached decoding)"),
    Member(f"{MAMBA}.mamba_inner_fn", "mixers/swap.py switches Mamba1's fused path off (checked)",
           params=("xz", "conv1d_weight", "conv1d_bias", "x_proj_weight", "delta_proj_weight", "out_proj_weight")),
    *(Member(f"{MINIMAX}.MiniMaxLightningAttention.forward", "mixers/swap.py swaps it (behaviour-checked; either name)",
             params=("self", "hidden_states", "position_embeddings", "attention_mask", cache), transformers=versions)
      for cache, versions in (("cache", ">=5.24"), ("past_key_values", "<5.24"))),
    Member(f"{MINIMAX}.apply_mask_to_padding_states", "mixers/lightning.py",
           params=("hidden_states", "attention_mask")),
    Member(f"{RGEMMA}.RecurrentGemmaRecurrentBlock.forward", "mixers/swap.py swaps it (behaviour-checked)",
           params=("self", "input_states", "position_ids", "attention_mask", "use_cache"),
           refers=("linear_y", "linear_x", "conv_1d", "rg_lru", "act_fn", "linear_out", "conv1d_state")),
    Member(f"{RGEMMA}.RecurrentGemmaRglru._rnn_scan", "mixers/swap.py swaps this private method (behaviour-checked)",
           params=("self", "hidden_states", "recurrent_gate", "reset", "recurrent_states", "acc_dtype")),
    Member(f"{RGEMMA}.RecurrentGemmaRglru.forward", "mixers/rg_lru.py calls it by keyword; it calls _rnn_scan",
           params=("self", "activations", "position_ids"), refers=("_rnn_scan", "recurrent_states")),
    *(Member(f"{m}.{cls}Attention.forward", "mixers/swap.py swaps it (behaviour-checked): a mask placeholder",
             params=("self", "hidden_states", "position_embeddings", "attention_mask", "cache"),
             refers=("indexer", "attention_mask", "sparse_indices", "topk_indices"))
      for m, cls in ((V32, "DeepseekV32"), (GLM5, "GlmMoeDsa"), (AXK2, "AXK2"), (DOTS3, "Dots3NoteText"))),
    *(Member(f"{m}.{cls}Indexer.forward", "mixers/swap.py swaps it; attention/dsa.py recomputes its projection",
             params=("self", "hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids",
                     "cache"), refers=(*INDEXER, rope, "softmax_scale"))
      for m, cls, rope in ((V32, "DeepseekV32", "apply_rotary_pos_emb"),
                           (GLM5, "GlmMoeDsa", "apply_rotary_pos_emb_interleave"),
                           (AXK2, "AXK2", "apply_rotary_pos_emb"),
                           (DOTS3, "Dots3NoteText", "apply_rotary_pos_emb_interleave"))),
    *(Member(f"{m}.{cls}Attention.forward",
             "mixers/swap.py swaps it (behaviour-checked): a mask placeholder; its sinks and shared top-k passed on",
             params=("self", "hidden_states", "position_embeddings", "attention_mask", "cache"),
             refers=("indexer", "attention_mask", "sparse_indices", "topk_indices", "sinks", "prev_topk_indices"))
      for m, cls in ((HY4, "HYV4"), (HY4VL, "HYV4VL"))),
    *(Member(f"{m}.{cls}Indexer.forward", "mixers/swap.py swaps it; attention/dsa.py recomputes it (hy_v4_projection)",
             params=("self", "hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids",
                     "cache"), refers=(*INDEXER, "softmax_scale"))  # its RoPE: dsa._rope_called reads it
      for m, cls in ((HY4, "HYV4"), (HY4VL, "HYV4VL"))),
    Member(f"{G5N}.Glm5NextTextAttention.forward",
           "mixers/selection.py swaps it; attention/pooled_dsa.py runs its projections under SP (behaviour-checked)",
           params=("self", "hidden_states", "attention_mask", "cache", "prev_topk_indices"),
           refers=("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "expand_kv",
                   "indexer", "build_attention_mask_from_topk", "o_proj", "scaling", "next_skip_topk")),
    Member(f"{G5N}.Glm5NextTextIndexer.forward",
           "mixers/selection.py swaps it; attention/pooled_dsa.py recomputes its pools (sp_pooled_topk)",
           params=("self", "hidden_states", "q_resid", "attention_mask", "cache"),
           refers=("wq_b", "wk", "k_norm", "weights_proj", "index_kpool_compress_gate", "get_pooled_states",
                   "append_visible_tail", "softmax_scale", "index_topk", "index_kpool")),
    Member(f"{G5N}.Glm5NextTextIndexer.get_pooled_states", "attention/pooled_dsa.py pool_keys computes its pools",
           params=("self", "packed_states"), refers=("index_kpool_compress_ape", "softmax", "index_kpool")),
    Member(f"{G5N}.Glm5NextModel.forward",
           "multimodal/features.py merge_own_rows merges a rank's media rows as it does (embeddings, masked_scatter)",
           refers=("get_input_embeddings", "get_placeholder_mask", "masked_scatter", "pooler_output",
                   "language_model")),
    Member(f"{G5N}.Glm5NextModel.get_placeholder_mask",
           "model/vlm.py span_marked_video probes it; multimodal/features.py tells frames apart by the same spans",
           params=("self", "input_ids", "inputs_embeds"),
           refers=("image_token_id", "video_start_token_id", "video_end_token_id", "cumsum")),
    Member(f"{DOGE}.DogeAttention.forward",
           "mixers/selection.py swaps it; attention/doge.py runs its projections and dynamic mask under SP",
           params=("self", "hidden_states", "position_embeddings", "attention_mask", "cache"),
           refers=("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "apply_rotary_pos_emb", "dt_proj", "A", "softplus",
                   "prepare_dynamic_mask", "keep_window_size", "repeat_kv", "o_proj", "scaling", "attention_dropout")),
    Member(f"{DOGE}.DogeAttention.prepare_dynamic_mask", "attention/doge.py dynamic_selection / dynamic_bias",
           params=("self", "hidden_states", "dt_states", "keep_window_size", "attention_mask"),
           refers=("topk", "masked_fill", "scatter")),
    Member(f"{DOGE}.DogeModel.forward", "attention/doge.py applies config.sliding_window as the model's mask does",
           refers=("sliding_window", "create_sliding_window_causal_mask", "create_causal_mask")),
    Member(f"{ML4}.MistralLarge4TextAttention.forward",
           "mixers/swap.py swaps it (behaviour-checked): a mask placeholder; its top-k returned for a shared layer",
           params=("self", "hidden_states", "position_embeddings", "attention_mask", "shared_kv_states", "position_ids",
                   "cache", "prev_topk_indices"),
           refers=("indexer", "attention_mask", "sparse_indices", "topk_indices", "softmax_scaling", "position_ids",
                   "prev_topk_indices", "shared_kv_states")),
    Member(f"{ML4}.MistralLarge4TextIndexer.forward",
           "mixers/selection.py swaps it; attention/dsa.py recomputes its projection (mistral_large4_projection)",
           params=("self", "hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache"),
           refers=(*INDEXER, "q_input_norm", "softmax_scaling", "use_rope", "apply_rotary_pos_emb_interleave",
                   "softmax_scale")),
    Member(f"{ML4}.MistralLarge4TextSoftmaxScaling.forward", "attention/dsa.py calls it as the indexer does",
           params=("self", "query_states", "position_ids", "head_dim_first")),
    Member(f"{M3}.MiniMaxM3VLAttention.forward", "attention/block_sparse.py: it hands its indexer's blocks to SP's",
           params=("self", "hidden_states", "position_embeddings", "attention_mask", "cache"),
           refers=("indexer", "block_indices", "build_block_mask", "_attn_implementation")),
    Member(f"{M3}.MiniMaxM3VLIndexer.forward", "mixers/selection.py swaps it; attention/block_sparse.py recomputes it",
           params=("self", "hidden_states", "position_embeddings", "cache", "position_ids"),
           refers=("q_proj", "k_proj", "q_norm", "k_norm", "head_dim", "block_size", "local_blocks", "topk_blocks",
                   "apply_rotary_pos_emb")),
    # -- TRL ---------------------------------------------------------------------------------------------------------
    Member("trl.trainer.utils.add_fused_lm_head", "losses/router.py also swaps Mixtral's function for it",
           refers=(MIXTRAL, "load_balancing_loss_func")),
    Member(f"{GRPO}._generate_single_turn", "trainers/grpo.py overrides it (generation without SP)",
           params=("self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images")),
    Member(f"{RLOO}._generate_single_turn", "trainers/grpo.py overrides it (generation without SP)",
           params=("self", "prompt_ids", "images", "multimodal_fields")),
    Member(f"{GRPO}._generate_single_turn", "trainers/rollouts.py: TRL's vLLM path syncs, then generates",
           refers=("vllm_generation", "_last_loaded_step", "sync_weights", "generate")),
    Member(f"{VLLMGEN}._init_vllm", "trainers/rollouts.py: the engine is built through the module's LLM (seed)",
           params=("self",), refers=("LLM", "process_index", "tensor_parallel_size", "external_launcher")),
    Member(f"{VLLMGEN}._iter_named_params", "trainers/rollouts.py: the CPU weight sync walks it (gathers)",
           params=("self",)),
    Member(f"{VLLMGEN}.sync_weights", "trainers/rollouts.py wraps it (checked): in-place load_weights",
           params=("self",), refers=("_iter_named_params", "load_weights", "reset_prefix_cache", "mode")),
    Member(f"{VLLMGEN}.generate", "trainers/rollouts.py: one SamplingParams for every prompt of llm.generate",
           params=("self", "prompts", "images", "num_generations", "profiler"), refers=("llm", "SamplingParams")),
    Member(f"{VLLMGEN}.generate", "trainers/vllm_server.py wraps it (server mode): TRL's result tuple, its sampling",
           refers=("vllm_client", "repetition_penalty", "min_p", "max_completion_length", "logprobs",
                   "structured_outputs_regex", "generation_kwargs", "mode")),
    Member(f"{VLLMGEN}._init_vllm", "trainers/vllm_server.py: the server client TRL builds, without its communicator",
           refers=("VLLMClient", "server_base_url", "server_host", "server_port", "group_port", "server_timeout",
                   "init_communicator")),
    Member(f"{RLOO}._generate_single_turn", "trainers/rollouts.py: TRL's vLLM path syncs, then generates",
           refers=("vllm_generation", "_last_loaded_step", "sync_weights", "generate")),
    Member("trl.generation.vllm_client.VLLMClient.__init__", "trainers/vllm_server.py: the client, built as TRL does",
           params=("self", "base_url", "host", "server_port", "group_port", "connection_timeout")),
    Member("trl.generation.vllm_client.VLLMClient.generate", "trainers/vllm_server.py: one request per row (seed)",
           params=("self", "prompts", "features", "n", "repetition_penalty", "temperature", "top_p", "top_k",
                   "min_p", "max_tokens", "logprobs", "structured_outputs_regex", "generation_kwargs")),
    Member("trl.generation.vllm_client.VLLMClient.get_server_info", "trainers/vllm_server.py: development mode",
           params=("self",)),
    Member("trl.generation.vllm_client.VLLMClient.reset_prefix_cache", "trainers/vllm_server.py: after a reload",
           params=("self",)),
    Member(f"{GRPO}._generate_and_score_completions", "trainers/grpo.py: the data-parallel view around it",
           params=("self", "inputs"), refers=("gather_object", "process_index", "accelerator")),
    Member(f"{RLOO}._generate_and_score_completions", "trainers/grpo.py: the data-parallel view around it",
           params=("self", "inputs"), refers=("gather", "gather_object", "process_index", "accelerator")),
    Member(f"{GRPO}._calculate_rewards", "trainers/grpo.py: TRL gathers the rewards with its module's gather",
           refers=("gather",)),
    Member(f"{GRPO}._prepare_inputs", "trainers/base.py overrides it", params=("self", "generation_batch")),
    Member(f"{RLOO}._prepare_inputs", "trainers/base.py overrides it", params=("self", "generation_batch")),
    Member(f"{GRPO}.__init__", "trainers/grpo.py refuses vision-language models under SP", refers=("_is_vlm",)),
    Member("trl.trainer.grpo_trainer.gather", "trainers/grpo.py swaps it (checked)", is_="accelerate.utils.gather"),
    Member("trl.trainer.grpo_trainer.gather_object", "trainers/grpo.py swaps it (checked)",
           is_="accelerate.utils.gather_object"),
    Member("trl.trainer.rloo_trainer.gather", "trainers/grpo.py swaps it (checked)", is_="accelerate.utils.gather"),
    Member("trl.trainer.rloo_trainer.gather_object", "trainers/grpo.py swaps it (checked)",
           is_="accelerate.utils.gather_object"),
    *[
        Member(f"{trainer}.__init__", "trainers/scoring/mixin.py: TRL's token count per SP group",
               refers=("_tp_size", "_is_vision_dataset"))
        for trainer in (SFT, DPO, KTO)
    ],
    Member(f"{REWARD}.__init__", "trainers/scoring/mixin.py: TRL's token count per SP group", refers=("_tp_size",)),
    *[
        Member(f"{trainer}.{method}", "trainers/scoring/mixin.py: TRL divides its token count by _tp_size",
               refers=("_tp_size",))
        for trainer, method in ((SFT, "compute_loss"), (DPO, "_compute_loss"), (KTO, "_compute_loss"),
                                (REWARD, "compute_loss"))
    ],
    Member(f"{SFT}.compute_loss", "trainers/sft.py switches TRL's aux loss off around it and logs its own",
           params=("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
           refers=("aux_loss_enabled", "router_aux_loss_coef", "_metrics")),
    Member(f"{SFT}.__init__", "memory/arguments.py: TRL's own activation_offloading (ours is checkpoint_offloading)",
           refers=("activation_offloading", "maybe_activation_offload_context", "aux_loss_enabled")),
    Member("trl.trainer.sft_config.SFTConfig.__dataclass_fields__",
           "memory/arguments.py: the flag our old name shadows", refers=("activation_offloading",)),
    # -- accelerate --------------------------------------------------------------------------------------------------
    Member("accelerate.state.AcceleratorState._reset_state", "integrations/cpu_backend.py: gloo state on CPU",
           params=("reset_partial_state",), kind="staticmethod"),
    Member("accelerate.accelerator.Accelerator.__init__",
           "integrations/accelerate_sp.py: accelerate reads its parallelism variables when the Accelerator is built",
           refers=("ACCELERATE_USE_PARALLELISM_CONFIG",)),
    Member("accelerate.parallelism_config.ParallelismConfig.__post_init__",
           "integrations/accelerate_sp.py rewrites these variables", refers=("PARALLELISM_CONFIG_SP_SIZE",
                                                                            "PARALLELISM_CONFIG_DP_SHARD_SIZE")),
    Member("accelerate.accelerator.Accelerator.gather", "trainers/grpo.py's data-parallel view",
           params=("self", "tensor")),
    Member("accelerate.accelerator.Accelerator.reduce", "trainers/grpo.py's data-parallel view",
           params=("self", "tensor", "reduction", "scale")),
    Member("accelerate.utils.gather", "trainers/grpo.py's gather entry calls it", params=("tensor",)),
    Member("accelerate.utils.gather_object", "trainers/grpo.py's gather_object entry calls it", params=("object",)),
    # -- torch -------------------------------------------------------------------------------------------------------
    Member("torch._C._distributed_c10d._resolve_process_group", "comm/all_to_all.py, attention/ring.py"),
    Member("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "attention/block_attention.py"),
    Member("torch.ops.torch_attn._varlen_attn_backward", "attention/block_attention.py (CUDA varlen path)",
           imports=("torch.nn.attention.varlen",)),
    Member("torch._library.custom_ops.CustomOpDef._define_dispatcher_op", "memory/checkpointing.py: saved ops",
           refers=("_opoverload",)),
    # -- DeepSpeed and the interpreter -------------------------------------------------------------------------------
    Member("deepspeed.comm.init_distributed", "integrations/cpu_backend.py (by keyword)",
           params=("dist_backend", "auto_mpi_discovery")),
    Member("atexit._run_exitfuncs", "topology/teardown.py: a finished worker's exit"),
]  # fmt: skip
# The modules whose SP versions take the `cache` argument (selection swaps, token history): transformers >= 5.24,
# refused before it (mixers/swap.py; test_mixers_detect.test_cache_argument_families_refused_before_5_24)
CONTRACT = [
    replace(m, transformers=">=5.24") if m.transformers is None and m.params and "cache" in m.params else m
    for m in CONTRACT
]


def _split(path: str) -> tuple[object, list[str], str]:
    """The longest importable module of ``path``, the attribute names after it, and that module's name."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            return importlib.import_module(name), parts[cut:], name
        except ImportError:
            continue
    raise ImportError(f"{parts[0]} does not import")


def _installed(path: str) -> str:
    top = path.split(".")[0]
    module = importlib.import_module(top)
    requirement = patches.tested_requirement(module)
    return patches.installed_version(module) + (f", tested with {requirement}" if requirement else "")


def resolve(member: Member):
    """The member as the library defines it (the original where the patch registry swapped it; a class attribute
    as defined: a property, not its value)."""
    for module in member.imports:
        importlib.import_module(module)
    obj, rest, _ = _split(member.path)
    for i, name in enumerate(rest):
        if isinstance(obj, type) and i == len(rest) - 1:
            for klass in obj.__mro__:
                if name in vars(klass):
                    found = vars(klass)[name]
                    record = patches.find(klass, name)
                    return found if record is None else record.original
            raise AttributeError(f"{obj.__qualname__} has no {name!r}")
        if isinstance(obj, types.ModuleType) and patches.find(obj, name) is not None:
            obj = patches.original(obj, name)
        else:
            obj = getattr(hub_functions.plain_function(obj), name)
    return hub_functions.plain_function(obj)  # transformers >= 5.25: the function beneath a hub function


def _code(obj) -> types.CodeType | None:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, functools.cached_property):
        obj = obj.func
    obj = inspect.unwrap(obj) if callable(obj) else obj
    return getattr(obj, "__code__", None)


def names_in(code: types.CodeType) -> set[str]:
    """Attribute / global names and string constants of ``code`` and the functions nested in it (the compiled code:
    what runs, not the source text)."""
    found = set(code.co_names) | set(code.co_varnames)
    for const in code.co_consts:
        if isinstance(const, str):
            found.add(const)
        elif isinstance(const, types.CodeType):
            found |= names_in(const)
    return found


def problems(member: Member) -> list[str]:
    try:
        obj = resolve(member)
    except (ImportError, AttributeError) as error:
        return [f"missing ({error})"]
    found = []
    if member.kind is not None and type(obj).__name__ != member.kind:
        found.append(f"is a {type(obj).__name__}, expected a {member.kind}")
    if member.params is not None:
        target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if isinstance(obj, classmethod):
            target = obj.__get__(None, object)
        try:
            names = tuple(inspect.signature(target).parameters)
        except (TypeError, ValueError) as error:
            names = (f"<no signature: {error}>",)
        if names[: len(member.params)] != member.params:
            found.append(f"parameters {names}, expected to start with {member.params}")
    if member.refers:
        code = _code(obj)
        if isinstance(obj, dict):  # a dataclass' fields
            missing = [n for n in member.refers if n not in obj]
        else:
            available = names_in(code) if code is not None else set()
            missing = [n for n in member.refers if n not in available]
        if missing:
            found.append(f"no longer refers to {missing}")
    if member.is_ is not None and obj is not resolve(Member(member.is_, "")):
        found.append(f"is {obj!r}, not {member.is_}")
    return found


@pytest.mark.parametrize("member", [m for m in CONTRACT if m.applies()], ids=lambda m: m.path)
def test_upstream_member(member: Member) -> None:
    found = problems(member)
    assert not found, f"{member.path} ({_installed(member.path)}): {'; '.join(found)}. Used by {member.used_by}."


def test_the_table_names_the_failing_member_and_version() -> None:
    """The check itself: a member that moved fails with its path, the installed version and what uses it."""
    gone = Member("transformers.trainer.Trainer._no_such_hook", "a test", params=("self",))
    assert problems(gone) and "missing" in problems(gone)[0]
    renamed = Member("accelerate.accelerator.Accelerator.reduce", "a test", params=("self", "tensors"))
    assert problems(renamed) == [
        "parameters ('self', 'tensor', 'reduction', 'scale'), expected to start with ('self', 'tensors')"
    ]
    assert "transformers " + importlib.metadata.version("transformers") in _installed("transformers.trainer")


def test_installed_versions_are_the_tested_ones() -> None:
    """The contract above is checked against the versions setup.py caps: the installed ones are inside the caps."""
    from packaging.requirements import Requirement

    setup = (pathlib.Path(__file__).resolve().parent.parent / "setup.py").read_text()
    block = setup[setup.index("install_requires=[") : setup.index("]", setup.index("install_requires=["))]
    for spec in re.findall(r'"([^"]+)"', block):
        requirement = Requirement(spec)
        installed = importlib.metadata.version(requirement.name).split("+")[0]
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{requirement.name} {installed} is installed; setup.py tests {requirement}"
        )
        if requirement.name in ("transformers", "trl", "accelerate"):  # the libraries whose internals we use
            assert any(s.operator == "<" for s in requirement.specifier), f"{requirement} has no upper cap"
    extra = re.search(r'"deepspeed": \["([^"]+)"\]', setup)  # optional, but its internals are used too
    assert extra, "setup.py has no deepspeed extra"
    deepspeed = Requirement(extra.group(1))
    assert any(s.operator == "<" for s in deepspeed.specifier), f"{deepspeed} has no upper cap"
    installed = importlib.metadata.version("deepspeed").split("+")[0]
    assert deepspeed.specifier.contains(installed, prereleases=True), f"deepspeed {installed}; setup.py: {deepspeed}"


def _our_classes() -> list[type]:
    import pkgutil

    import hf_sp_trainer

    classes = []
    for info in pkgutil.walk_packages(hf_sp_trainer.__path__, "hf_sp_trainer."):
        if info.name.startswith("hf_sp_trainer.cli"):
            continue
        module = importlib.import_module(info.name)
        classes += [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == info.name]
    return classes


def test_every_private_override_is_named() -> None:
    """A private method of an upstream class that one of our classes overrides is a member of ``CONTRACT``."""
    named = {m.path for m in CONTRACT}
    missing = set()
    for cls in _our_classes():
        ours = [c for c in cls.__mro__ if c.__module__.startswith("hf_sp_trainer")]
        upstream = [c for c in cls.__mro__ if not c.__module__.startswith("hf_sp_trainer") and c is not object]
        for klass in ours:
            for name in vars(klass):
                if not name.startswith("_") or name.startswith("__") or name == "_backward_cls":
                    continue
                for base in upstream:
                    if name in vars(base):
                        path = f"{base.__module__}.{base.__qualname__}.{name}"
                        if path not in named:
                            missing.add(f"{path} (overridden by {klass.__module__}.{klass.__qualname__})")
                        break
    assert not missing, "name these in CONTRACT:\n" + "\n".join(sorted(missing))
