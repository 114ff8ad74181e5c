"""The decoder of a transformers model: its repeated layers, the module its attention kwargs flow from, and the model
under a PEFT wrapper."""

from __future__ import annotations

import inspect

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .vlm import is_multimodal, text_decoder


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (``get_base_model()``), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a transformers model, in order (also inside PEFT / DDP wrappers)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def forward_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """Where the attention kwargs flow: the base model, or the module inside it that holds every decoder layer and
    takes the tokens (OPT's ``model.decoder``, which ``OPTForCausalLM`` calls directly)."""
    module = text_decoder(model) if is_multimodal(model) else getattr(model, model.base_model_prefix, model)
    layers = {id(m) for m in decoder_layers(module)}
    while layers:
        inner = [
            child
            for child in module.children()
            if not isinstance(child, torch.nn.ModuleList)
            and layers <= {id(m) for m in child.modules()}
            and {"input_ids", "inputs_embeds"} & set(inspect.signature(child.forward).parameters)
        ]
        if not inner:
            break
        module = inner[0]
    return module
