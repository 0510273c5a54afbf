"""The PEFT study (`rankwise peft`): rank-adaptive adapters against LoRA, AdaLoRA, LoRA+."""
