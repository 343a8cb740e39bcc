"""Routes the checkpoint tensors of routed experts to the stacked-expert modules that hold them
(``FusedMoeExperts``, or ``QuantizedMoeExperts`` for a quantized checkpoint), whichever naming
the checkpoint uses, and reports which stacked parameters ended up complete."""

from __future__ import annotations

from torch import nn

from tandem.core.layers.fused_moe import RoutedExperts
from tandem.core.layers.weights import LazyTensor


class ExpertWeights:
    def __init__(self, model: nn.Module) -> None:
        self.modules = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, RoutedExperts)
        }

    def take(self, target: str, loaded: LazyTensor, name: str) -> bool:
        """Load ``target`` (a parameter path without the model prefix) if it belongs to routed
        experts; False if it does not."""
        owner, sep, suffix = target.partition(".experts.")
        if not sep:
            return False
        module = self.modules.get(f"{owner}.experts")
        if module is None:
            raise ValueError(
                f"checkpoint tensor {name} is an expert weight of a layer the config.json gives "
                "no experts (check num_experts, decoder_sparse_step, mlp_only_layers)"
            )
        module.load_checkpoint_tensor(suffix, loaded, name)
        return True

    def loaded_parameters(self) -> set[str]:
        """Stacked parameters every expert of which was loaded."""
        return {
            f"{name}.{param}"
            for name, module in self.modules.items()
            if module.fully_loaded()
            for param in module.loaded_parameters()
        }
