"""The head: a language model's vocabulary projection and cross-entropy, chunked and fused.

NOTE [ Chunked head ]
At the loss of a causal language model the logits ``(N, V)`` (N tokens, V the vocabulary) are
alive several times over: the logits, their float copy, ``log_softmax``'s saved output and, in
backward, the gradient of each. With V in the tens of thousands this is often the peak of the
whole step, above every block's activations: on hf:gpt2 (vocab 8192, 1024 tokens, fp32) about
100 MB, more than two blocks' worth; for a Llama-3-sized vocabulary (128k) at 8k tokens, 4 GiB per
copy in fp32. No block plan can lower it: the peak of policy ``all`` is set here.

The ``chunked`` head option computes the loss in chunks of rows and, in the same pass, the loss's
gradients with respect to the hidden states, the projection's weight and its bias (the fused linear
cross-entropy of Liger-Kernel and "Cut Your Losses"): per chunk, ``logits = h W^T + b``, the loss
``logsumexp(logits) - logits[target]`` over rows whose target is not ``ignore_index``, and
``g = softmax(logits) - onehot(target)`` (zero on ignored rows), so ``dh = g W``, ``dW += g^T h``,
``db += sum(g)``. The gradients are kept until backward, where they are scaled by the loss's
incoming gradient (the normaliser, a GradScaler's scale). The floating-point work is that of the
plain head (one projection forward, two in backward) moved into the forward; memory is one chunk of
logits plus ``dh`` (the size of the hidden states) and ``dW`` (the size of the weight), instead of
several ``(N, V)`` tensors. Gradients equal the plain head's up to summation order (tests: fp64).

Memory: every buffer of the chunk loop is a tensor that an op returns, so memfit's tracker sees
what the allocator sees (tests/test_exactness.py). ``torch.logsumexp`` is not used for that reason:
its CPU kernel allocates ``exp(logits - max)``, a whole chunk of logits (4 MiB on hf:gpt2), inside
the kernel, where no dispatch mode sees it; the loop computes max, exp and sum itself, in place.

Applying it to a transformers ``*ForCausalLM`` model (:func:`install_chunked_head`) changes three
forwards and nothing in the module tree: the model's forward notes whether this call computes a
training loss (labels given, gradients enabled), the output embedding (``lm_head``) then returns a
placeholder on the meta device instead of the logits and keeps its input, and the model's
``loss_function`` computes the fused loss from that input with ``ForCausalLMLoss``'s semantics
(labels shifted by one unless ``shift_labels`` is given, ``ignore_index``, ``num_items_in_batch``:
sum divided by it, else mean). Calls without labels, or without gradients, run the plain head.

Known limitations:
- With the chunked head, a training call with labels returns ``logits`` as a meta-device
  placeholder of the right shape (reading its values raises): the logits are never materialised.
  Compiled (``torch.compile``), that call returns ``logits=None``: a meta placeholder would be a
  graph output, and torch's memory-budget partitioner (``activation_memory_budget`` < 1) cannot
  size one ("Node empty_strided_default didn't have `val` metadata", torch 2.13).
- Models that transform logits between the projection and the loss (Gemma's soft-capping,
  Cohere's logit scale, Granite's logit scaling) are refused; ``memfit.profiling.blocks`` also
  compares the chunked loss with the plain one and drops the option when they differ.
- Only causal language models; a masked-LM head (BERT) runs a transform before its projection.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.capture.snapshot import seed_generators
from memfit.errors import PlanMismatchError
from memfit.plan.types import HEAD_OPTIONS
from memfit.workload import mean_loss

MIN_CHUNK_ROWS = 128
"""Fewest rows per chunk: smaller matmuls run far below peak speed (CPU and GPU alike)."""
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scaling")
_STATE_ATTR = "_memfit_head"  # on the model: the installed head's state


# --- the fused function --------------------------------------------------------------------------


def chunk_rows(n_rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: a chunk's logits about the size of all hidden states, at least MIN_CHUNK_ROWS."""
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, math.ceil(n_rows * hidden / max(1, vocab)))))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        rows: int,
        ignore_index: int,
        grads: bool,
    ) -> torch.Tensor:
        need_h, need_w, need_b = (grads and n for n in ctx.needs_input_grad[:3])
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (
            torch.zeros(
                weight.shape,
                dtype=torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype,
                device=weight.device,
            )
            if need_w
            else None
        )
        grad_b = (
            torch.zeros(bias.shape, dtype=grad_w.dtype if grad_w is not None else torch.float32, device=bias.device)
            if (bias is not None and need_b)
            else None
        )
        loss = torch.zeros(
            (), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32, device=hidden.device
        )
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]  # (n, H)
            t = targets[s : s + rows]  # (n,)
            logits = F.linear(h, weight, bias).to(loss.dtype)  # (n, V), upcast as HF's loss does
            valid = t != ignore_index
            tc = t.masked_fill(~valid, 0)
            # A float mask: a bool one is cast inside every kernel that mixes it with floats, unseen.
            valid_f = valid.to(logits.dtype)  # (n,) 1 where the row has a target
            picked = logits.gather(1, tc[:, None]).squeeze(1)
            # logsumexp by hand, in place: torch.logsumexp allocates an (n, V) temporary inside its
            # kernel, which the tracker cannot see (NOTE [ Chunked head ], "Memory").
            row_max = logits.amax(dim=-1, keepdim=True)  # (n, 1)
            e = logits.sub_(row_max).exp_()  # (n, V) exp(logits - max), in place of the chunk's logits
            sum_e = e.sum(dim=-1)  # (n,)
            lse = row_max.squeeze(1) + sum_e.log()
            loss += ((lse - picked) * valid_f).sum()
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            g = e.div_(sum_e[:, None])  # softmax, in place
            g.scatter_add_(1, tc[:, None], -valid_f[:, None])
            g.mul_(valid_f[:, None])
            if grad_b is not None:
                grad_b += g.sum(0).to(grad_b.dtype)
            g = g.to(hidden.dtype)
            if grad_h is not None:
                torch.mm(g, weight.to(hidden.dtype), out=grad_h[s : s + rows])
            if grad_w is not None:
                grad_w.addmm_(g.t().to(grad_w.dtype), h.to(grad_w.dtype))
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        go = grad_loss.to(torch.float64 if grad_loss.dtype == torch.float64 else torch.float32)
        return (
            (grad_h * go).to(grad_h.dtype) if grad_h is not None else None,
            (grad_w * go).to(ctx.weight_dtype) if grad_w is not None else None,
            (grad_b * go).to(ctx.weight_dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    rows: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, chunked (NOTE [ Chunked head ]).

    Equals ``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=...,
    reduction="sum")`` in value and gradients (up to summation order) without materialising the
    ``(N, V)`` logits. With gradients enabled they are computed during the forward and kept for
    backward (calling it then without a backward wastes that work; under ``torch.no_grad()`` only
    the loss is computed); double backward is not supported.

    Args:
        hidden: ``(N, H)`` hidden states (flatten batch and time first).
        weight: ``(V, H)`` projection weight (tied embeddings are fine).
        targets: ``(N,)`` class indices, ``ignore_index`` for rows without a target.
        bias: optional ``(V,)``.
        ignore_index: target value of rows left out of the loss.
        rows: rows per chunk (default :func:`chunk_rows`).

    Returns:
        The summed loss, a 0-d float32 tensor (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden must be (N, H) and targets (N,); got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    n_rows = rows or chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
    # Forward runs with gradients off inside autograd: decide here whether a backward can come.
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, max(1, n_rows), ignore_index, grads)


# --- installing it on a transformers causal LM -----------------------------------------------------


def head_unsupported_reason(model: nn.Module) -> str | None:
    """Why the chunked head cannot be installed on ``model`` (None when it can)."""
    name = type(model).__name__
    if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return f"{name} is not a transformers causal language model (*ForCausalLM / *LMHeadModel)"
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return f"{name}'s output embedding is {type(head).__name__}, not an nn.Linear"
    if "loss_function" not in dir(type(model)):
        return f"{name} has no loss_function (transformers too old for this head option)"
    config = getattr(model, "config", None)
    for attr in _LOGIT_TRANSFORMS:
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return f"{name} transforms its logits before the loss ({attr}={getattr(config, attr)!r})"
    return None


class _HeadState:
    """What the installed head needs between the model's forward, lm_head and the loss. It lives
    in the model's and the head's ``__dict__`` (so ``copy.deepcopy``, pickle and ``torch.save`` of
    the model carry it along, without the transient state of a call in progress)."""

    def __init__(self, model: nn.Module, head: nn.Linear) -> None:
        self.head = head
        self.armed = False  # this call computes a training loss
        self.hidden: torch.Tensor | None = None
        self.plain_loss = type(model).loss_function.fget(model)  # what the model would use
        self.saved = {
            (0, "forward"): model.__dict__.get("forward"),
            (1, "forward"): head.__dict__.get("forward"),
            (0, "_loss_function"): model.__dict__.get("_loss_function"),
        }
        self.had = {k for k in self.saved if k[1] in (model, head)[k[0]].__dict__}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "armed": False, "hidden": None}


