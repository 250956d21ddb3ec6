"""Small models written the way library code writes them: test subjects for prediction checks.

The tests of byte counts and generality and `benchmarks.studies.prediction_accuracy` plan them.

Most keep several views of one storage alive after the op that made them is
done: ``nn.LSTM`` and ``nn.GRU`` unbind their input projection over time
steps, GPT-2-style attention splits one projection into q, k and v, and a
LLaMA-style gated MLP chunks one projection into gate and value. A Fourier
neural operator assigns into a slice, which the joint graph turns into ATen's
functional copy and scatter ops, whose outputs clone all of a storage.
memplan's zoo models happen to do neither, so these are where its alias
accounting (`solvers.core.memory`) and byte counts (`memplan.costs.cost_model`) are checked
against measurement.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SplitAttention(nn.Module):
    """GPT-2's attention as the usual code writes it: one projection split into q, k, v."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, dim=2))
        w = ((q @ k.transpose(-1, -2)) / (D // self.heads) ** 0.5).softmax(-1)
        return x + self.out((w @ v).transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    """Residual gated MLPs whose one projection is chunked into gate and value."""

    def __init__(self, d: int = 32, layers: int = 2):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(d, 8 * d) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            gate, value = up(x).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * value)
        return x


class SpectralConv(nn.Module):
    """Fourier-neural-operator layers: FFT, mix the lowest modes, write them into a zeroed
    spectrum by slice assignment (a functional copy into a strided slice), inverse FFT."""

    def __init__(self, channels: int = 8, modes: int = 6, layers: int = 3):
        super().__init__()
        self.modes = modes
        self.lift, self.project = nn.Conv1d(2, channels, 1), nn.Conv1d(channels, 1, 1)
        self.weights = nn.ParameterList(
            nn.Parameter(0.1 * torch.randn(channels, channels, modes, dtype=torch.cfloat)) for _ in range(layers))
        self.skips = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(x)
        for weight, skip in zip(self.weights, self.skips):
            spectrum = torch.fft.rfft(x)
            mixed = torch.zeros_like(spectrum)
            mixed[..., : self.modes] = torch.einsum("bim,iom->bom", spectrum[..., : self.modes], weight)
            x = F.gelu(torch.fft.irfft(mixed, n=x.shape[-1]) + skip(x))
        return self.project(x)


# name -> () -> (model, example inputs), sized so that activations outweigh parameters.
LIBRARY_STYLE: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "lstm": lambda: (nn.LSTM(8, 16, num_layers=2, batch_first=True), (torch.randn(32, 6, 8),)),
    "gru": lambda: (nn.GRU(8, 16, batch_first=True), (torch.randn(32, 6, 8),)),
    "split_attention": lambda: (SplitAttention(), (torch.randn(16, 32, 32),)),
    "swiglu": lambda: (SwiGLU(), (torch.randn(512, 32),)),
    "spectral_conv": lambda: (SpectralConv(), (torch.randn(8, 2, 64),)),
}


def square_loss(out) -> torch.Tensor:
    """Mean square of every floating output that needs a gradient (tuples of outputs included)."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return sum(t.pow(2).mean() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)
