"""Never silently wrong: a swapped kernel reached during an SP forward without SP's document bounds raises.

Inside the decoder the bounds reach every kernel (its kwargs, else the decoder's scope); outside an SP forward the
kernels are transformers' own. Code the model runs *outside* its decoder (here a hook on ``lm_head``, as a model-level
conv or a head that mixes the sequence would) is still inside the SP forward: there the installed kernel would treat
the packed row (under SP: this rank's shard) as one document, so the swapped entry raises instead. In process, at
``sp_size == 1`` with the documents kept apart (``keep_documents_apart``: the same entries and decoder pre-hook).
"""

from __future__ import annotations

import sys

import pytest
import torch

from hf_sp_trainer.documents import detach_documents, in_sp_forward
from hf_sp_trainer.mixers.documents import keep_documents_apart
from tests.harness import tiny_model

pytestmark = pytest.mark.unit  # in-process


def _delta_rule_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g) for _ in range(3))
    return dict(query=q, key=k, value=v, g=-torch.rand(1, 5, 2, generator=g), beta=torch.rand(1, 5, 2, generator=g))


@pytest.fixture
def qwen35():
    model = tiny_model("qwen3_5", attn="eager").eval()
    keep_documents_apart(model)
    yield model, sys.modules[type(model.model.layers[0].linear_attn).__module__]
    detach_documents(model)


def test_kernel_outside_the_decoder_of_an_sp_forward_raises(qwen35) -> None:
    model, modeling = qwen35
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    seen = {}

    def head_mixes(module, args):  # runs in the model's forward, after its decoder: no documents reach it
        seen["inside"] = in_sp_forward()
        modeling.torch_chunk_gated_delta_rule(**_delta_rule_inputs())

    handle = model.lm_head.register_forward_pre_hook(head_mixes)
    try:
        with pytest.raises(RuntimeError, match="without SP's document bounds"):
            model(input_ids=ids, position_ids=positions)
        assert seen["inside"]
        model(input_ids=ids[:, :3], use_cache=True)  # cached decoding: transformers' own kernels, no documents
        assert not seen["inside"]
    finally:
        handle.remove()
    assert not in_sp_forward()  # the forward hooks left the scope, also after the raise
    model(input_ids=ids, position_ids=positions)  # and the model still runs


def test_kernel_outside_any_sp_forward_is_transformers_own(qwen35) -> None:
    _, modeling = qwen35
    from hf_sp_trainer import patches

    original = patches.original(modeling, "torch_chunk_gated_delta_rule")
    assert original is not modeling.torch_chunk_gated_delta_rule  # swapped
    out, _ = modeling.torch_chunk_gated_delta_rule(**_delta_rule_inputs())
    expected, _ = original(**_delta_rule_inputs())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
