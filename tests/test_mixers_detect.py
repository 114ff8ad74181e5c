"""Detection of sequence mixers SP can't split (``hf_sp_trainer/model/mixers.py``) on real tiny transformers models:
fast, in one process, no collective (the refusal comes before any)."""

from __future__ import annotations

import pytest
import torch

from hf_sp_trainer.mixers import check_sequence_mixers, sequence_mixers
from hf_sp_trainer.model.decoder import forward_decoder
from hf_sp_trainer.model.mixers import covered_mixers
from hf_sp_trainer.validate import validate_model_for_sp
from tests.family_harness import build_model
from tests.upstream import CACHE_ARGUMENT, family_module


def family_for_type(model_type: str) -> bool:
    """This transformers has the model type (a text config of a VLM family counts as its family)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES and family_module(model_type.removesuffix("_text")) is not None


pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

try:
    import kernels as _KERNELS
except ImportError:  # transformers before 5.25 doesn't need it
    _KERNELS = None

REFUSED = {  # model type, class: what the error must name
    "zaya": ("ZayaForCausalLM", ["Conv1d", "a convolution over the sequence"]),
    "xlstm": ("xLSTMForCausalLM", ["attention registry"]),
    "bert-generation": ("BertGenerationDecoder", ["is_causal=False"]),
}
EXACT = {
    "llama": "LlamaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "phimoe": "PhimoeForCausalLM",  # its window lives only in the mask: SP passes it (MASK_ONLY_WINDOWS)
    "nemotron": "NemotronForCausalLM",  # attention called without **kwargs: SP relays its kwargs past the layer
    "stablelm": "StableLmForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",  # DSA: its attention and indexer swapped (attention/dsa.py)
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "dots3_note_text": "Dots3NoteForCausalLM",  # DSA on its indexed layers, sliding-window MLA on the others
    "mistral_large4_text": "MistralLarge4TextModel",  # DSA, queries scaled by document position (no causal LM)
    "minimax_m3_vl_text": "MiniMaxM3VLForCausalLM",  # block top-k: its indexer swapped (attention/block_sparse.py)
    "hy_v4": "HYV4ForCausalLM",  # DSA with sinks, hyper-connections, shared top-k layers
    "hy_v4_vl_text": "HYV4VLTextModel",  # HY-V4-VL's decoder: the same, its own classes (no causal LM)
    "glm5_next_text": "Glm5NextTextModel",  # pooled DSA (attention/pooled_dsa.py) and KDA layers (no causal LM)
    "deepseek_v4": "DeepseekV4ForCausalLM",  # window + compressed entries: its attention's forward swapped
    "doge": "DogeForCausalLM",  # a learned per-key bias and its top-k (attention/doge.py): its forward swapped
}

# the families whose SP version takes the `cache` argument (transformers >= 5.24): their tiny model, its class
CACHE_ARGUMENT_FAMILIES = {
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "qwen4_exp_text": "Qwen4ExpForCausalLM",
    "minimax_m3_vl_text": "MiniMaxM3VLForCausalLM",
}


def test_qwen4_exp_ngram_embeddings_covered_another_named() -> None:
    """Qwen4-Exp's per-layer embeddings (its released configs set ``ple_layer_ids``) hash the previous tokens' ids
    and convolve over the sequence: SP runs its PLE layers exactly (``mixers/token_history.py``), so nothing is
    named; an n-gram embedding in a layer SP doesn't know is named, with its conv."""
    import transformers

    from hf_sp_trainer.model.mixers import covered_mixers
    from tests.family_harness import tiny_config

    config = tiny_config("qwen4_exp_text")
    config.ple_layer_ids, config.ngram_vocab_size_base = [1], 64  # a small hashed vocabulary (the default: millions)
    config.eos_token_id = 2
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(config)
    assert "model.layers.0.ple" in covered_mixers(model) and sequence_mixers(model) == []
    ple = model.model.layers[0].ple
    ple.__class__ = type("OtherPLELayer", (type(ple),), {})
    ple.ple_embedding.__class__ = type("OtherNGramEmbedding", (type(ple.ple_embedding),), {})
    names = [(where, what) for where, _, what in sequence_mixers(model)]
    assert (
        "model.layers.0.ple.ple_embedding",
        "an embedding of the previous tokens' ids (a shard's first tokens lack theirs)",
    ) in names and ("model.layers.0.ple.conv1d", "a convolution over the sequence") in names


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_refused_naming_the_layer(model_type: str) -> None:
    class_name, fragments = REFUSED[model_type]
    model = build_model(model_type, class_name)
    with pytest.raises(ValueError) as exc:
        validate_model_for_sp(model, 2)
    message = str(exc.value)
    for fragment in [class_name, "sp_size=2", "sp_size=1", *fragments]:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("model_type", [t for t in EXACT if family_for_type(t)])
def test_attention_only_models_pass(model_type: str) -> None:
    model = build_model(model_type, EXACT[model_type])
    assert sequence_mixers(model) == []
    check_sequence_mixers(model, 2)


