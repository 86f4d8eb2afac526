"""Workloads built from transformers model types: ``hf:TYPE?key=value&...``.

The model is built from its config with random weights (``from_config``), so nothing is
downloaded. The config is the library's defaults with small CPU-friendly sizes (12 layers, width
256, feed-forward 1024, 4 heads, vocab 8192) and then the spec's overrides; a size memfit derives
from one the spec gives is the library's instead (a spec's width gets the library's feed-forward
width: NOTE [ Spec defaults ]). The task follows from the model type:

- decoders (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``opt``, ``gpt_neox``, ...): causal
  language modelling, token-level loss ``(loss_sum, count)`` over valid next-token positions;
- encoders (``bert``, ``roberta``, ``distilbert``, ``electra``, ...): masked language modelling,
  ~15 % of the valid tokens replaced by a mask id, loss summed over those tokens;
- vision transformers (``vit``, ``deit``, ...): image classification on random images, mean loss.

The model is built with the library's defaults (``use_cache=True`` included: a recomputed layer
fills the cache once, NOTE [ A recomputed layer fills its cache once ] in :mod:`memfit.apply.kv_cache`) and
trained with its own loss (``ForCausalLMLoss`` with ``num_items_in_batch`` for a token sum).
In float64, transformers' loss would round the logits to float32 (``logits.float()``):
:func:`memfit.models.hf_loss.float64_loss` computes the same loss in float64 while a float64 model runs it.

Token batches are variable-length (each row ``T // 2`` to ``T`` tokens) and right-padded, so the
loss must be normalised by the number of valid tokens, which ``count_fn`` gives without a forward.
The spec key ``padding=false`` makes every row ``T`` tokens long instead (packed long-context
training): the attention mask is then all ones and transformers passes no mask to SDPA (a padded
batch makes a ``(B, 1, T, T)`` mask, memory quadratic in ``T``; :mod:`memfit.capture.attention`).

Known limitations:
    Encoder-decoder types (``t5``, ``bart``, ``pegasus``, ...) are refused: their two stacks of
    blocks do not form one chain. Only the generic size names are defaulted; a config with its own
    fixed sizes (for example Gemma's ``head_dim=256``) keeps them unless overridden.

Size: one module for the ``hf:`` spec: building the config and model, and the
batches and losses of the three tasks it picks between, which read together.

Example:
    >>> from memfit.models.registry import load_workload
    >>> wl = load_workload("hf:llama?num_hidden_layers=2&hidden_size=64")
    >>> loss_sum, count = wl.loss_fn(wl.model, wl.make_batch(2))
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import SpecError
from memfit.models.hf_loss import float64_loss
from memfit.workload import PositionLimit, Workload

__all__ = ["build_hf_workload", "HF_DEFAULTS"]

HF_DEFAULTS: dict[str, int] = {
    "hidden_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 8192,
    "max_position_embeddings": 512,
}
"""Sizes applied (where the config has the field) before the spec's overrides. The positions apply to
a learned table only: a rotary model keeps its family's own ``max_position_embeddings`` (NOTE
[ Spec defaults ])."""

DEFAULT_SEQ_LEN = 256  # tokens per row
DEFAULT_BATCH_SIZE = 4
DEFAULT_IMAGE_SIZE = 128  # pixels; 64 patches of 16 x 16 for ViT
DEFAULT_NUM_LABELS = 10
MLM_PROBABILITY = 0.15
FIRST_CONTENT_ID = 8  # random token ids start here, clear of pad/bos/eos/mask ids

# Model-specific names for the feed-forward width, tried when a config has no intermediate_size.
_INTERMEDIATE_ALIASES = ("ffn_dim", "hidden_dim", "n_inner", "d_ff")
_TASK_CLASSES = {  # task -> (auto class, its mapping of model type -> class name)
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "image-classification": (
        "AutoModelForImageClassification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    ),
}
_SPECIAL_ID_KEYS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "decoder_start_token_id",
)
_EXAMPLE_TYPES = "gpt2, llama, mistral, qwen2, gpt_neox, opt, bert, roberta, distilbert, electra, vit"


def build_hf_workload(model_type: str, *, overrides: dict[str, Any], seq_len: int | None, spec: str) -> Workload:
    """Build a transformers model of ``model_type`` with random weights, with batches and a loss.

    Args:
        model_type: a transformers model type (``config.model_type``), e.g. ``"gpt2"``.
        overrides: config fields to set after memfit's small defaults. Generic names
            (``hidden_size``, ``num_hidden_layers``, ``intermediate_size``, ...) work for every
            type, and so do the model's own names (GPT-2's ``n_layer``); the key ``seq_len``
            sets the tokens per row instead, and ``padding=false`` makes every row full length.
        seq_len: tokens per row ``T`` (default 256); must agree with a ``seq_len`` override.
        spec: the full spec, used as the workload's name.

    Returns:
        A :class:`~memfit.workload.Workload` in train mode. Token workloads return
        ``(loss_sum, count)`` from ``loss_fn`` and provide ``count_fn``.

    Raises:
        SpecError: transformers is not installed, the type is unknown or encoder-decoder, an
            override is not a field of the config, or the config cannot be built.
    """
    transformers = _import_transformers()
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise SpecError(
            f"memfit.models.hf: unknown transformers model type {model_type!r}.{hint} "
            f"Use a model type such as {_EXAMPLE_TYPES}, e.g. 'hf:gpt2'."
        )
    task = _task_for(model_type, modeling_auto)
    overrides = dict(overrides)
    seq_len = _resolve_seq_len(overrides.pop("seq_len", None), seq_len, task)
    padding = overrides.pop("padding", True)
    if not isinstance(padding, bool):
        raise SpecError(f"memfit.models.hf: padding={padding!r} must be true or false, e.g. padding=false.")

    config = _make_config(transformers, model_type, overrides, seq_len, task)
    model = _make_model(transformers, config, task)
    model.train()
    config = model.config  # what the model was built with (from_config may copy it)

    num_params = sum(p.numel() for p in model.parameters())
    summary = {
        k: getattr(config, k)
        for k in (
            *HF_DEFAULTS,
            *_INTERMEDIATE_ALIASES,
            "num_key_value_heads",
            "image_size",
            "num_labels",
        )
        if hasattr(config, k) and (k != "num_labels" or task == "image-classification")
    }
    info: dict[str, Any] = {
        "model_type": model_type,
        "task": task,
        "num_params": num_params,
        "config": summary,
        "attn_implementation": getattr(config, "_attn_implementation", None),
    }
    make_batch_at = None
    if task == "image-classification":
        make_batch, loss_fn, count_fn = _image_classification(config)
    else:
        info["seq_len"] = seq_len
        info["padding"] = padding
        ids = _token_ids(config)
        info["pad_token_id"] = ids["pad"]
        if task == "causal-lm":
            make_batch_at, loss_fn, count_fn = _causal_lm(config, ids, padding)
        else:
            info["mask_token_id"] = ids["mask"]
            make_batch_at, loss_fn, count_fn = _masked_lm(config, ids, padding)
        make_batch = functools.partial(_rows_of, make_batch_at, seq_len)
    return Workload(
        name=spec,
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        count_fn=count_fn,
        default_batch_size=DEFAULT_BATCH_SIZE,
        blocks=None,
        info=info,
        make_batch_at=make_batch_at,
        positions=position_limit(model) if task != "image-classification" else None,
    )


def position_limit(model: nn.Module) -> PositionLimit | None:
    """The model's position limit: learned (a position-embedding table) or rotary, from its config.

    Learned when the model holds an ``nn.Embedding`` with as many rows as the config's positions
    (``max_position_embeddings`` / ``n_positions``; roberta-style offsets allowed); rotary when the
    config has rope parameters. None when the config names no limit.
    """
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int):
        return None
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if any(limit <= n <= limit + 2 for n in tables) and not _rope_params(config):
        return PositionLimit(max_positions=limit, kind="learned")
    rope = _rope_params(config)
    if rope is None:
        return None  # neither a table nor rotary (ALiBi, for example): no limit known
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if kind in (None, "default") else f"{kind} x{rope.get('factor', '?')}"
    return PositionLimit(max_positions=limit, kind="rope", rope_scaling=scaling)


def _rope_params(config: Any) -> dict[str, Any] | None:
    """The config's rope parameters (transformers 5: ``rope_parameters``; 4: ``rope_scaling`` and
    ``rope_theta``), or None for a model without rotary positions."""
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict) and value:
            return value
    if getattr(config, "rope_theta", None) is not None or getattr(config, "rotary_pct", None) is not None:
        return {"rope_type": "default"}
    return None


def _rows_of(make_batch_at: Callable[[int, int], Any], seq_len: int, batch_size: int) -> Any:
    return make_batch_at(batch_size, seq_len)


# --- building --------------------------------------------------------------------------------------


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise SpecError(
            "memfit.models.hf: 'hf:' workloads need the transformers package, which is not "
            "installed. Install it with `pip install memfit[hf]`, or use the built-in 'demo' model."
        ) from exc
    return transformers


def _task_for(model_type: str, modeling_auto: Any) -> str:
    seq2seq = set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if model_type in seq2seq:
        raise SpecError(
            f"memfit.models.hf: {model_type!r} is an encoder-decoder model; memfit plans one chain "
            "of blocks and does not support encoder-decoder models yet. Use a decoder "
            "('hf:gpt2', 'hf:llama') or an encoder ('hf:bert'), or wrap the model in a file "
            "workload 'path/to/file.py:NAME'."
        )
    # Encoders such as bert also have a causal-LM class (for use as a decoder); their natural
    # objective is masked LM, so the masked-LM mapping is checked first.
    if model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked-lm"
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal-lm"
    if model_type in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "image-classification"
    raise SpecError(
        f"memfit.models.hf: model type {model_type!r} has no causal-LM, masked-LM or "
        f"image-classification head in transformers, so memfit has no loss for it. Use one of "
        f"{_EXAMPLE_TYPES}, or write a file workload 'path/to/file.py:NAME'."
    )


def _resolve_seq_len(from_spec: Any, from_option: int | None, task: str) -> int:
    if task == "image-classification":
        if from_spec is not None or from_option is not None:
            raise SpecError(
                "memfit.models.hf: a vision model has no sequence length. Set the image size "
                "instead, e.g. 'hf:vit?image_size=224'."
            )
        return 0
    if from_spec is not None and from_option is not None and from_spec != from_option:
        raise SpecError(
            f"memfit.models.hf: seq_len given twice with different values ({from_spec} in the "
            f"spec, {from_option} as an option). Give it once."
        )
    value = from_option if from_option is not None else from_spec
    if value is None:
        return DEFAULT_SEQ_LEN
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise SpecError(f"memfit.models.hf: seq_len={value!r} must be an integer >= 2, e.g. seq_len=256.")
    return value


def _make_config(transformers: Any, model_type: str, overrides: dict[str, Any], seq_len: int, task: str) -> Any:
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    reference = config_class()  # the class's defaults: which fields it has

    # One key per field: a model's own name (GPT-2's n_layer) becomes the generic name it is an
    # alias of (num_hidden_layers), or the default under the generic name would overwrite it.
    generic = {own: gen for gen, own in getattr(reference, "attribute_map", {}).items()}
    ffn_alias = next((a for a in _INTERMEDIATE_ALIASES if hasattr(reference, a)), None)
    if not hasattr(reference, "intermediate_size") and ffn_alias is not None:
        generic[ffn_alias] = "intermediate_size"  # the generic name works everywhere
    overrides = {generic.get(k, k): v for k, v in overrides.items()}
    if "intermediate_size" in overrides and not hasattr(reference, "intermediate_size"):
        if ffn_alias is not None:
            overrides[ffn_alias] = overrides.pop("intermediate_size")
    unknown = [k for k in overrides if not hasattr(reference, k)]
    if unknown:
        known = sorted({*reference.to_dict(), *getattr(reference, "attribute_map", {})})
        parts = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=3)
            parts.append(f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise SpecError(
            f"memfit.models.hf: {config_class.__name__} has no field {', '.join(parts)}. "
            f"Override fields of the config, e.g. 'hf:{model_type}?num_hidden_layers=4'."
        )

    values: dict[str, Any] = {}
    for key, value in HF_DEFAULTS.items():
        if _derived_from_given(key, overrides):
            continue  # the library's own default follows the user's value (NOTE [ Spec defaults ])
        if key == "max_position_embeddings" and _rope_params(reference) is not None:
            continue  # rotary positions hold no parameters: the family's own length applies
        if hasattr(reference, key):
            values[key] = value
        elif key == "intermediate_size" and ffn_alias is not None:
            values[ffn_alias] = value
    if task == "image-classification":
        if hasattr(reference, "image_size"):
            values["image_size"] = DEFAULT_IMAGE_SIZE
        values["num_labels"] = DEFAULT_NUM_LABELS
    values.update(overrides)
    heads = values.get("num_attention_heads")
    if hasattr(reference, "num_key_value_heads") and "num_key_value_heads" not in overrides:
        # memfit's small model: plain multi-head attention. The user's heads: the library's own
        # grouping (Mistral's 8 key/value heads) where it groups them (NOTE [ Spec defaults ]).
        kv = _init_default(config_class, "num_key_value_heads")
        given = "num_attention_heads" in overrides and isinstance(kv, int) and isinstance(heads, int)
        values["num_key_value_heads"] = kv if given and 0 < kv <= heads and heads % kv == 0 else heads
    if hasattr(reference, "word_embed_proj_dim") and "word_embed_proj_dim" not in overrides:
        values["word_embed_proj_dim"] = values.get("hidden_size")  # OPT: no projection layers
    if task != "image-classification" and hasattr(reference, "max_position_embeddings"):
        # roberta-style models offset positions by pad_token_id + 1; leave room for that.
        need = seq_len + 2
        if "max_position_embeddings" not in overrides:
            default = values.get("max_position_embeddings", reference.max_position_embeddings)
            values["max_position_embeddings"] = max(default, need)
        elif values["max_position_embeddings"] < seq_len:
            raise SpecError(
                f"memfit.models.hf: max_position_embeddings={values['max_position_embeddings']} "
                f"is below seq_len={seq_len}. Raise max_position_embeddings or lower seq_len."
            )
    vocab = values.get("vocab_size", getattr(reference, "vocab_size", None))
    if isinstance(vocab, int):
        for key in _SPECIAL_ID_KEYS:
            # GPT-2's bos/eos 50256 do not exist in a smaller vocabulary: drop them (they only
            # matter for generation) unless the user set them.
            token = getattr(reference, key, None)
            if key not in overrides and isinstance(token, int) and not 0 <= token < vocab:
                values[key] = None
    # None from memfit's own derived defaults means "not applicable"; a user's None is kept.
    values = {k: v for k, v in values.items() if v is not None or k in overrides or k in _SPECIAL_ID_KEYS}
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError) as exc:
        raise SpecError(
            f"memfit.models.hf: cannot build a {model_type!r} config with {values}: {exc}. "
            "Fix the overrides (for example hidden_size must be a multiple of num_attention_heads)."
        ) from exc


# NOTE [ Spec defaults ]
# A spec means the library's config defaults plus the user's values. memfit's small sizes
# (HF_DEFAULTS) replace the library's only where the user gave nothing they derive from: they are
# one consistent small model (width 256, feed-forward 4 x 256), so a user's width makes memfit's
# feed-forward width meaningless and the library's own default applies instead (GPT-2's ``n_inner``
# None is 4 x ``n_embd``; Llama's 11008 and BERT's 3072 are what ``LlamaConfig(hidden_size=...)``
# and ``BertConfig(hidden_size=...)`` give). The other defaults are independent sizes (layers,
# heads, vocabulary, positions) or follow the user's values already (``num_key_value_heads`` =
# the heads unless the user's heads meet a library that groups them by default, such as Mistral's 8
# key/value heads; OPT's ``word_embed_proj_dim`` = the width; positions >= the sequence length).
# memfit's 512 positions size a learned table (GPT-2's ``wpe``: parameters); rotary positions hold
# nothing, so a rotary family keeps its own ``max_position_embeddings`` (Llama's 2048, Qwen2's
# 32768): the length a longest-sequence search stops at without rope scaling.
_DERIVED_FROM = {"intermediate_size": ("hidden_size",)}
"""memfit's default -> the fields it derives from (NOTE [ Spec defaults ])."""


