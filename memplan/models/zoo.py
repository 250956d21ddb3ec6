"""memplan's own model zoo: plain ``torch.nn`` definitions, no downloads.

One job: hand tests, the demo, the CLI and the benchmarks a ready-to-run
training step by name::

    zm = zoo.build("gpt2-small", meta=True)       # 124M params, no memory
    zm = zoo.build("cnn")                         # "tiny": fwd+bwd in ms
    loss = zm.loss_fn(zm.model(*zm.example_inputs, **zm.example_kwargs))

Every model exercises something a memory planner has to get right: deep
chains (``mlp``), BatchNorm running stats, dropout and in-place ReLU
(``cnn``, ``resnet50``), attention with tied embeddings (``gpt``), long skip
connections (``unet``), ``nn.MultiheadAttention`` (``vit``), dict outputs with
a keyword input and a non-differentiable output (``dict_out``), and a
dataclass output holding nested tuples and a non-tensor object
(``hf_style``).

Sizes: ``"tiny"`` (a CPU step in milliseconds; tests), ``"small"`` (a CPU
step in roughly 0.2-2 s; benchmarks), and published sizes where they exist
(``gpt2-small``, ``gpt-1.3b``, resnet50 ``full``, vit ``b16``).  Builds are
seeded: the same (name, size, device, dtype) gives the same weights and
inputs, and the caller's global RNG state is left as it was.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memplan.models.llama import LlamaConfig, build_llama

__all__ = ["ZooModel", "aliases", "build", "names", "sizes"]


@dataclass
class ZooModel:
    """A model, example inputs, and how to turn its output into a loss."""

    name: str
    size: str
    model: nn.Module
    example_inputs: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    loss_fn: Callable[[Any], Tensor]
    description: str
    # Parameters that get no gradient from the example step, by design.
    unused_params: frozenset[str] = frozenset()

    def num_params(self) -> int:
        """Parameter count, tied parameters once."""
        return sum(p.numel() for p in self.model.parameters())

    def forward_loss(self) -> Tensor:
        return self.loss_fn(self.model(*self.example_inputs, **self.example_kwargs))

    def step(self) -> Tensor:
        """One eager forward + loss + backward; returns the (detached) loss."""
        loss = self.forward_loss()
        loss.backward()
        return loss.detach()


# ==========================================================================
# mlp
# ==========================================================================


@dataclass(frozen=True)
class MLPConfig:
    in_features: int
    hidden: int
    depth: int
    num_classes: int
    batch_size: int
    layernorm: bool = True
    activation: str = "gelu"


class MLP(nn.Module):
    """[Linear -> (LayerNorm) -> act] x depth -> Linear."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        act = {"gelu": nn.GELU, "relu": nn.ReLU}[cfg.activation]
        layers: list[nn.Module] = []
        width = cfg.in_features
        for _ in range(cfg.depth):
            layers.append(nn.Linear(width, cfg.hidden))
            if cfg.layernorm:
                layers.append(nn.LayerNorm(cfg.hidden))
            layers.append(act())
            width = cfg.hidden
        layers.append(nn.Linear(width, cfg.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _build_mlp(cfg: MLPConfig, batch: int):
    model = MLP(cfg)
    x = torch.randn(batch, cfg.in_features)
    labels = torch.randint(0, cfg.num_classes, (batch,))
    return model, (x,), {}, _cross_entropy_to(labels), frozenset()


# ==========================================================================
# cnn: a small ResNet-like network
# ==========================================================================


@dataclass(frozen=True)
class CNNConfig:
    widths: tuple[int, ...]
    image: int
    num_classes: int
    batch_size: int
    dropout: float = 0.1


class BasicBlock(nn.Module):
    """conv-BN-ReLU-dropout-conv-BN, plus the (projected) input, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        # In-place ReLU overwrites the BN output: autograd must save its result.
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.drop(self.relu(self.bn1(self.conv1(x))))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        c0 = cfg.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(3, c0, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c0),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        blocks: list[nn.Module] = []
        cin = c0
        for i, cout in enumerate(cfg.widths):
            blocks.append(BasicBlock(cin, cout, 1 if i == 0 else 2, cfg.dropout))
            blocks.append(BasicBlock(cout, cout, 1, cfg.dropout))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(cin, cfg.num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))))


def _build_cnn(cfg: CNNConfig, batch: int):
    model = CNN(cfg)
    return _image_classifier_io(model, batch, cfg.image, cfg.num_classes)


# ==========================================================================
# resnet50
# ==========================================================================


@dataclass(frozen=True)
class ResNetConfig:
    width: int  # 64 in the published ResNet-50
    image: int
    num_classes: int
    batch_size: int
    layers: tuple[int, ...] = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand x4; projection when shapes change."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity  # in-place residual add, as torchvision does
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages: list[nn.Module] = []
        cin = w
        for i, n in enumerate(cfg.layers):
            width = w * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _build_resnet50(cfg: ResNetConfig, batch: int):
    model = ResNet(cfg)
    return _image_classifier_io(model, batch, cfg.image, cfg.num_classes)


# ==========================================================================
# gpt
# ==========================================================================


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int
    d_model: int
    layers: int
    heads: int
    batch_size: int
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class GPTBlock(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        # Tied: one Parameter, two uses; its gradient is the sum of both.
        self.lm_head.weight = self.wte.weight
        self._init_weights(cfg)

    def _init_weights(self, cfg: GPTConfig) -> None:
        # GPT-2's scheme; residual projections shrink with depth.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                    std = 0.02 / math.sqrt(2 * cfg.layers)
                nn.init.normal_(p, 0.0, std)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _build_gpt(cfg: GPTConfig, batch: int):
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    targets = torch.roll(idx, -1, dims=1)  # next-token prediction

    def loss_fn(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, (idx,), {}, loss_fn, frozenset()


# ==========================================================================
# unet
# ==========================================================================


@dataclass(frozen=True)
class UNetConfig:
    base: int
    depth: int  # number of down (and up) steps
    image: int
    num_classes: int
    batch_size: int
    norm: str = "group"  # "group" or "batch"


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(8, channels), channels)


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int, norm: str) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, 1, 1, bias=False),
            _norm(norm, cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            _norm(norm, cout),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class UNet(nn.Module):
    """Encoder outputs are kept until the matching decoder level concatenates them."""

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        widths = [cfg.base * 2**i for i in range(cfg.depth + 1)]
        self.inc = DoubleConv(3, widths[0], cfg.norm)
        # Down: stride-2 conv, then a double conv.
        self.down = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(widths[i], widths[i], 3, 2, 1, bias=False),
                DoubleConv(widths[i], widths[i + 1], cfg.norm),
            )
            for i in range(cfg.depth)
        )
        # Up: transposed conv doubles the resolution; concat the skip.
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2) for i in reversed(range(cfg.depth))
        )
        self.up_conv = nn.ModuleList(
            DoubleConv(2 * widths[i], widths[i], cfg.norm) for i in reversed(range(cfg.depth))
        )
        self.outc = nn.Conv2d(widths[0], cfg.num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up, conv in zip(self.up, self.up_conv):
            x = conv(torch.cat([skips.pop(), up(x)], dim=1))
        return self.outc(x)


def _build_unet(cfg: UNetConfig, batch: int):
    model = UNet(cfg)
    x = torch.randn(batch, 3, cfg.image, cfg.image)
    mask = torch.randint(0, cfg.num_classes, (batch, cfg.image, cfg.image))
    return model, (x,), {}, _cross_entropy_to(mask), frozenset()


# ==========================================================================
# vit
# ==========================================================================


@dataclass(frozen=True)
class ViTConfig:
    image: int
    patch: int
    d_model: int
    layers: int
    heads: int
    num_classes: int
    batch_size: int
    dropout: float = 0.1


class ViTBlock(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        n_patches = (cfg.image // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(3, cfg.d_model, cfg.patch, cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, cfg.d_model) * 0.02)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*(ViTBlock(cfg) for _ in range(cfg.layers)))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, N, D]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def _build_vit(cfg: ViTConfig, batch: int):
    model = ViT(cfg)
    return _image_classifier_io(model, batch, cfg.image, cfg.num_classes)


# ==========================================================================
# dict_out: dict output, keyword input, a non-differentiable output
# ==========================================================================


@dataclass(frozen=True)
class DictOutConfig:
    in_features: int
    hidden: int
    num_classes: int
    batch_size: int


class DictOut(nn.Module):
    """Returns {"logits", "aux", "pred"}; ``pred`` is an argmax (no grad).

    ``mask`` is a keyword input; ``extra_head`` runs only with
    ``with_extra=True``, so in the example step it gets no gradient.
    """

    def __init__(self, cfg: DictOutConfig) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(cfg.in_features, cfg.hidden), nn.Tanh())
        self.cls_head = nn.Linear(cfg.hidden, cfg.num_classes)
        self.aux_head = nn.Linear(cfg.hidden, 1)
        self.extra_head = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, with_extra: bool = False) -> dict[str, Tensor]:
        if mask is not None:
            x = x * mask
        h = self.encoder(x)
        logits = self.cls_head(h)
        out = {"logits": logits, "aux": self.aux_head(h).squeeze(-1), "pred": logits.argmax(-1)}
        if with_extra:
            out["extra"] = self.extra_head(h)
        return out


def _build_dict_out(cfg: DictOutConfig, batch: int):
    model = DictOut(cfg)
    x = torch.randn(batch, cfg.in_features)
    mask = (torch.rand(batch, cfg.in_features) > 0.2).to(x.dtype)
    labels = torch.randint(0, cfg.num_classes, (batch,))

    def loss_fn(out: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(out["logits"], labels) + 0.1 * out["aux"].pow(2).mean()

    unused = frozenset({"extra_head.weight", "extra_head.bias"})
    return model, (x,), {"mask": mask}, loss_fn, unused


# ==========================================================================
# hf_style: a Hugging Face-like dataclass output with a cache object
# ==========================================================================


class TinyCache:
    """A non-tensor object the model hands back untouched (like an HF cache)."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def __repr__(self) -> str:
        return f"TinyCache(max_length={self.max_length})"


@dataclass
class TinyLMOutput:
    """What the model returns: HF ``CausalLMOutputWithPast`` in miniature."""

    loss: Tensor | None
    logits: Tensor
    # One (key, value) pair per layer, [B, heads, T, head_dim] each.
    past_key_values: tuple[tuple[Tensor, Tensor], ...]
    last_hidden_state: Tensor
    cache: TinyCache | None = None


@dataclass(frozen=True)
class HFStyleConfig:
    vocab: int
    seq: int
    d_model: int
    layers: int
    heads: int
    batch_size: int
    dropout: float = 0.1


class TinyAttentionLayer(nn.Module):
    """Explicit softmax attention (no SDPA) that also returns its key/value."""

    def __init__(self, cfg: HFStyleConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln = nn.LayerNorm(cfg.d_model)
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.ffn = nn.Sequential(
            nn.LayerNorm(cfg.d_model),
            nn.Linear(cfg.d_model, 2 * cfg.d_model),
            nn.SiLU(),
            nn.Linear(2 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, t, d = x.shape
        h = self.ln(x)

        def heads(z: Tensor) -> Tensor:
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = self.drop(scores.masked_fill(causal, float("-inf")).softmax(-1))
        y = (probs @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.ffn(x), (k, v)


class TinyLM(nn.Module):
    def __init__(self, cfg: HFStyleConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.d_model) * 0.02)
        self.layers = nn.ModuleList(TinyAttentionLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(
        self, input_ids: Tensor, labels: Tensor | None = None, cache: TinyCache | None = None
    ) -> TinyLMOutput:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        past = []
        for layer in self.layers:
            x, kv = layer(x)
            past.append(kv)
        x = self.norm(x)
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return TinyLMOutput(loss, logits, tuple(past), x, cache)


def _build_hf_style(cfg: HFStyleConfig, batch: int):
    model = TinyLM(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    labels = torch.roll(ids, -1, dims=1)
    kwargs = {"labels": labels, "cache": TinyCache(cfg.seq)}
    return model, (ids,), kwargs, _loss_field, frozenset()


def _loss_field(out: TinyLMOutput) -> Tensor:
    assert out.loss is not None, "hf_style computes its loss only when given labels"
    return out.loss


# ==========================================================================
# Shared input helpers
# ==========================================================================


def _cross_entropy_to(target: Tensor) -> Callable[[Tensor], Tensor]:
    def loss_fn(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits, target)

    return loss_fn


def _image_classifier_io(model: nn.Module, batch: int, image: int, num_classes: int):
    x = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, num_classes, (batch,))
    return model, (x,), {}, _cross_entropy_to(labels), frozenset()


# ==========================================================================
# Registry
# ==========================================================================


@dataclass(frozen=True)
class _Entry:
    builder: Callable[..., tuple]
    description: str
    sizes: dict[str, Any] = field(default_factory=dict)


_ZOO: dict[str, _Entry] = {
    "mlp": _Entry(
        _build_mlp,
        "deep MLP: Linear -> LayerNorm -> GELU blocks, classifier",
        {
            "tiny": MLPConfig(in_features=32, hidden=64, depth=4, num_classes=10, batch_size=8),
            "small": MLPConfig(in_features=512, hidden=1024, depth=8, num_classes=100, batch_size=1024),
        },
    ),
    "cnn": _Entry(
        _build_cnn,
        "small ResNet-like CNN: Conv2d, BatchNorm2d (train), in-place ReLU, dropout, residual adds",
        {
            "tiny": CNNConfig(widths=(8, 16), image=16, num_classes=10, batch_size=4),
            "small": CNNConfig(widths=(32, 64, 128), image=64, num_classes=100, batch_size=64),
        },
    ),
    "resnet50": _Entry(
        _build_resnet50,
        "ResNet-50 bottleneck network, blocks [3, 4, 6, 3]",
        {
            "tiny": ResNetConfig(width=8, image=32, num_classes=10, batch_size=2),
            "small": ResNetConfig(width=16, image=128, num_classes=100, batch_size=32),
            "full": ResNetConfig(width=64, image=224, num_classes=1000, batch_size=32),
        },
    ),
    "gpt": _Entry(
        _build_gpt,
        "GPT decoder: pre-LN blocks, causal SDPA with dropout, GELU MLP, tied LM head",
        {
            "tiny": GPTConfig(vocab=256, seq=32, d_model=64, layers=2, heads=4, batch_size=2),
            "small": GPTConfig(vocab=4096, seq=128, d_model=256, layers=4, heads=4, batch_size=16),
            "gpt2-small": GPTConfig(vocab=50257, seq=1024, d_model=768, layers=12, heads=12, batch_size=1),
            "gpt-1.3b": GPTConfig(vocab=50257, seq=2048, d_model=2048, layers=24, heads=16, batch_size=2),
        },
    ),
    "unet": _Entry(
        _build_unet,
        "U-Net: strided-conv down, ConvTranspose2d up, concatenated long skips, GroupNorm",
        {
            "tiny": UNetConfig(base=8, depth=2, image=32, num_classes=4, batch_size=2),
            "small": UNetConfig(base=16, depth=3, image=128, num_classes=4, batch_size=8),
        },
    ),
    "vit": _Entry(
        _build_vit,
        "ViT encoder: patch-embedding conv, cls token, nn.MultiheadAttention blocks, head",
        {
            "tiny": ViTConfig(image=32, patch=8, d_model=64, layers=2, heads=4, num_classes=10, batch_size=2),
            "small": ViTConfig(image=64, patch=8, d_model=256, layers=6, heads=8, num_classes=100, batch_size=16),
            "b16": ViTConfig(image=224, patch=16, d_model=768, layers=12, heads=12, num_classes=1000, batch_size=32),
        },
    ),
    "dict_out": _Entry(
        _build_dict_out,
        "dict output {logits, aux, pred (argmax, no grad)}, keyword input, an unused head",
        {
            "tiny": DictOutConfig(in_features=16, hidden=32, num_classes=5, batch_size=4),
            "small": DictOutConfig(in_features=1024, hidden=2048, num_classes=1000, batch_size=2048),
        },
    ),
    "llama": _Entry(
        build_llama,
        "Llama-style decoder: RMSNorm, rotary embeddings, causal SDPA, SwiGLU MLP, untied LM head",
        {
            "tiny": LlamaConfig(vocab=256, seq=32, d_model=64, layers=2, heads=4, hidden=172, batch_size=2),
            "small": LlamaConfig(vocab=4096, seq=128, d_model=256, layers=4, heads=4, hidden=688, batch_size=16),
            "llama-7b": LlamaConfig(vocab=32000, seq=2048, d_model=4096, layers=32, heads=32, hidden=11008,
                                    batch_size=1, dtype=torch.bfloat16),
        },
    ),
    "hf_style": _Entry(
        _build_hf_style,
        "HF-style LM returning a dataclass: loss, logits, per-layer (k, v) tuples, a cache object",
        {
            "tiny": HFStyleConfig(vocab=128, seq=16, d_model=32, layers=2, heads=2, batch_size=2),
            "small": HFStyleConfig(vocab=4096, seq=128, d_model=256, layers=4, heads=4, batch_size=16),
        },
    ),
}

# Full names that imply a size: build("gpt2-small") == build("gpt", "gpt2-small").
_ALIASES: dict[str, tuple[str, str]] = {
    "gpt2-small": ("gpt", "gpt2-small"),
    "gpt-1.3b": ("gpt", "gpt-1.3b"),
    "llama-7b": ("llama", "llama-7b"),
    "resnet50-full": ("resnet50", "full"),
    "vit-b16": ("vit", "b16"),
}


def names() -> list[str]:
    """Model names (each builds at every size in ``sizes(name)``)."""
    return list(_ZOO)


def aliases() -> dict[str, tuple[str, str]]:
    """Alias -> (model name, size)."""
    return dict(_ALIASES)


def sizes(name: str) -> list[str]:
    return list(_ZOO[_resolve(name, None)[0]].sizes)


def _resolve(name: str, size: str | None) -> tuple[str, str]:
    """Accept "gpt", "gpt:small", or an alias such as "gpt2-small"."""
    if ":" in name:
        name, spec_size = name.split(":", 1)
        if size is not None and size != spec_size:
            raise ValueError(f"size given twice: {name}:{spec_size} and size={size!r}")
        size = spec_size
    if name in _ALIASES:
        name, alias_size = _ALIASES[name]
        if size is not None and size != alias_size:
            raise ValueError(f"{name!r} is an alias for size {alias_size!r}, not {size!r}")
        size = alias_size
    if name not in _ZOO:
        known = ", ".join(names() + list(_ALIASES))
        raise KeyError(f"unknown model {name!r}; known: {known}")
    size = size or "tiny"
    if size not in _ZOO[name].sizes:
        raise KeyError(f"{name} has no size {size!r}; sizes: {', '.join(_ZOO[name].sizes)}")
    return name, size


def build(
    name: str,
    size: str | None = None,
    batch_size: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    meta: bool = False,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> ZooModel:
    """Build a zoo model in train mode with example inputs and a loss.

    ``size=None`` means the alias's size, else "tiny".  ``meta=True`` puts
    parameters and inputs on the meta device: shapes only, no memory, for
    planning models that do not fit (``gpt-1.3b``).  Weights and inputs are
    created directly on ``device`` from ``seed``, in ``dtype`` (None: the
    size's own, float32 unless it names one).  ``overrides`` replaces
    fields of the size's config (``{"layers": 48}``).
    """
    name, size = _resolve(name, size)
    entry = _ZOO[name]
    cfg = entry.sizes[size]
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    batch = batch_size if batch_size is not None else cfg.batch_size
    target = torch.device("meta") if meta else torch.device(device)
    # Seed without disturbing the caller's RNG streams.
    cuda_rng = [target.index or torch.cuda.current_device()] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_rng):
        torch.manual_seed(seed)
        # Factory calls inside (parameters, inputs, targets) land on ``target``.
        with target:
            model, inputs, kwargs, loss_fn, unused = entry.builder(cfg, batch)
    dtype = dtype or getattr(cfg, "dtype", torch.float32)  # (a size may name its own: llama-7b's bf16)
    model.to(dtype=dtype)
    inputs = tuple(_cast_float(x, dtype) for x in inputs)
    kwargs = {k: _cast_float(v, dtype) for k, v in kwargs.items()}
    model.train()
    desc = f"{name} ({size}): {entry.description}"
    return ZooModel(
        name=name,
        size=size,
        model=model,
        example_inputs=inputs,
        example_kwargs=kwargs,
        loss_fn=loss_fn,
        description=desc,
        unused_params=unused,
    )


def _cast_float(x: Any, dtype: torch.dtype) -> Any:
    # Token ids, labels and masks of integer type keep their dtype.
    if isinstance(x, Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x
