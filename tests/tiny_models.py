"""Tiny models and batches shared by the tests (CPU, fast), and the profiler's measure of a
step's peak (the second method memory tests compare memfit with)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from memfit.accumulate import Accumulator
from memfit.capture.tracker import MemoryTracker, profiler_peak_bytes
from memfit.workload import Batch, Workload, batch_size_of, iter_tensors, reduce_loss


class TinyBlock(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class TinyTokenLM(nn.Module):
    """Embedding, a chain of residual MLP blocks with a causal mixing step, and a head."""

    def __init__(self, vocab: int = 37, d: int = 16, n_layer: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TinyBlock(d, dropout) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, d)
        # causal running mean so that positions interact (like attention, but cheap)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # (B, T, V)


def token_batch(batch_size: int, seq_len: int = 12, vocab: int = 37, *, sort: bool = False) -> dict[str, torch.Tensor]:
    """Random tokens, random lengths in [2, seq_len], right-padded; optionally sorted by length."""
    lengths = torch.randint(2, seq_len + 1, (batch_size,))
    if sort:
        lengths = lengths.sort().values
    idx = torch.randint(0, vocab, (batch_size, seq_len))
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]
    return {"idx": idx.masked_fill(~mask, 0), "mask": mask}


def token_samples(samples: int, seq_len: int, *, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``samples`` single token samples (a framework's data set: its loader batches them)."""
    torch.manual_seed(seed)
    batch = token_batch(samples, seq_len=seq_len)
    return [{k: v[i] for k, v in batch.items()} for i in range(samples)]


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over valid positions, and their number."""
    logits = model(batch["idx"])[:, :-1]  # (B, T-1, V)
    valid = batch["mask"][:, 1:] & batch["mask"][:, :-1]
    targets = batch["idx"][:, 1:].masked_fill(~valid, -100)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, valid.sum()


def token_count(batch: dict[str, torch.Tensor]) -> int:
    m = batch["mask"]
    return int((m[:, 1:] & m[:, :-1]).sum())


def token_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the anchors' documented loops use: each batch's own token mean."""
    s, c = token_loss(model, batch)
    return s / c


def token_workload(*, sort: bool = False, dropout: float = 0.0, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    return Workload(
        name="tiny-token",
        model=TinyTokenLM(dropout=dropout),
        make_batch=lambda b: token_batch(b, sort=sort),
        loss_fn=token_loss,
        count_fn=token_count,
    )


class TinyRegressor(nn.Module):
    def __init__(self, d_in: int = 6, bn: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, 8)
        self.bn = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def regression_batch(batch_size: int, d_in: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, d_in), torch.randn(batch_size, 1)


def mse_mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def mean_workload(seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    return Workload(name="tiny-mean", model=TinyRegressor(), make_batch=regression_batch, loss_fn=mse_mean)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The comparison every memfit verify path uses (memfit.verification.gradients, NOTE [ Gradient floor ])."""
    from memfit.verification.gradients import compare_gradients

    assert len(got) == len(want)
    return compare_gradients(got, want).max_rel_err


# --- a chain whose saved bytes are known by hand ----------------------------------------------------

SAVED_WIDTH = {"relu": 5, "gelu": 9, "tanh": 5}
"""Bytes a :class:`MLPBlock` saves for backward, in units of one ``(B, d)`` float tensor: ``fc1``
saves its input (1); ReLU and Tanh save their output (4), which is also ``fc2``'s saved input; GELU
saves its input (4) and ``fc2`` its output (4)."""


class MLPBlock(nn.Module):
    """``x + fc2(act(fc1(x)))`` with a 4x wide hidden layer."""

    def __init__(self, d: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[act]()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class MLPChain(nn.Module):
    def __init__(self, acts: tuple[str, ...], d: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MLPBlock(d, a) for a in acts))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def mlp_chain_workload(
    acts: tuple[str, ...] = ("relu", "gelu", "tanh", "gelu"), d: int = 16, seed: int = 0
) -> Workload:
    """A chain of MLP blocks on ``(B, d)`` float32 inputs with a mean squared error."""
    torch.manual_seed(seed)

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_size)  # the same batch whatever the RNG state
        return torch.randn(batch_size, d, generator=g), torch.randn(batch_size, 1, generator=g)

    return Workload(name="mlp-chain", model=MLPChain(acts, d), make_batch=make_batch, loss_fn=mse_mean)


def profiler_step_peak_bytes(step: Callable[[], object], live: Iterable[torch.Tensor]) -> int:
    """Peak bytes of ``step`` by the torch profiler's allocation events (not memfit's tracker):
    what ``step`` allocates at its highest, plus the distinct storages of ``live`` (the tensors
    alive before it: parameters, gradients, optimizer state, batch)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}
    return sum(storages.values()) + profiler_peak_bytes(step)


