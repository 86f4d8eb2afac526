"""Typed policies (memfit.plan.policies): text round-trips, one-line errors that list the accepted
forms, each policy's plan against block lists worked out by hand, and the CLI taking the same set
everywhere."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit import StepSpec
from memfit.capture.chain import discover_chain, set_blocks
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.fitting.budget import plan_for_policy
from memfit.models.registry import load_workload
from memfit.plan import (
    EveryNth,
    KeepAll,
    Offload,
    Option,
    Plan,
    RecomputeAll,
    Selective,
    Sqrt,
    parse_policy,
    policy_plan,
)

DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"
GPT2_TINY = "hf:gpt2?num_hidden_layers=2&hidden_size=32&n_inner=64&num_attention_heads=2&vocab_size=128"
EVERY_FORM = (
    "'none'",
    "'all'",
    "'sqrt'",
    "'every:K'",
    "'selective:PRESET'",
    "'selective:save:OP[@K],...'",
    "'offload'",
)
ACTION = {"K": Option.KEEP, "R": Option.RECOMPUTE, "S": Option.SELECTIVE, "O": Option.OFFLOAD}


def chain_of(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


# --- text -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("none", KeepAll()),
        ("all", RecomputeAll()),
        ("sqrt", Sqrt()),
        ("every:1", EveryNth(1)),
        ("every:3", EveryNth(3)),
        ("offload", Offload()),
        ("selective:save_matmuls", Selective(preset="save_matmuls")),
        ("selective:save_attention", Selective(preset="save_attention")),
        ("selective:save_matmuls_and_attention", Selective(preset="save_matmuls_and_attention")),
        (
            "selective:save:aten.mm.default,aten.addmm.default@2",
            Selective(ops=("aten.mm.default", "aten.addmm.default@2")),
        ),
        ("selective:save:", Selective()),
    ],
)
def test_text_round_trips(text: str, policy) -> None:
    assert parse_policy(text) == policy
    assert str(policy) == text
    assert parse_policy(policy) is policy  # a typed value passes through


def test_keywords_ignore_case_and_spaces_op_names_do_not() -> None:
    assert parse_policy(" ALL ") == RecomputeAll()
    assert parse_policy("Every:2") == EveryNth(2)
    assert parse_policy("Selective: save_matmuls") == Selective(preset="save_matmuls")
    spaced = parse_policy("selective:save: aten.add.Tensor , aten.mm.default@0")
    assert spaced == Selective(ops=("aten.add.Tensor", "aten.mm.default@0"))
    assert str(spaced) == "selective:save:aten.add.Tensor,aten.mm.default@0"
    with pytest.raises(SpecError, match="not an op overload"):
        parse_policy("selective:save:aten.add.TENSOR")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("half", "unknown policy 'half'."),
        ("", "unknown policy ''."),
        ("every:0", "K must be a whole number of at least 1"),
        ("every:-1", "K must be a whole number of at least 1"),
        ("every:x", "K must be a whole number of at least 1"),
        ("every", "unknown policy 'every'."),
        ("offload:2", "unknown policy 'offload:2'."),
        ("all:1", "unknown policy 'all:1'."),
    ],
)
def test_unknown_policies_list_every_accepted_form_in_one_line(text: str, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_policy(text)
    msg = str(err.value)
    assert msg.startswith("memfit.plan: ") and "\n" not in msg and fragment in msg
    assert all(form in msg for form in EVERY_FORM), msg


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "selective:save_everything",
            "unknown selective policy 'save_everything'. Use a preset (save_matmuls, save_attention, save_matmuls_and_attention, torchtitan)",
        ),
        ("selective:", "unknown selective policy ''"),
        ("selective:save:mm", "'mm' in policy 'save:mm' is not 'namespace.op.overload'"),
        ("selective:save:aten.mm.default@x", "is not 'namespace.op.overload'"),
        ("selective:save:aten.no_such_op.default", "not an op overload of this torch"),
    ],
)
def test_bad_selective_policies_say_what_is_valid(text: str, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_policy(text)
    msg = str(err.value)
    assert msg.startswith("memfit.selective: ") and "\n" not in msg and fragment in msg, msg


def test_constructors_check_their_values_and_values_are_frozen() -> None:
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(SpecError, match="'every:K'"):
            EveryNth(bad)
    with pytest.raises(SpecError, match="not both"):
        Selective(preset="save_matmuls", ops=("aten.mm.default",))
    with pytest.raises(SpecError, match="unknown selective policy 'save_all'"):
        Selective(preset="save_all")
    assert Selective(ops=["aten.mm.default"]).ops == ("aten.mm.default",)  # a list becomes a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        EveryNth(2).k = 3  # type: ignore[misc]
    assert len({EveryNth(2), EveryNth(2), Selective(preset="save_attention"), Selective(preset="save_attention")}) == 2


# --- plans against hand-worked block lists --------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text", "actions", "segments"),
    [
        (5, "none", "KKKKK", []),
        (5, "all", "RRRRR", []),
        (7, "every:1", "RRRRRRR", []),
        (7, "every:3", "RKKRKKR", []),
        (4, "every:9", "RKKK", []),
        # sqrt: ceil(sqrt(N)) segments of N // ceil(sqrt(N)) blocks, all but the last recomputed
        (9, "sqrt", "KKKKKKKKK", [(0, 3), (3, 6)]),  # 3 segments of 3
        (12, "sqrt", "K" * 12, [(0, 3), (3, 6), (6, 9)]),  # 4 of 3 (the demo GPT)
        (10, "sqrt", "K" * 10, [(0, 2), (2, 4), (4, 6), (6, 8)]),  # size 10 // 4 = 2: five pieces
        (2, "sqrt", "RK", []),  # segments of one block are recomputed blocks
        (3, "offload", "OOO", []),
        (3, "selective:save_matmuls", "SSS", []),
        (3, "selective:save:aten.addmm.default@1", "SSS", []),
    ],
)
def test_each_policy_gives_the_hand_worked_plan(
    n: int, text: str, actions: str, segments: list[tuple[int, int]]
) -> None:
    model = chain_of(n)
    plan = policy_plan(model, text)
    assert [b.option for b in plan.blocks] == [ACTION[a] for a in actions]
    assert [(s.start, s.stop) for s in plan.segments] == segments
    assert [b.name for b in plan.blocks] == [str(i) for i in range(n)]
    save = text.removeprefix("selective:") if text.startswith("selective:") else None
    assert all(b.policy == (save if b.option is Option.SELECTIVE else None) for b in plan.blocks)
    assert plan.policy == text
    assert policy_plan(model, parse_policy(text)) == plan  # text and typed value give one plan


def test_sqrt_segments_stop_at_each_container_end() -> None:
    class TwoStages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = chain_of(3), chain_of(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    model = TwoStages()
    set_blocks(model, "a", "b")
    assert discover_chain(model).spans == ((0, 3), (3, 6))
    plan = policy_plan(model, Sqrt())
    # N=6: 3 segments of 2 blocks, cut at the containers: (0,2) (2,3) | (3,5) (5,6); the last one kept
    assert [b.option.value for b in plan.blocks] == ["keep", "keep", "recompute", "keep", "keep", "keep"]
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 2), (3, 5)]


def test_sqrt_on_a_module_list_cuts_its_layers_as_for_a_sequential() -> None:
    """HF layers sit in an nn.ModuleList the model's forward loops over: memfit.apply.segments
    runs segments there too, so the policy is the same as on an nn.Sequential of as many blocks."""
    model = load_workload(GPT2_TINY.replace("num_hidden_layers=2", "num_hidden_layers=9")).model
    plan = policy_plan(model, Sqrt())
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 3), (3, 6)]
    assert plan.segments == policy_plan(chain_of(9), Sqrt()).segments


def test_sqrt_recomputes_one_by_one_the_blocks_a_profile_rules_out_of_segments() -> None:
    # N=9: segments (0,3) (3,6), the last kept; segments may lie only in (1,3) and (4,9)
    plan = policy_plan(chain_of(9), Sqrt(), segment_spans=((1, 3), (4, 9)))
    assert [(s.start, s.stop) for s in plan.segments] == [(1, 3), (4, 6)]
    assert [b.option.value for b in plan.blocks[:4]] == ["recompute", "keep", "keep", "recompute"]
    no_segments = policy_plan(chain_of(9), Sqrt(), segment_spans=())
    assert not no_segments.segments and [b.option.value for b in no_segments.blocks] == ["recompute"] * 6 + ["keep"] * 3


def test_sqrt_on_a_densenet_offers_only_segments_its_profile_allows_and_is_predicted_to_the_byte() -> None:
    """Each DenseNet layer takes every earlier layer's output: no segment holds a layer with the one
    before it unless the layers after take nothing from inside it. sqrt offered checkpoint_sequential's
    segments there anyway, predicted below the model's real minimum, and the plan then failed."""
    import torch.nn.functional as F
    from tiny_models import DenseNet

    from memfit.verification.plans import verify
    from memfit.workload import Workload

    torch.manual_seed(0)
    wl = Workload(
        name="densenet", model=DenseNet(c0=8, growth=4, n=9, expand=2).train(),
        make_batch=lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 5, (b,))),
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=4,
    )  # fmt: skip
    res = plan_for_policy(wl, Sqrt(), step=StepSpec(repeats=1))
    spans = res.stats.segment_spans
    assert spans is not None and spans != discover_chain(wl.model).segment_spans  # the profile narrowed them
    assert all(any(a <= s.start and s.stop <= b for a, b in spans) for s in res.plan.segments)
    assert (
        sum(b.option is Option.RECOMPUTE for b in res.plan.blocks) + sum(s.stop - s.start for s in res.plan.segments)
        == 6
    )
    result = verify(wl, res.plan, step=StepSpec(repeats=0))
    assert result.ok and result.measured_peak_bytes <= res.plan.predicted_peak_bytes


