"""Read-only facts about a transformers model, derived from its config and modules, never changing them: the
decoder and its layers (``decoder``), attention heads per layer (``heads``), its sequence mixers (``mixers``) and a
VLM's parts (``vlm``)."""
