"""Rank-r LoRA on every attention projection and every expert, stored and saved in the PEFT format."""
from .config import ATTENTION_TARGETS, EXPERT_TARGETS, LoraConfig
from .layers import ExpertLoRA, LoraAdapter
from .model import (apply_lora, from_peft_state_dict, load_adapter, load_lora_state_dict, lora_parameters,
                    lora_state_dict, save_adapter, to_peft_state_dict)

__all__ = [
    "ATTENTION_TARGETS", "EXPERT_TARGETS", "ExpertLoRA", "LoraAdapter", "LoraConfig", "apply_lora",
    "from_peft_state_dict", "load_adapter", "load_lora_state_dict", "lora_parameters", "lora_state_dict",
    "save_adapter", "to_peft_state_dict",
]
