"""Where each zoo model keeps its repeated blocks, for the checkpointing peers.

``torch.utils.checkpoint`` needs to be told what a "block" is. A
:class:`BlockLayout` names the containers (``nn.Sequential`` or
``nn.ModuleList``) whose children are the blocks, relative to the zoo model.
The known zoo models have a layout written down here; any other model gets
one by :func:`discover_layout`, which takes every direct child container
holding at least two modules.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class BlockLayout:
    """The blocks of one model, as seen by the checkpointing baselines.

    ``stages``: dotted paths of containers whose children are the blocks.
    ``group``: consecutive children that form one block (the deep MLP's
    Linear, LayerNorm, GELU triples).
    ``singles``: dotted paths of single modules that are blocks too.
    ``chain``: True when every stage is a pure chain, each child consuming
    only its predecessor's output, so ``checkpoint_sequential`` applies.
    ``why_not_chain``: shown in the table when ``chain`` is False.
    """

    stages: tuple[str, ...]
    group: int = 1
    singles: tuple[str, ...] = ()
    chain: bool = True
    why_not_chain: str = ""


# Paths are relative to the zoo model (memplan.WithLoss puts it under "model").
LAYOUTS: dict[str, BlockLayout] = {
    # GPT: self.blocks is a ModuleList applied one after another.
    "gpt": BlockLayout(stages=("blocks",)),
    # ResNet-50: four nn.Sequential stages of Bottlenecks.
    "resnet50": BlockLayout(stages=("layer1", "layer2", "layer3", "layer4")),
    "cnn": BlockLayout(stages=("blocks",)),
    # U-Net: every encoder output is a skip connection read by the decoder, so
    # neither the encoder nor the decoder is a chain of blocks.
    "unet": BlockLayout(
        stages=("down", "up", "up_conv"),
        singles=("inc",),
        chain=False,
        why_not_chain="encoder outputs are skip connections",
    ),
    # ViT: self.blocks is an nn.Sequential of encoder blocks.
    "vit": BlockLayout(stages=("blocks",)),
    # Deep MLP: self.net is [Linear, LayerNorm, GELU] x depth + Linear.
    "mlp": BlockLayout(stages=("net",), group=3),
    "hf_style": BlockLayout(
        stages=("layers",), chain=False, why_not_chain="layers return (hidden, (k, v)) pairs"
    ),
}


def discover_layout(model: nn.Module) -> BlockLayout:
    """A layout for a model not listed in :data:`LAYOUTS`: its direct child containers."""
    stages = tuple(
        name
        for name, child in model.named_children()
        if isinstance(child, (nn.Sequential, nn.ModuleList)) and len(child) >= 2
    )
    return BlockLayout(
        stages=stages,
        chain=bool(stages) and all(isinstance(model.get_submodule(s), nn.Sequential) for s in stages),
        why_not_chain="" if stages else "no block containers found",
    )


def layout_for(name: str, model: nn.Module) -> BlockLayout:
    """The layout of zoo model ``name`` (``model`` is the zoo model itself)."""
    return LAYOUTS.get(name) or discover_layout(model)