def test_plans_of_every_policy_round_trip_through_json(tmp_path: Path) -> None:
    model = chain_of(4)
    for text in (
        "none",
        "all",
        "sqrt",
        "every:2",
        "offload",
        "selective:save_attention",
        "selective:save:aten.mm.default",
    ):
        plan = policy_plan(model, text)
        plan.save(tmp_path / "p.json")
        assert Plan.load(tmp_path / "p.json") == plan, text


# --- the CLI: one parser, one accepted set --------------------------------------------------------


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


COMMANDS = {
    "plan": ["plan", "--model", DEMO_SMALL],
    "verify": ["verify", "--model", DEMO_SMALL],
    "explain": ["explain", "--model", DEMO_SMALL],
    "train": ["train", "--model", DEMO_SMALL, "--global-batch", "2", "--steps", "1"],
    "estimate": ["estimate", "--model", DEMO_SMALL],
}


@pytest.mark.parametrize("bad", ["every:0", "selective:save_all", "selective:save:mm"])
def test_every_command_refuses_a_bad_policy_with_the_same_message(capsys, bad: str) -> None:
    errors = {}
    for name, argv in COMMANDS.items():
        code, res = run_json(capsys, *argv, "--policy", bad)
        assert code == 2 and res["error_type"] == "UsageError", (name, res)
        errors[name] = res["error"].removeprefix(f"memfit {name}: argument --policy: ")
    want = str(pytest.raises(SpecError, parse_policy, bad).value).partition(": ")[2]
    assert all(e.startswith(want) for e in errors.values()), errors


