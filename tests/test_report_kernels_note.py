"""verify --compile on transformers 5.25+: graph breaks inside the `kernels` package's layer wrappers
get a note that says where they come from and what removes them (USE_HUB_KERNELS=0 does not)."""

from __future__ import annotations

from memfit.cli.verify import hub_kernels_note

# the reason torch.compile gave with transformers 5.25.0 and kernels 0.19.1 (verify --compile block, hf:llama)
KERNELS_BREAK = (
    "/venv/lib/python3.11/site-packages/kernels/_internals/layer/layer.py:507: HOP: Unsafe side effect: "
    "Mutating a variable from outside the scope of this HOP is not supported."
)


def test_a_break_in_the_kernels_wrappers_gets_the_fix() -> None:
    note = hub_kernels_note([KERNELS_BREAK, "model.py:12: data-dependent branch"])
    assert note is not None and note.startswith("1 graph break(s) come from the `kernels` package")
    assert "pip uninstall kernels" in note and "transformers<5.25" in note and "USE_HUB_KERNELS=0" in note


def test_other_breaks_get_no_note() -> None:
    assert hub_kernels_note(["model.py:12: data-dependent branch"]) is None and hub_kernels_note(()) is None