def step_peaks_bytes(
    model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
) -> tuple[int, int]:
    """Peak of an AdamW training step (after a first one: its optimizer state exists), measured
    twice: by memfit's tracker over one step, and by the torch profiler over the next."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = MemoryTracker(device="cpu").track(model, opt, batch)
    with tracker:
        step()
    live = [*model.parameters(), *model.buffers(), *iter_tensors(batch)]
    live += [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    return tracker.peak_bytes, profiler_step_peak_bytes(step, live)


def saved_tensor_counts(
    model: nn.Module, blocks: list[nn.Module], batch: Batch, loss_fn: Callable[..., object]
) -> list[tuple[int, int]]:
    """(saved bytes, output bytes) per block, from one forward of the model itself: saved-tensor
    hooks collect the distinct storages autograd saves while each block runs (parameters and
    buffers left out, as memfit's definition says), forward hooks the output's bytes."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current: list[int] = []
    saved: list[dict[int, int]] = [{} for _ in blocks]
    outputs = [0] * len(blocks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if current and st.data_ptr() not in own:
            saved[current[-1]][st.data_ptr()] = st.nbytes()
        return t

    def enter(i: int) -> None:
        current.append(i)

    def leave(i: int, out: torch.Tensor) -> None:
        current.pop()
        outputs[i] = out.untyped_storage().nbytes()

    handles = []
    for i, blk in enumerate(blocks):
        handles.append(blk.register_forward_pre_hook(lambda _m, _a, i=i: enter(i)))
        handles.append(blk.register_forward_hook(lambda _m, _a, out, i=i: leave(i, out)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    return [(sum(s.values()), o) for s, o in zip(saved, outputs, strict=True)]


def wrong_accumulator(kind: str) -> type[Accumulator]:
    """An Accumulator that accumulates wrongly, for checks that must fail it: ``missing`` (the last
    micro-batch adds nothing), ``count`` (one token too many in the window's count, in both the
    count_fn and the loss's counts, so that the Accumulator's own check cannot see it) or ``scaled``
    (each micro-batch's loss multiplied by the number of micro-steps)."""

    class Wrong(Accumulator):
        def step(self, batch, loss_fn, count_fn=None):  # type: ignore[no-untyped-def,override]
            k = len(range(0, batch_size_of(batch), self.micro_batch))
            seen: list[int] = []

            def wrong_loss(model, micro):  # type: ignore[no-untyped-def]
                loss, count = reduce_loss(loss_fn(model, micro))
                seen.append(1)
                if kind == "missing" and len(seen) == k:
                    return loss * 0.0, count
                if kind == "scaled":
                    return loss * k, count
                if kind == "count" and len(seen) == 1:
                    return loss, count + 1
                return loss, count

            def wrong_count(b):  # type: ignore[no-untyped-def]
                return count_fn(b) + (1 if kind == "count" else 0)

            return super().step(batch, wrong_loss, wrong_count if count_fn is not None else None)

    return Wrong


# --- skip-connection models (U-Net, DenseNet), plain torch as users write them -------------------


def double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
    )  # fmt: skip


class UNet(nn.Module):
    """The U-Net of the tutorials: encoder and decoder lists, a bottleneck twice as wide."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), n_classes: int = 2) -> None:
        super().__init__()
        self.encoder = nn.ModuleList()
        c = 3
        for w in widths:
            self.encoder.append(double_conv(c, w))
            c = w
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = double_conv(widths[-1], 2 * widths[-1])
        self.ups = nn.ModuleList()
        self.decoder = nn.ModuleList()
        c = 2 * widths[-1]
        for w in reversed(widths):
            self.ups.append(nn.ConvTranspose2d(c, w, 2, stride=2))
            self.decoder.append(double_conv(2 * w, w))
            c = w
        self.head = nn.Conv2d(widths[0], n_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec in zip(self.ups, self.decoder, strict=True):
            x = dec(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


class DenseLayer(nn.Module):
    """torchvision's _DenseLayer: takes the list of earlier features, concatenates it itself."""

    def __init__(self, c_in: int, growth: int, expand: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, expand * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(expand * growth)
        self.conv2 = nn.Conv2d(expand * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        return self.conv2(F.relu(self.norm2(self.conv1(F.relu(self.norm1(x))))))


class DenseNet(nn.Module):
    """Each layer takes the list of all earlier outputs, as torchvision's DenseNet layers do."""

    def __init__(self, c0: int = 16, growth: int = 8, n: int = 6, n_classes: int = 5, expand: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c0, 3, padding=1)
        self.layers = nn.ModuleList(DenseLayer(c0 + i * growth, growth, expand) for i in range(n))
        self.classifier = nn.Linear(c0 + n * growth, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        return self.classifier(torch.cat(features, 1).mean((2, 3)))