def _model_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _HeadState = self.__dict__[_STATE_ATTR]
    arm = torch.is_grad_enabled() and (kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None)
    state.armed, state.hidden = arm, None
    try:
        orig = state.saved[(0, "forward")] if (0, "forward") in state.had else type(self).forward.__get__(self)
        out = orig(*args, **kwargs)
        logits = getattr(out, "logits", None) if arm and torch.compiler.is_compiling() else None
        if isinstance(logits, torch.Tensor) and logits.device.type == "meta":
            out = type(out)(
                **{k: v for k, v in out.items() if k != "logits"}
            )  # compiled: no meta graph output (Known limitations)
        return out
    finally:
        state.armed, state.hidden = False, None


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state: _HeadState = self.__dict__[_STATE_ATTR]
    if not state.armed:
        return F.linear(x, self.weight, self.bias)
    state.hidden = x
    return torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device="meta")


def _loss_function(
    state: _HeadState,
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    if not (state.armed and state.hidden is not None and logits.device.type == "meta"):
        fn = state.saved[(0, "_loss_function")] if (0, "_loss_function") in state.had else state.plain_loss
        return fn(logits, labels, vocab_size, **kwargs)
    ignore_index = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden, state.hidden = state.hidden, None
    head = state.head
    total = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        shift.reshape(-1).to(hidden.device),
        head.bias,
        ignore_index=ignore_index,
    )
    n = kwargs.get("num_items_in_batch")
    if n is None:  # ForCausalLMLoss's mean over the rows with a target
        return total / (shift != ignore_index).sum().to(total.device)
    return total / (n.to(total.device) if torch.is_tensor(n) else n)


