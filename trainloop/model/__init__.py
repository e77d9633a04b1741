"""The model: built or loaded, adapted (LoRA/QLoRA), cast to fp8, compiled; a mixture's router."""
