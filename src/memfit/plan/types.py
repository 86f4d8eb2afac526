"""Plan types: what to do with each block of a chain. Plans are JSON, never pickle.

A block's decision is an :class:`Option`; a ``selective`` block also names its save *policy*: a
preset whose name says what is saved (``save_matmuls``, ``save_attention``,
``save_matmuls_and_attention``) or an explicit list of op overloads, ``save:aten.addmm.default,
aten.bmm.default@0`` (``@K``: only the K-th call of that op in the block's forward). See
:mod:`memfit.apply.selective`. In JSON: ``{"name": "h.0", "option": "selective", "policy":
"save_matmuls"}``.

size: the plan type and its file format (to_dict, from_dict with every field's check) are read together.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from memfit.errors import PlanFileError, SpecError
from memfit.optim.states import ModelStates
from memfit.plan.details import EXTRA_PLAIN, AccumulationWindow, CompileSettings, TimeScales, extra_fields
from memfit.plan.schema import check_plan_json

PLAN_FORMAT_VERSION = 1


class Option(StrEnum):
    """What happens to a block's activations between its forward and its backward."""

    KEEP = "keep"  # autograd keeps what it saves (plain training)
    RECOMPUTE = "recompute"  # keep only the block's inputs; rerun its forward during backward
    SELECTIVE = "selective"  # keep the inputs and the outputs of the ops its policy names
    OFFLOAD = "offload"  # move what it saves off the device (to CPU) until its backward


HEAD_OPTIONS = ("chunked",)
"""Head options a plan can name besides the model's own head (see :mod:`memfit.apply.head`)."""
ACTIVATION_OPTIONS = ("fused",)
"""Activation options a plan can name besides the model's own (see :mod:`memfit.apply.activations`)."""
SELECTIVE_PRESETS = ("save_matmuls", "save_attention", "save_matmuls_and_attention")
"""Named selective policies a profile calibrates by default (:data:`memfit.plan.savepolicy.PRESET_OPS`
says what each saves)."""
SAVE_PRESETS = (*SELECTIVE_PRESETS, "torchtitan")
"""Every named selective policy: the default ones and ``torchtitan`` (torchtitan's op-level default:
:data:`memfit.plan.savepolicy.TORCHTITAN_SAVE_OPS`), which a profile calibrates when asked for."""
SAVE_PREFIX = "save:"
SAVE_ENTRY = re.compile(r"^(?P<op>[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*)(?:@(?P<index>\d+))?$")
"""One entry of a ``save:`` list: ``namespace.op.overload`` with an optional ``@K`` (the K-th call)."""