@pytest.mark.parametrize("spec", [DEMO_SMALL, GPT2_TINY])
def test_plan_policy_selective_writes_the_plan_policy_plan_gives(capsys, tmp_path: Path, spec: str) -> None:
    """`memfit plan --policy selective:save_matmuls --out F` predicts the selective plan (its own option
    calibrated) and writes the plan that `memfit.policy_plan(model, "selective:save_matmuls")` builds:
    every block selective with the preset, by the model's own block names."""
    out = tmp_path / "plan.json"
    code, res = run_json(
        capsys, "plan", "--model", spec, "--policy", "selective:save_matmuls", "--repeats", "1", "--out", str(out)
    )
    assert code == 0, res
    written = Plan.load(out)
    model = load_workload(spec).model
    names = discover_chain(model).names
    assert [(b.name, b.option, b.policy) for b in written.blocks] == [
        (n, Option.SELECTIVE, "save_matmuls") for n in names
    ]
    lib = policy_plan(model, "selective:save_matmuls")
    assert (written.policy, written.chain_path, written.blocks, written.segments) == (
        lib.policy,
        lib.chain_path,
        lib.blocks,
        lib.segments,
    )
    assert written.fingerprint["model"] == lib.fingerprint["model"]
    # predicted between recomputing every block and keeping everything
    assert res["predicted_peak_bytes"] < res["baseline_peak_bytes"]


def test_plan_policy_offload_on_the_cpu_says_why_and_what_runs_it(capsys) -> None:
    code, res = run_json(capsys, "plan", "--model", DEMO_SMALL, "--policy", "offload", "--repeats", "1")
    assert code == 2 and res["error_type"] == "SpecError"
    assert "the device is the CPU" in res["error"] and "memfit verify --policy offload" in res["error"]
    assert [b.option for b in policy_plan(load_workload(DEMO_SMALL).model, "offload").blocks] == [Option.OFFLOAD] * 4


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="offload moves activations to host memory and is calibrated only on a GPU (on the CPU it is refused: the test above); run on a lent GPU",
)
def test_plan_for_policy_offload_on_cuda_predicts_the_offload_plan() -> None:
    wl = load_workload(DEMO_SMALL)
    wl.model.to("cuda")
    res = plan_for_policy(wl, Offload(), step=StepSpec(repeats=1))
    assert res.plan.blocks == policy_plan(wl.model, "offload").blocks
    assert res.plan.predicted_peak_bytes < res.stats.peak_bytes