def _init_default(config_class: type, name: str) -> Any:
    """The default of ``name`` in the config class's ``__init__`` (None when it has none)."""
    param = inspect.signature(config_class.__init__).parameters.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def _derived_from_given(key: str, overrides: dict[str, Any]) -> bool:
    """Whether memfit's default for ``key`` derives from a field the user gave (and ``key`` itself
    was not given): the library's default then applies (NOTE [ Spec defaults ])."""
    given = key in overrides or (key == "intermediate_size" and any(a in overrides for a in _INTERMEDIATE_ALIASES))
    return not given and any(src in overrides for src in _DERIVED_FROM.get(key, ()))


def _make_model(transformers: Any, config: Any, task: str) -> nn.Module:
    auto_name, mapping_name = _TASK_CLASSES[task]
    auto = getattr(transformers, auto_name)
    if getattr(config, "architectures", None) is None:
        # transformers 5 iterates config.architectures when a type maps to several classes
        # (deit) and fails on None; name the mapping's first (default) class explicitly.
        from transformers.models.auto import modeling_auto

        names = getattr(modeling_auto, mapping_name)[config.model_type]
        config.architectures = [names if isinstance(names, str) else names[0]]
    try:
        try:
            return auto.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):
            # This architecture has no SDPA attention; eager attention is always available.
            return auto.from_config(config, attn_implementation="eager")
    except Exception as exc:  # any failure here comes from the overrides or the architecture
        raise SpecError(
            f"memfit.models.hf: cannot build a {config.model_type!r} model from its config: "
            f"{type(exc).__name__}: {exc}. Check the overrides (sizes must be consistent, e.g. "
            "hidden_size divisible by num_attention_heads), or use a file workload."
        ) from exc