def policy_error(policy: Any) -> str | None:
    """Why ``policy`` is not a valid selective policy (syntax only), or None when it is.

    Whether the named ops exist in this torch is checked when the plan is applied.
    """
    if not isinstance(policy, str) or not policy.strip():
        return "it has no policy"
    p = policy.strip()
    if p in SAVE_PRESETS:
        return None
    if not p.startswith(SAVE_PREFIX):
        return f"policy {policy!r} is neither a preset ({', '.join(SAVE_PRESETS)}) nor 'save:OP,...'"
    for entry in filter(None, (e.strip() for e in p[len(SAVE_PREFIX) :].split(","))):
        if not SAVE_ENTRY.match(entry):
            return f"policy entry {entry!r} is not 'namespace.op.overload' or 'namespace.op.overload@K'"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockDecision:
    """The decision for one block.

    Attributes:
        name: the block's qualified module name.
        option: what happens to its activations (files before memfit named it ``"action"``).
        policy: for ``selective`` only: a preset name or ``save:OP[@K],...``.
        tiles: for ``keep`` and ``recompute``: run the block's position-wise submodules
            (``tiled``) over this many tiles of the sequence (:mod:`memfit.apply.tiling`); None:
            untiled.
        tiled: with ``tiles``: those submodules' names within the block (``("mlp",)``).
        host_input: for ``recompute`` only: the block's kept input lives in host memory until
            its recompute (:mod:`memfit.apply.host_inputs`; CUDA).

    In JSON: ``{"name": "model.layers.0", "option": "recompute", "tiles": 4, "tiled": ["mlp"],
    "host_input": true}`` (the last three only when set; files without them load as untiled).
    """

    name: str
    option: Option
    policy: str | None = None
    tiles: int | None = None
    tiled: tuple[str, ...] = ()
    host_input: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "option": self.option.value}
        if self.policy is not None:
            d["policy"] = self.policy
        if self.tiles is not None:
            d["tiles"] = self.tiles
            d["tiled"] = list(self.tiled)
        if self.host_input:
            d["host_input"] = True
        return d

    def validation_error(self) -> str | None:
        """Why this decision is invalid (a policy where none belongs, a bad policy, tiles on an
        option that takes none), or None."""
        if self.option is Option.SELECTIVE:
            why = policy_error(self.policy)
            if why is not None:
                return (
                    f"block {self.name} is 'selective' but {why}; give \"policy\": one of "
                    f"{', '.join(SAVE_PRESETS)}, or 'save:aten.addmm.default,aten.bmm.default@0'"
                )
        elif self.policy is not None:
            return f"block {self.name} has option {self.option.value!r} and a policy; only 'selective' blocks take one"
        if self.tiles is not None or self.tiled:
            if self.option not in (Option.KEEP, Option.RECOMPUTE):
                return f"block {self.name} has option {self.option.value!r} and tiles; only 'keep' and 'recompute' blocks are tiled"
            if isinstance(self.tiles, bool) or not isinstance(self.tiles, int) or self.tiles < 2:
                return f"block {self.name} has tiles {self.tiles!r}; give an integer of 2 or more"
            if not self.tiled or not all(isinstance(t, str) for t in self.tiled):
                return f'block {self.name} has tiles but no "tiled" list of its submodules to tile (e.g. ["mlp"])'
        if self.host_input and self.option is not Option.RECOMPUTE:
            return f"block {self.name} has option {self.option.value!r} and host_input; only 'recompute' blocks keep an input to hold on the host"
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Blocks ``start .. stop-1`` run as one recomputed unit: only the input of ``start`` is kept.

    Segments may nest (one inside another) but never partly overlap. Their blocks lie in one
    container, whoever runs them (:mod:`memfit.apply.segments`).
    """

    start: int
    stop: int

    def to_dict(self) -> dict[str, int]:
        return {"start": self.start, "stop": self.stop}


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A checkpoint plan for one model (and batch shape).

    Attributes:
        policy: how it was made: 'none', 'all', 'sqrt', 'every:K', 'memfit', ...
        chain_path: dotted path of the blocks' container in the model; several containers run one
            after another (ResNet stages, an encoder then a decoder) are joined by ``,``.
        blocks: one decision per block, in chain order.
        segments: recomputed groups of consecutive blocks, each within one container.
        fingerprint: what the plan was made for: ``{"model": {...}, "batch": [...] | None}``.
        budget_bytes: the memory budget it was planned for, if any.
        predicted_peak_bytes: the planner's predicted whole-step peak, if any.
        predicted_step_s: the planner's predicted step time, if any.
        head: the head option (``"chunked"``: the loss computed in chunks with its gradients,
            see :mod:`memfit.apply.head`), or None for the model's own head.
        activations: ``"fused"`` (activation modules run their fused torch kernel, see
            :mod:`memfit.apply.activations`), or None for the model's own.
        states: where the model states live and when the optimizer steps
            (:class:`memfit.optim.ModelStates`), as the stats it was made from were measured; the
            file says it when it is not ``device`` (files without it: ``device``).
        workload: the ``--model`` spec the command line made it for, which a command given the file
            and no ``--model`` builds (None: not recorded).

    The planner's details (in the file under ``"extra"``; each None when the plan was not made
    that way):
        margin: the cost model's safety margin, a fraction of the predicted peak (0.02 = 2 %).
        predicted_peak_with_margin_bytes: the predicted peak with that margin, what the budget
            was checked against.
        peak_event: where in the step the predicted peak falls (``"backward of h.3"``).
        search: what the solver searched (per-block options, segments; see
            :func:`memfit.plan.solve.search_description`).
        time_scales: how the measured steps scaled the recompute and option times.
        min_budget_bytes: the least budget any plan of this model reaches (cost model).
        baseline_peak_bytes: the peak without checkpointing (measured or estimated).
        baseline_step_s: the step time without checkpointing.
        micro_batch: the micro-batch a ``memfit fit`` plan was chosen for.
        accumulation_steps: the micro-steps per optimizer step of a ``memfit fit`` plan (its
            ``predicted_peak_bytes`` is then its window's).
        parallel: the data-parallel layout the prediction is per rank of
            (:meth:`memfit.plan.parallel.Parallel.to_dict`), None for one process.
        accumulation_window: the window of ``steps`` micro-steps a parallel plan's rank was
            predicted for (``memfit plan --accumulation-steps K``).
        compile_settings: how to compile the step (``memfit plan --compile``); None for eager.
    """

    policy: str
    chain_path: str
    blocks: tuple[BlockDecision, ...]
    segments: tuple[Segment, ...] = ()
    fingerprint: dict[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_s: float | None = None
    head: str | None = None
    activations: str | None = None
    states: str = "device"
    workload: str | None = None
    margin: float | None = None
    predicted_peak_with_margin_bytes: int | None = None
    peak_event: str | None = None
    search: str | None = None
    time_scales: TimeScales | None = None
    min_budget_bytes: int | None = None
    baseline_peak_bytes: int | None = None
    baseline_step_s: float | None = None
    micro_batch: int | None = None
    accumulation_steps: int | None = None
    parallel: dict[str, Any] | None = None
    accumulation_window: AccumulationWindow | None = None
    compile_settings: CompileSettings | None = None

    @property
    def recomputed(self) -> tuple[int, ...]:
        """Indices of blocks recomputed on their own."""
        return tuple(i for i, b in enumerate(self.blocks) if b.option is Option.RECOMPUTE)

    @property
    def is_plain(self) -> bool:
        """True when the plan changes nothing: every block kept untiled, no segment, the model's own head and activations."""
        return not (
            self.segments
            or self.head
            or self.activations
            or any(b.option is not Option.KEEP or b.tiles is not None for b in self.blocks)
        )

    def count(self, option: Option) -> int:
        """Number of blocks with ``option``."""
        return sum(b.option is option for b in self.blocks)

    def with_(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "memfit.plan",
            "version": PLAN_FORMAT_VERSION,
            "policy": self.policy,
            "chain_path": self.chain_path,
            "blocks": [b.to_dict() for b in self.blocks],
            "segments": [s.to_dict() for s in self.segments],
            "head": self.head,
            "activations": self.activations,
            **({"states": str(self.states)} if self.states != "device" else {}),
            **({"workload": self.workload} if self.workload is not None else {}),
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_s": self.predicted_step_s,
            "extra": self.extra_dict(),
        }

    def extra_dict(self) -> dict[str, Any]:
        """The planner's details as the file's ``"extra"`` object (the fields that are set)."""
        d: dict[str, Any] = {}
        for key in EXTRA_PLAIN[:4]:
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.time_scales is not None:
            d.update(self.time_scales.to_dict())
        for key in EXTRA_PLAIN[4:]:
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.accumulation_window is not None:
            d["accumulation"] = self.accumulation_window.to_dict()
        if self.compile_settings is not None:
            d["compile"] = self.compile_settings.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """Build a plan from its JSON form, checking every field.

        Raises:
            PlanFileError: a field is missing or has the wrong type or value.
        """

        def bad(what: str) -> PlanFileError:
            return PlanFileError(
                f"memfit.plan: {source} is not a valid memfit plan: {what}. Make a new one with "
                "`memfit plan --model SPEC --budget SIZE --out PLAN.json`."
            )

        if not isinstance(data, dict) or data.get("format") != "memfit.plan":
            raise bad('it has no "format": "memfit.plan" field')
        check_plan_json(data, bad)  # keys, version, fingerprint, ranges (memfit.plan.schema)
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise bad(f"format version {data.get('version')!r} (this memfit reads {PLAN_FORMAT_VERSION})")
        why = _unreadable_number(data)
        if why is not None:
            raise bad(why)
        try:
            blocks_raw = data["blocks"]
            if not isinstance(blocks_raw, list):
                raise bad('"blocks" must be a list')
            blocks = [_block_from_dict(i, b, bad) for i, b in enumerate(blocks_raw)]
            segments = []
            for s in data.get("segments") or []:
                if not (isinstance(s, dict) and isinstance(s.get("start"), int) and isinstance(s.get("stop"), int)):
                    raise bad(f"segment {s!r} needs integer start and stop")
                segments.append(Segment(start=s["start"], stop=s["stop"]))
            policy = data.get("policy", "custom")
            chain_path = data["chain_path"]
            if not isinstance(chain_path, str) or not isinstance(policy, str):
                raise bad('"chain_path" and "policy" must be strings')
            fingerprint = data.get("fingerprint", {})  # an object (memfit.plan.schema)
            head, activations = _head_and_activations(data, bad)
            plan = cls(
                policy=policy,
                chain_path=chain_path,
                blocks=tuple(blocks),
                segments=tuple(segments),
                fingerprint=fingerprint,
                budget_bytes=_opt_num(data, "budget_bytes", int, bad),
                predicted_peak_bytes=_opt_num(data, "predicted_peak_bytes", int, bad),
                predicted_step_s=_opt_num(data, "predicted_step_s", float, bad),
                head=head,
                activations=activations,
                states=_states(data.get("states", "device"), bad),
                workload=_workload(data.get("workload"), bad),
                **extra_fields(data.get("extra"), bad),
            )
        except KeyError as err:
            raise bad(f"missing field {err}") from None
        validate_segments(plan.segments, len(plan.blocks), error=bad)
        validate_nesting(plan, error=bad)
        return plan

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file.

        Raises:
            PlanFileError: the file is missing, is not JSON, or is not a valid plan.
        """
        p = Path(path)
        remake = f"Make a new plan with `memfit plan ... --out {p}`."
        try:
            text = p.read_text()
        except OSError as err:
            raise PlanFileError(f"memfit.plan: cannot read plan file {str(p)!r}: {err.strerror}.") from None
        except UnicodeDecodeError:
            raise PlanFileError(
                f"memfit.plan: {str(p)!r} is not text (not UTF-8), so not a plan file. {remake}"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanFileError(
                f"memfit.plan: {str(p)!r} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}). {remake}"
            ) from None
        except RecursionError:
            raise PlanFileError(
                f"memfit.plan: {str(p)!r} nests JSON too deeply to read (thousands of levels; a plan has a few). {remake}"
            ) from None
        except ValueError:  # an integer beyond Python's digit limit for int(str)
            raise PlanFileError(
                f"memfit.plan: {str(p)!r} holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                f"which no plan field has. {remake}"
            ) from None
        return cls.from_dict(data, source=repr(str(p)))


_MAX_PLAN_NUMBER = 2**63
"""No field of a plan (bytes, seconds, scales, counts) reaches this: 8 EiB as bytes, 292 years as seconds."""


def _block_from_dict(i: int, b: Any, bad: Any) -> BlockDecision:
    """Block ``i`` of a plan file, every field checked (``bad(what)`` makes the error)."""
    if not isinstance(b, dict) or not isinstance(b.get("name"), str):
        raise bad(f"block {i} has no name")
    try:
        given = b.get("option", b.get("action"))  # "action": files written before the rename
        option = Option(given)
    except ValueError:
        raise bad(
            f"block {i} ({b['name']}) has option {given!r}; valid: " + ", ".join(a.value for a in Option)
        ) from None
    policy = b.get("policy")
    if policy is not None and not isinstance(policy, str):
        raise bad(f"block {i} ({b['name']}) has a policy that is not a string")
    tiled = b.get("tiled") or ()
    if not isinstance(tiled, list | tuple):
        raise bad(f'block {i} ({b["name"]}) has a "tiled" that is not a list of names')
    host_input = b.get("host_input", False)
    if not isinstance(host_input, bool):
        raise bad(f'block {i} ({b["name"]}) has a "host_input" that is not true or false')
    decision = BlockDecision(
        name=b["name"], option=option, policy=policy, tiles=b.get("tiles"), tiled=tuple(tiled),
        host_input=host_input,
    )  # fmt: skip
    why = decision.validation_error()
    if why is not None:
        raise bad(why)
    return decision


def _head_and_activations(data: dict[str, Any], bad: Any) -> tuple[str | None, str | None]:
    """A plan file's ``"head"`` and ``"activations"`` options, each null or one memfit has."""
    head = data.get("head")
    if head is not None and head not in HEAD_OPTIONS:
        raise bad(
            f'"head" is {head!r}; valid: null (the model\'s own head), ' + ", ".join(repr(h) for h in HEAD_OPTIONS)
        )
    activations = data.get("activations")
    if activations is not None and activations not in ACTIVATION_OPTIONS:
        raise bad(
            f'"activations" is {activations!r}; valid: null (the model\'s own), '
            + ", ".join(repr(a) for a in ACTIVATION_OPTIONS)
        )
    return head, activations


def _opt_num(data: dict[str, Any], key: str, kind: type, bad: Any) -> Any:
    """A plan file's optional non-negative number ``key`` as ``kind``, or None."""
    v = data.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
        raise bad(f'"{key}" must be a non-negative number')
    # A step holds some memory; a ratio to a peak or budget of 0 is undefined.
    if v == 0 and key in ("budget_bytes", "predicted_peak_bytes"):
        raise bad(f'"{key}" is 0, and a training step always holds some memory: null when unknown')
    return kind(v)


def _states(value: Any, bad: Any) -> ModelStates:
    """A plan file's ``"states"`` as a placement, or ``bad``'s error naming the valid ones."""
    try:
        return ModelStates.parse(value)
    except SpecError:
        raise bad(f'"states" is {value!r}; valid: ' + ", ".join(repr(m.value) for m in ModelStates)) from None


def _workload(value: Any, bad: Any) -> str | None:
    """A plan file's ``"workload"``: a non-empty ``--model`` spec, or None."""
    if value is not None and not (isinstance(value, str) and value.strip()):
        raise bad(f'"workload" is {value!r}; it is the --model spec the plan was made for, or null')
    return value


def _unreadable_number(data: Any) -> str | None:
    """The first number in a plan's JSON that is NaN, infinite or absurdly large, said with its
    field (``"predicted_peak_bytes" is 1e+308 ...``), or None. JSON carries ``NaN`` and
    ``Infinity`` through Python's reader, and a plan that predicts 1e308 bytes would pass every
    comparison it meets."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            if isinstance(v, float) and v != v:
                return f'"{path}" is NaN, not a number'
            if abs(v) >= _MAX_PLAN_NUMBER:
                shown = f"{float(v):g}" if abs(v) < float("inf") else str(v)
                return (
                    f'"{path}" is {shown}, beyond any real value (every plan number is below 2**63: 8 EiB, 292 years)'
                )
    return None


def validate_segments(segments: tuple[Segment, ...], n_blocks: int, *, error: Any) -> None:
    """Check that segments lie within the chain and nest without partial overlap."""
    for s in segments:
        if not 0 <= s.start < s.stop <= n_blocks:
            raise error(f"segment [{s.start}, {s.stop}) is outside blocks 0..{n_blocks - 1} or empty")
    for a in segments:
        for b in segments:
            if a is b:
                continue
            if (a.start, a.stop) == (b.start, b.stop):
                raise error(f"segment [{a.start}, {a.stop}) is given twice")
            overlap = a.start < b.stop and b.start < a.stop
            nested = (a.start <= b.start and b.stop <= a.stop) or (b.start <= a.start and a.stop <= b.stop)
            if overlap and not nested:
                raise error(f"segments [{a.start}, {a.stop}) and [{b.start}, {b.stop}) overlap without nesting")


def validate_nesting(plan: Plan, *, error: Any) -> None:
    """Check the blocks' decisions, and that no ``selective``, ``offload``, tiled or host-input
    block lies inside a segment (a segment's recompute would rerun their hooks inside the segment's
    checkpoint; memfit does not plan or execute that)."""
    for d in plan.blocks:
        why = d.validation_error()
        if why is not None:
            raise error(why)
    for s in plan.segments:
        for i in range(s.start, min(s.stop, len(plan.blocks))):
            d = plan.blocks[i]
            if d.option in (Option.SELECTIVE, Option.OFFLOAD) or d.tiles is not None or d.host_input:
                what = (
                    d.option.value
                    if d.option in (Option.SELECTIVE, Option.OFFLOAD)
                    else "tiled"
                    if d.tiles
                    else "host_input"
                )
                raise error(
                    f"block {d.name} is {what!r} inside segment [{s.start}, {s.stop}); "
                    "selective, offload, tiled and host-input blocks cannot be inside a segment. Make it 'keep' or "
                    "'recompute' without tiles, or end the segment before it"
                )
