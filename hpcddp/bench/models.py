"""The reference models of ``hpcddp bench train``: one bandwidth-bound, one compute-bound."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MODELS", "Workload", "build_workload", "conv_net", "mlp"]


def mlp(width: int = 1024, depth: int = 8) -> nn.Sequential:
    """Build ``depth`` x (Linear(width, width) + ReLU): 8.4M parameters by default, little compute per byte."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def conv_net(num_classes: int = 10) -> nn.Sequential:
    """Build five 3x3 conv+BatchNorm+ReLU blocks (32 to 256 channels, two max-pools) and a linear head.

    About 0.54M parameters and ~3 GFLOP per 32x32 sample batch of 32: much compute per byte.
    """
    channels = (3, 32, 64, 128, 128, 256)
    layers: list[nn.Module] = []
    for block, (cin, cout) in enumerate(zip(channels, channels[1:])):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        if block in (1, 3):
            layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels[-1], num_classes)]
    return nn.Sequential(*layers)


@dataclass
class Workload:
    """A model with a fixed random batch and its loss."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def batch_size(self) -> int:
        return self.inputs.shape[0]

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Run ``model`` (this workload's model or a wrapper of it) forward on the batch."""
        return nn.functional.cross_entropy(model(self.inputs), self.targets)


#: name -> (model builder, input shape of one sample, number of classes)
MODELS = {"mlp": (mlp, (1024,), 1024), "conv": (conv_net, (3, 32, 32), 10)}


def build_workload(name: str, batch_size: int = 32, seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    """Build model ``name`` ("mlp" or "conv") with one random batch; the same weights for every seed.

    Args:
        name: a key of ``MODELS``.
        batch_size: samples per rank per step.
        seed: seeds the batch (pass the rank so ranks see different data).
        device: where the model and batch live (``hpcddp.device()``).
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    build, shape, classes = MODELS[name]
    torch.manual_seed(1234)
    model = build()
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((batch_size, *shape), generator=generator)
    targets = torch.randint(0, classes, (batch_size,), generator=generator)
    return Workload(name, model.to(device), inputs.to(device), targets.to(device))