def _token_ids(config: Any) -> dict[str, int]:
    """Pad and mask ids inside the vocabulary, clear of the random content ids."""
    vocab = int(config.vocab_size)
    if vocab <= FIRST_CONTENT_ID + 1:
        raise SpecError(
            f"memfit.models.hf: vocab_size={vocab} is too small for random token batches. "
            f"Use vocab_size > {FIRST_CONTENT_ID + 1}."
        )
    specials = {v for k in _SPECIAL_ID_KEYS if isinstance(v := getattr(config, k, None), int)}
    pad = getattr(config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    mask = getattr(config, "mask_token_id", None)
    if not (isinstance(mask, int) and 0 <= mask < vocab and mask != pad):
        mask = next(i for i in range(1, FIRST_CONTENT_ID) if i not in specials | {pad})
    return {"pad": pad, "mask": mask}


# --- batches and losses ----------------------------------------------------------------------------

_Fns = tuple[Callable[..., dict[str, torch.Tensor]], Callable[..., Any], Callable[..., int] | None]


def _random_tokens(
    batch_size: int, seq_len: int, vocab: int, pad: int, padding: bool = True
) -> dict[str, torch.Tensor]:
    """Random ids ``(B, T)`` with row lengths in ``[T // 2, T]`` (``T`` without ``padding``),
    right-padded with ``pad``."""
    B, T = batch_size, seq_len
    lengths = torch.randint(T // 2, T + 1, (B,)) if padding else torch.full((B,), T)  # (B,)
    input_ids = torch.randint(FIRST_CONTENT_ID, vocab, (B, T))  # (B, T)
    valid = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    input_ids = input_ids.masked_fill(~valid, pad)
    return {"input_ids": input_ids, "attention_mask": valid.long()}


def _causal_lm(config: Any, ids: dict[str, int], padding: bool) -> _Fns:
    vocab = int(config.vocab_size)

    def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        return _random_tokens(batch_size, seq_len, vocab, ids["pad"], padding)

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        targets = _next_token_targets(batch["input_ids"], batch["attention_mask"])  # (B, T)
        # The model's own loss (as a training loop with labels runs it): ForCausalLMLoss with
        # these targets as shift_labels, summed (num_items_in_batch=1, transformers' own way to
        # a token sum). A chunked head option (memfit.apply.head) replaces exactly this path.
        # Take the loss and let the output object go at once: it would keep the logits alive.
        # Full-length rows (padding=false) pass no mask: transformers would skip an all-ones one on real
        # tensors, but on fake ones (memfit.estimation) it cannot read it and builds the (B, 1, T, T)
        # causal mask, a T^2 term the real step does not have (0.5 TB at 500K tokens).
        with float64_loss(model, warn=False):
            loss_sum = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"] if padding else None,
                labels=targets,
                shift_labels=targets,
                num_items_in_batch=1,
            ).loss
        return loss_sum, (targets != -100).sum()

    def count_fn(batch: dict[str, torch.Tensor]) -> int:
        m = batch["attention_mask"].bool()
        return int((m[:, 1:] & m[:, :-1]).sum())

    return make_batch, loss_fn, count_fn


def _masked_lm(config: Any, ids: dict[str, int], padding: bool) -> _Fns:
    vocab = int(config.vocab_size)

    def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        batch = _random_tokens(batch_size, seq_len, vocab, ids["pad"], padding)
        input_ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        score = torch.rand(input_ids.shape).masked_fill(~valid, 2.0)  # (B, T); padding never picked
        picked = score < MLM_PROBABILITY
        picked[torch.arange(batch_size), score.argmin(dim=1)] = True  # at least one per row
        batch["labels"] = input_ids.masked_fill(~picked, -100)
        batch["input_ids"] = input_ids.masked_fill(picked, ids["mask"])
        return batch

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"]  # (B, T)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss_sum, (labels != -100).sum()

    def count_fn(batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != -100).sum())

    return make_batch, loss_fn, count_fn


def _image_classification(config: Any) -> _Fns:
    size = getattr(config, "image_size", DEFAULT_IMAGE_SIZE)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    num_labels = config.num_labels

    def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
        pixel_values = torch.randn(batch_size, channels, h, w)  # (B, C, H, W)
        labels = torch.randint(0, num_labels, (batch_size,))  # (B,)
        return {"pixel_values": pixel_values, "labels": labels}

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(pixel_values=batch["pixel_values"]).logits  # (B, num_labels)
        return F.cross_entropy(logits, batch["labels"])

    return make_batch, loss_fn, None


def _next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Targets ``(B, T)``: ``input_ids[:, t + 1]`` where ``t`` and ``t + 1`` are valid, else -100."""
    valid = attention_mask.bool()
    targets = torch.full_like(input_ids, -100)
    both = valid[:, 1:] & valid[:, :-1]  # (B, T-1)
    targets[:, :-1] = input_ids[:, 1:].masked_fill(~both, -100)
    return targets
