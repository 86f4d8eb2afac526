"""`memfit fit --seq-len auto`: the longest sequence that trains within ``--budget``, with its plan.

The search is :func:`memfit.fitting.seq_len.fit_seq_len` (NOTE [ Longest sequence ] there); this
module reads the command's arguments, prints each length it tries and the answer, and returns
the fit's JSON with ``seq_len`` and ``seq_len_search`` added.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from memfit.capture.step import StepSpec
from memfit.cli.common import Output, mib, parse_dtype, step_from_args, tiling_from_args, workload_from_args
from memfit.cli.estimated import profile_peak_fn
from memfit.cli.parallel import parallel_from_args
from memfit.cli.plan import estimate_setup, show_calibration
from memfit.errors import SpecError
from memfit.estimation import estimate_stats, get_device, stats_fn
from memfit.estimation.calibrate_time import host_device
from memfit.fitting.seq_len import SeqLenFit, fit_seq_len
from memfit.plan.options import BASE_OPTIONS, DEFAULT_OPTIONS

__all__ = ["run_seq_len"]


def run_seq_len(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    """``memfit fit --seq-len auto``: search, print, and return the JSON.

    With ``--world-size N --parallel ddp|fsdp2`` the search is rank 0's: the budget per rank, the rank's
    share of ``--global-batch``, each length's stats made the rank's (as ``memfit fit --world-size``
    fits a rank); its length is predicted, not measured.

    Raises:
        SpecError: options that run other machinery (``--report``), or a rank's share below the micro-batch.
    """
    if getattr(args, "report", None):
        raise SpecError(
            "memfit fit: --seq-len auto searches the length; leave out --report "
            "(then run `memfit fit --seq-len T --report FILE` at the length found)."
        )
    parallel = parallel_from_args(args, command="fit")
    policy = getattr(args, "policy", None)
    if policy is not None and getattr(args, "options", "block") != "block":
        raise SpecError(
            f"memfit fit: --options all chooses what memfit's plan search may use and --policy {policy} fixes the plan; give one of them."
        )
    est_args = argparse.Namespace(**{**vars(args), "keep_activations": True}) if policy is not None else args
    est = estimate_setup(est_args, command="fit", real_step_options={})
    args.time_calibration = getattr(est_args, "time_calibration", None)
    wl = est[0] if est is not None else workload_from_args(args)
    micro = getattr(args, "max_micro_batch", None) or 1
    share = args.global_batch or micro
    if parallel is not None:  # rank 0's share of the global batch
        share = -(-share // parallel.world_size)
        if share < micro:
            raise SpecError(
                f"memfit fit: each of the {parallel.world_size} ranks gets {share} of the global batch "
                f"{args.global_batch or micro}, below the micro-batch {micro}; raise --global-batch to at least "
                f"{micro * parallel.world_size} or lower --max-micro-batch to {share}."
            )
    tiling = tiling_from_args(args) if policy is None else {}
    with out.console.status("seq-len auto ...") as status:

        def say(text: str) -> None:
            status.update(f"seq-len auto: {text}")
            if text.startswith(("attention", "seq_len", "memfit.fit")):
                # one line per length tried, on stderr also under --json and off a terminal
                print(f"memfit fit: {text}", file=sys.stderr, flush=True)

        res = fit_seq_len(
            wl,
            args.budget,
            micro_batch=micro,
            global_batch=share,
            step=step_from_args(args, batch_size=None, device=None),  # measured where the model is: built there
            margin=getattr(args, "margin", 0.02),
            multiple=getattr(args, "seq_multiple", 1) or 1,
            max_seq_len=getattr(args, "max_seq_len", None),
            measure=not getattr(args, "no_measure", False) and est is None,
            options=None if policy is not None else DEFAULT_OPTIONS if args.options == "all" else BASE_OPTIONS,
            heads=not getattr(args, "keep_head", False),
            activations=not getattr(args, "keep_activations", False),
            policy=policy,
            estimate=_estimator(est_args) if est is not None else None,
            progress=say,
            # the first profile: its keep-all step estimated on fake tensors first
            predict_profile_peak=(lambda w, b: profile_peak_fn(args, w)(b)) if est is None else None,
            parallel=parallel,
            # the length fitted: the bytes of a fake-tensor step at it, not the line's
            estimate_bytes=_host_estimate if est is None else None,
            **tiling,
        )
    show_seq_len(out, res)
    d = res.to_dict() | show_calibration(args, out)
    if parallel is not None:
        d |= {"parallel": parallel.to_dict(), "rank_share": share}  # as memfit fit --world-size writes them
    if args.out:
        res.fit.plan.save(args.out)
        d["plan_file"] = args.out
    return d


def _host_estimate(wl: Any, step: StepSpec, **options: Any) -> Any:
    """Stats of fake-tensor steps on this machine's kernels, made as the profile at that length would
    be (the search's ``estimate_bytes``); the device's rates only set their seconds, which the search
    does not take."""
    try:
        device = host_device()
    except SpecError:  # a GPU the table does not list: its bytes do not depend on the rates
        device = get_device("h100-sxm")
    return estimate_stats(wl, device=device, step=step, **options)


def _estimator(args: argparse.Namespace) -> Any:
    """``workload -> stats_fn`` for the device ``--estimate --target`` names (as
    :func:`memfit.cli.plan.estimate_setup` builds it for one length)."""
    cal = getattr(args, "time_calibration", None)
    device = cal.device if cal else get_device(args.target)
    mfu = cal.mfu if cal else getattr(args, "mfu", None)
    step_dtype = parse_dtype(args.param_dtype) if getattr(args, "param_dtype", None) else None
    step = StepSpec(optimizer=getattr(args, "optimizer", "adamw"), seed=args.seed, dtype=step_dtype)

    policy = getattr(args, "policy", None)
    tiling = {"tiling": False} if policy is not None else tiling_from_args(args)

    def estimator(wl: Any) -> Any:
        return stats_fn(
            wl, device=device, mfu=mfu, activations=not getattr(args, "keep_activations", False), step=step,
            heads=not getattr(args, "keep_head", False) and policy is None, **tiling,
        )  # fmt: skip

    return estimator


def show_seq_len(out: Output, res: SeqLenFit) -> None:
    """The lengths tried, the answer with its plan, the attention kernels and any warning."""
    out.table(
        f"sequence lengths tried within {mib(res.fit.budget_bytes)} at micro-batch {res.fit.micro_batch}"
        + (f" (estimated for {res.fit.estimated.device})" if res.fit.estimated is not None else ""),
        ["seq_len", "stats", "a plan needs", "fits", "predicted longest", "profile: predicted", "measured", "window"],
        [
            (
                t.seq_len,
                t.stats if t.stats != "scaled" else f"scaled from {', '.join(map(str, t.scaled_from))}",
                mib(t.need_bytes),
                "yes" if t.fits else "no",
                t.predicted_seq_len or "-",
                mib(t.predicted_profile_peak_bytes),
                mib(t.profile_peak_bytes),
                mib(t.measured_peak_bytes),
            )
            for t in res.tries
        ],
    )
    plan = res.fit.plan
    why = {
        "budget": f"{res.upper_seq_len} tokens does not fit" if res.upper_seq_len else "the budget",
        "positions": f"the model's {res.positions.max_positions if res.positions else '?'} positions",
        "max_seq_len": "--max-seq-len",
    }[res.limited_by]
    out.print(
        f"[bold]seq_len {res.seq_len}[/] (limited by {why}): micro-batch {res.fit.micro_batch} x {res.fit.accumulation_steps} steps, "
        f"{len(plan.recomputed)} of {len(plan.blocks)} blocks recomputed; predicted peak {mib(res.fit.predicted_peak_bytes)}"
        + (f", measured {mib(res.fit.measured_peak_bytes)}" if res.fit.measured_peak_bytes is not None else "")
        + f"; {res.seq_len * res.fit.predicted_samples_per_s:,.0f} tokens/s predicted"
    )
    if res.attention is not None:
        out.print(res.attention.summary())
    for w in res.warnings:
        out.warn(w)