def install_chunked_head(model: nn.Module) -> None:
    """Install the chunked head on a transformers causal LM (NOTE [ Chunked head ]).

    Raises:
        PlanMismatchError: the model cannot take it (the message says why and what to do).
    """
    why = head_unsupported_reason(model)
    if why is not None:
        raise PlanMismatchError(
            f"memfit.apply: the plan's head option 'chunked' cannot be applied: {why}. Make a plan for "
            "this model (`memfit plan`), which offers the option only where it applies."
        )
    if _STATE_ATTR in model.__dict__:
        return
    head = model.get_output_embeddings()
    state = _HeadState(model, head)
    # Partials of module-level functions pickle with the model (NOTE [ Saving applied models ] in
    # memfit.apply.engine); bound methods of functions the class lacks would not load.
    model.__dict__["forward"] = functools.partial(_model_forward, model)
    head.__dict__["forward"] = functools.partial(_head_forward, head)
    model.__dict__["_loss_function"] = functools.partial(_loss_function, state)
    model.__dict__[_STATE_ATTR] = state
    head.__dict__[_STATE_ATTR] = state


def remove_chunked_head(model: nn.Module) -> None:
    """Undo :func:`install_chunked_head` (a no-op when it is not installed)."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    state.head.__dict__.pop(_STATE_ATTR, None)
    for (which, key), old in state.saved.items():
        obj = (model, state.head)[which]
        obj.__dict__.pop(key, None)
        if (which, key) in state.had:
            obj.__dict__[key] = old


def head_mismatch(model: nn.Module, batch: Any, loss_fn: Any, *, seed: int = 0) -> str | None:
    """Run ``loss_fn`` forward and backward with the model's head and with the chunked head, from
    the same weights and random state; None when loss and gradients agree, else what differs.

    The check behind offering the option (:func:`memfit.profiling.blocks.profile`): it catches a
    model whose forward does more between its projection and its loss than this module knows of.
    Gradients are left unset afterwards.
    """
    results = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        if chunked:
            install_chunked_head(model)
        try:
            with torch.random.fork_rng(devices=[d for d in {p.device for p in model.parameters()} if d.type == "cuda"]):
                seed_generators(seed)  # NumPy's and Python's too: the forward may draw from them
                loss = mean_loss(loss_fn(model, batch))
                loss.backward()
        finally:
            if chunked:
                remove_chunked_head(model)
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
        results.append((float(loss.detach()), grads))
    model.zero_grad(set_to_none=True)
    (l0, g0), (l1, g1) = results
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)
    if not abs(l0 - l1) <= tol * max(1.0, abs(l0)):
        return f"the chunked loss is {l1!r}, the model's own {l0!r}"
    scale = max((g.abs().max().item() for g in g0 if g is not None), default=0.0) or 1.0
    for (name, _), a, b in zip(model.named_parameters(), g0, g1, strict=True):
        if (a is None) != (b is None):
            return f"the gradient of {name} is {'missing' if b is None else 'extra'} with the chunked head"
        if a is not None and (a - b).abs().max().item() > tol * scale:
            return f"the gradient of {name} differs by {(a - b).abs().max().item():.3g} (largest gradient {scale:.3g})"
    return None


def head_installed(model: nn.Module) -> bool:
    """True when the chunked head is installed on ``model``."""
    return _STATE_ATTR in model.__dict__


__all__ = [
    "HEAD_OPTIONS",
    "chunk_rows",
    "fused_linear_cross_entropy",
    "head_installed",
    "head_mismatch",
    "head_unsupported_reason",
    "install_chunked_head",
    "remove_chunked_head",
]