def test_attention_kwargs_relayed_only_through_a_layer_that_takes_them() -> None:
    """Nemotron's decoder layers take ``**kwargs`` but call their attention without them: SP relays its kwargs (a
    layer called without SP's bounds then fails loudly); a layer taking no ``**kwargs`` at all is refused."""
    import torch

    from hf_sp_trainer.documents import relay_sp_kwargs

    model = build_model("nemotron", "NemotronForCausalLM")
    handles = relay_sp_kwargs(forward_decoder(model))
    assert len(handles) == 2 * model.config.num_hidden_layers  # one on each layer, one on its attention
    layer = forward_decoder(model).layers[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    with pytest.raises(RuntimeError, match="bounds didn't reach layers.0.self_attn"):
        layer(hidden, position_embeddings=forward_decoder(model).rotary_emb(hidden, torch.arange(5)[None]))
    for handle in handles:
        handle.remove()

    class NoKwargsLayer(type(layer)):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None):
            out, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings)
            return hidden_states + out

    layer.__class__ = NoKwargsLayer
    with pytest.raises(ValueError, match="NoKwargsLayer calls without \\*\\*kwargs, and NoKwargsLayer takes none"):
        validate_model_for_sp(model, 2)


def test_mask_only_window_is_read_from_the_config() -> None:
    from hf_sp_trainer.attention.position_rules import WINDOW_MARK, mark_position_rules, module_window

    model = build_model("phimoe", "PhimoeForCausalLM")
    model.config.sliding_window = 7
    mark_position_rules(forward_decoder(model), model.config)
    attentions = [m for m in model.modules() if type(m).__name__ == "PhimoeAttention"]
    assert attentions and all(module_window(m) == 7 for m in attentions)
    assert {getattr(m, WINDOW_MARK) for m in forward_decoder(model).modules()} == {7, None}
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers  # per-layer types: not inferred
    mark_position_rules(forward_decoder(model), model.config)
    assert all(module_window(m) is None for m in attentions)
    with pytest.raises(ValueError, match="sliding window lives only in the mask"):
        validate_model_for_sp(model, 2)


COVERED = {  # hybrid models whose mixers SP runs exactly (hf_sp_trainer.mixers.swap): model type -> class, a mixer
    "lfm2": ("Lfm2ForCausalLM", "Lfm2ShortConv"),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", "Qwen3_5GatedDeltaNet"),
    "olmo_hybrid": ("OlmoHybridForCausalLM", "OlmoHybridGatedDeltaNet"),
    "bamba": ("BambaForCausalLM", "BambaMixer"),  # Mamba2
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHMamba2Mixer"),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridMambaLayer"),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Mixer"),
    "zamba2": ("Zamba2ForCausalLM", "Zamba2MambaMixer"),
    "jamba": ("JambaForCausalLM", "JambaMambaMixer"),  # Mamba1: its selective scan reached through the SP scope
    "mamba": ("MambaForCausalLM", "MambaMixer"),  # no attention: the sequence split only
    "falcon_mamba": ("FalconMambaForCausalLM", "FalconMambaMixer"),
    "zamba": ("ZambaForCausalLM", "ZambaMambaMixer"),  # Mamba1 heads, each its own scan
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaRecurrentBlock"),  # its conv and RG-LRU scan
    "minimax": ("MiniMaxForCausalLM", "MiniMaxLightningAttention"),  # no kernel function: its forward is swapped
    # Gated DeltaNet and PLE layers (hashed n-grams, a dilated conv: token_history.py); query-sparse attention
    "qwen4_exp_text": ("Qwen4ExpForCausalLM", ("Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextPLELayer")),
}


@pytest.mark.parametrize(
    "model_type", [t for t in COVERED if family_for_type(t) and (CACHE_ARGUMENT or t not in CACHE_ARGUMENT_FAMILIES)]
)
def test_covered_hybrid_mixers_pass(model_type: str) -> None:
    class_name, mixer = COVERED[model_type]
    model = build_model(model_type, class_name)
    covered = covered_mixers(model)
    names = mixer if isinstance(mixer, tuple) else (mixer,)
    assert covered and {type(model.get_submodule(c)).__name__ for c in covered} == set(names)
    assert sequence_mixers(model) == []
    validate_model_for_sp(model, 2)


def test_covered_only_through_the_swapped_kernels() -> None:
    """A GDN layer whose forward also calls its conv module directly is not covered (the halo would be skipped)."""
    model = build_model("qwen3_5_text", "Qwen3_5ForCausalLM")
    gdn = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")

    class DirectConv(type(gdn)):
        def forward(self, hidden_states, **kwargs):
            return self.conv1d(hidden_states.transpose(1, 2)).transpose(1, 2)

    gdn.__class__ = DirectConv
    assert any(cls == "Conv1d" for _, cls, _ in sequence_mixers(model))


def test_layer_types_alone_are_enough() -> None:
    """A config that declares a linear-attention layer is refused even if no module name gives it away."""
    model = build_model("llama", "LlamaForCausalLM")
    model.config.layer_types = ["full_attention", "linear_attention"]
    found = sequence_mixers(model)
    assert found == [("config.layer_types[1]", "linear_attention", "a non-attention layer type")]


