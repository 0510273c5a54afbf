"""Rank-adaptive adapters (DLRT/SDLRT) for pretrained models, in the conventions of HF PEFT.

``get_adapter_model(model, AdapterConfig(["query", "key", "value"], r=10))`` wraps Linear layers
as frozen W0 plus a trainable U S Vᵀ adapter; ``adapter_optimizer(model, lr)`` (or
``rankwise.SDLRT`` / ``rankwise.DLRT`` directly) trains them; ``save_adapter`` /
``load_adapter`` / ``merge_and_unload`` / ``export_peft_lora`` take them elsewhere;
``trainable_parameters`` / ``print_trainable_parameters`` count what is trained as PEFT does. Needs the
``rankwise[peft]`` extra only for ``export_peft_lora`` (PEFT) and safetensors.
"""

from ._config import AdapterConfig as AdapterConfig
from ._count import print_trainable_parameters as print_trainable_parameters
from ._count import trainable_parameters as trainable_parameters
from ._layer import AdapterLinear as AdapterLinear
from ._model import adapter_budget as adapter_budget
from ._model import adapter_optimizer as adapter_optimizer
from ._model import adapters as adapters
from ._model import export_peft_lora as export_peft_lora
from ._model import get_adapter_model as get_adapter_model
from ._model import load_adapter as load_adapter
from ._model import merge_and_unload as merge_and_unload
from ._model import save_adapter as save_adapter


def __getattr__(name: str):
    if name == "RankwiseTrainer":  # imports transformers: only when asked for
        from ._trainer import RankwiseTrainer

        return RankwiseTrainer
    raise AttributeError(f"module 'rankwise.peft' has no attribute {name!r}")

__all__ = ["AdapterConfig", "AdapterLinear", "adapter_budget", "adapter_optimizer", "adapters",
           "export_peft_lora", "get_adapter_model", "load_adapter", "merge_and_unload",
           "print_trainable_parameters", "save_adapter", "trainable_parameters"]
