"""The LM study (`rankwise lm`): dense against low-rank GPT/LLaMA on BBC News bytes."""