@pytest.mark.skipif(CACHE_ARGUMENT, reason="transformers >= 5.24: these families run under SP (their own tests)")
@pytest.mark.parametrize("model_type", [t for t in CACHE_ARGUMENT_FAMILIES if family_for_type(t)])
def test_cache_argument_families_refused_before_5_24(model_type: str) -> None:
    """Before transformers 5.24 these modules take ``past_key_values`` (their callers pass it so) where SP's
    versions take ``cache``: refused by name, before any collective, instead of failing inside a forward."""
    from hf_sp_trainer.mixers.swap import check_mixer_kernels

    with pytest.raises(ValueError, match=r"takes past_key_values \(transformers before 5.24\)"):
        check_mixer_kernels(build_model(model_type, CACHE_ARGUMENT_FAMILIES[model_type]))


def test_alibi_is_refused() -> None:
    """Falcon with ALiBi (transformers 5.25 runs Falcon through the attention registry): its bias lives in the prepared
    mask SP replaces, so it is refused by name, on every supported version; its rotary default is exact (the family
    suite)."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)
    with pytest.raises(ValueError, match=r"uses ALiBi \(config.alibi=True\)"):
        validate_model_for_sp(FalconForCausalLM(config), 2)


def test_hook_sits_where_the_attention_kwargs_flow() -> None:
    """OPTForCausalLM calls ``model.decoder`` directly: the pre-hook must be on the decoder, not on ``model``."""
    assert type(forward_decoder(build_model("opt", "OPTForCausalLM"))).__name__ == "OPTDecoder"
    assert type(forward_decoder(build_model("llama", "LlamaForCausalLM"))).__name__ == "LlamaModel"


def _hub_layer_mapping(layer_name: str, forward):
    """A ``kernels`` mapping of ``layer_name`` on CPU to a layer whose forward is ``forward``: what a hub kernel
    repository hands ``kernelize`` (any object with ``load()`` and ``layer_name``: kernels' repository protocol)."""
    import kernels

    layer = type("HubLayer", (torch.nn.Module,), {"forward": forward})

    class InMemoryRepository:
        def __init__(self) -> None:
            self.layer_name = layer_name

        def load(self) -> type:
            return layer

        def __hash__(self) -> int:
            return hash(layer_name)

    return kernels.use_kernel_mapping({layer_name: {"cpu": {kernels.Mode.TRAINING: InMemoryRepository()}}})


@pytest.mark.skipif(_KERNELS is None, reason="kernels is not installed (transformers before 5.25 needs none)")
def test_kernelized_hybrid_runs_unless_a_hub_kernel_replaced_its_layer() -> None:
    """transformers 5.25 kernelizes what from_pretrained loads (``use_kernels`` on by default): on a device with no
    hub kernel for a mixer layer ``kernelize`` keeps the layer, and SP swaps its functions as without kernels; a hub
    kernel that replaces a mixer layer's whole forward would never reach them: refused, naming the layer, before
    any collective (again at every forward: ``model.train()`` kernelizes again)."""
    import kernels

    from hf_sp_trainer.mixers.hub_layers import hub_layer_check
    from hf_sp_trainer.mixers.swap import check_mixer_kernels

    model = build_model("qwen3_5_text", "Qwen3_5ForCausalLM")
    if not hasattr(type(model.model.layers[0].linear_attn), "kernel_layer_name"):
        pytest.skip("this transformers has no hub layers (before 5.25)")
    model.set_use_kernels(True)  # transformers' kernelize: no CPU kernel for these layers, the class forward kept
    assert model.use_kernels
    check_mixer_kernels(model)
    check = hub_layer_check(model)
    check()

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        return hidden_states

    with _hub_layer_mapping("Qwen3_5GatedDeltaNet", forward):
        kernels.kernelize(model, device="cpu", mode=kernels.Mode.TRAINING)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn \(Qwen3_5GatedDeltaNet\) runs a hub kernel"):
        check_mixer_kernels(model)
    with pytest.raises(ValueError, match="reset_kernels"):
        check()  # the check a forward runs, built before the layer was replaced
    model.reset_kernels()
    check()


def test_pure_mamba2_splits_the_sequence_only() -> None:
    """Mamba2ForCausalLM has no attention heads: sp_size splits the sequence only (Ulysses degree = sp_size:
    contiguous shards; a ring: zigzag ones). Without its covered mixers, it is refused."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=128,
        hidden_size=32,
        num_heads=4,
        head_dim=16,
        expand=2,
        state_size=8,
        n_groups=1,
        num_hidden_layers=2,
    )
    model = Mamba2ForCausalLM(config)
    assert {type(model.get_submodule(c)).__name__ for c in covered_mixers(model)} == {"Mamba2Mixer"}
    assert validate_model_for_sp(model, 4) == (4, 1)
    assert validate_model_for_sp(model, 4, ring_size=2) == (2, 2)
    for layer in model.backbone.layers:
        layer.mixer = torch.nn.Linear(32, 32)  # no mixer SP runs, no attention
    with pytest.raises(ValueError, match="sp_size=1"):  # refused before any collective
        validate_model_for_sp(model, 2)
