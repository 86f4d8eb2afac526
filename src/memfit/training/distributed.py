"""The ranks of a run: one process, or a process group set up from ``torchrun``'s environment.

Under ``torchrun --nproc_per_node=N`` (``WORLD_SIZE > 1``) :meth:`Ranks.setup` starts the process
group (gloo on CPU, NCCL on CUDA) unless the caller already did, :meth:`Ranks.wrap` wraps the model
in DDP or FSDP2 (NOTE [ Wrapping ]), and the helpers below move Python objects between ranks. With
one process every helper is the identity and nothing of ``torch.distributed`` is touched. The peak of
an FSDP2 step on CPU is measured by :mod:`memfit.training.fsdp_peak`.

NOTE [ Wrapping ]
The plan is applied to the plain model first, then the model is wrapped (torchtitan's order):
DDP (``bucket_cap_mb`` from the layout), or FSDP2: ``fully_shard`` on each block of the chain
(``reshard_after_forward`` and the ``MixedPrecisionPolicy`` of ``param_dtype`` / ``reduce_dtype``
from the layout), then on the root with torch's default resharding and the same policy. That is the
layout :mod:`memfit.plan.parallel` accounts for, so a plan made with ``memfit plan --world-size N
--parallel fsdp2`` predicts each rank's peak of this run. Without a layout, ``torchrun`` runs
get DDP with torch's defaults (as before). The Accumulator recognises either wrapper and turns
gradient sync off on the non-final micro-steps (``no_sync`` / ``set_requires_gradient_sync``).

NOTE [ Bounded collectives ]
A rank that stops (SIGSTOP, a hung data loader, a dead host) leaves the others waiting inside a
collective, where Python runs no signal handler: such a rank used to block for gloo's default 30
minutes, deaf to SIGTERM and holding the save lock. Every collective is now bounded by
``timeout_s`` (``memfit train --collective-timeout``): it is the process group's timeout (passed to
``init_process_group``, so DDP's and FSDP2's own collectives and the rendezvous obey it too), and
the collectives of :class:`Ranks` itself (the per-step stop flag, the start-up broadcast, the
gathers of a save and of the result) run asynchronously and are waited for in Python, a few
milliseconds at a time, so that SIGINT/SIGTERM handlers run while the other ranks are awaited. A
wait that reaches the timeout raises :class:`CollectiveTimeout`; a signal while waiting gives the
other ranks :data:`SIGNAL_GRACE_S` more to arrive (a signal from torchrun reaches every rank, and
each finishes its window first), then raises :class:`CollectiveInterrupted`. The loop turns either
into a stop that names the last complete save (NOTE [ Stopping a run ] in
:mod:`memfit.training.signals`). Inside DDP's or FSDP2's backward the wait is torch's: a signal
there is handled when the process group's timeout ends it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.capture.chain import discover_chain
from memfit.errors import MemfitError, SpecError
from memfit.plan.parallel import Parallel, ParallelKind

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""How long a rank waits for the others at one collective by default (NOTE [ Bounded collectives ])."""
SIGNAL_GRACE_S = 10.0
"""After a signal, how much longer a waiting rank gives the others (NOTE [ Bounded collectives ])."""


class CollectiveTimeout(MemfitError):
    """The other ranks did not reach a collective within the timeout (NOTE [ Bounded collectives ])."""

    def __init__(self, message: str, *, what: str, waited_s: float) -> None:
        super().__init__(message)
        self.what = what
        self.waited_s = waited_s


class CollectiveInterrupted(MemfitError):
    """A signal arrived while this rank waited for the others, who did not come (NOTE [ Bounded collectives ])."""

    def __init__(self, message: str, *, signum: int, what: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.what = what


class Ranks:
    """The process group when launched by torchrun (WORLD_SIZE > 1), else a single process."""

    def __init__(
        self, rank: int, world: int, device: torch.device, owned: bool, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    ) -> None:
        """Use :meth:`setup`; ``owned``: this object started the process group and ends it."""
        self.rank, self.world, self.device, self._owned = rank, world, device, owned
        self.is_main = rank == 0
        self.timeout_s = timeout_s
        self.lost = False  # a collective failed or timed out: the group is unusable
        self.signal_received: Callable[[], int | None] = lambda: None  # set by the training loop

    @classmethod
    def setup(cls, device_arg: str, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Ranks:
        """This process's rank and device (``auto``: ``cuda:LOCAL_RANK`` when CUDA is available).

        Args:
            device_arg: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
            timeout_s: the longest wait for the other ranks at one collective (NOTE [ Bounded collectives ]).

        Raises:
            SpecError: torchrun's environment variables are missing or malformed, or the process
                group cannot be joined.
        """
        world = _env_int("WORLD_SIZE", 1)
        local = _env_int("LOCAL_RANK", 0)
        if device_arg == "auto":
            device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(device_arg)
            if device.type == "cuda" and device.index is None:
                device = torch.device(f"cuda:{local}")
        if world <= 1:
            return cls(0, 1, device, owned=False, timeout_s=timeout_s)
        owned = not tdist.is_initialized()
        if owned:
            rank = _check_torchrun_env(world)
            try:
                tdist.init_process_group(
                    "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
                )
            except (RuntimeError, ValueError) as err:  # torch's DistError family and rendezvous errors
                raise SpecError(
                    f"memfit.training: rank {rank} of {world} could not join the torchrun group at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout_s:g} s "
                    f"({type(err).__name__}: {' '.join(str(err).split())[:200].rstrip('.')}). Launch every rank with torchrun "
                    "--nproc-per-node N -m memfit.cli.main train ..., or raise --collective-timeout."
                ) from None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(tdist.get_rank(), tdist.get_world_size(), device, owned, timeout_s=timeout_s)

    def wrap(self, model: nn.Module, parallel: Parallel | None = None, blocks: Any = None) -> nn.Module:
        """``model`` wrapped for the ranks (NOTE [ Wrapping ]); ``model`` itself on one process.

        Args:
            model: the plain model, with its plan applied.
            parallel: the layout (None: DDP with torch's defaults).
            blocks: the chain's containers (the workload's ``blocks``), for FSDP2's units.
        """
        if self.world <= 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        if parallel is None or parallel.kind is ParallelKind.DDP:
            cap_mb = parallel.bucket_cap_bytes / 2**20 if parallel is not None else 25
            return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cap_mb)
        from torch.distributed.fsdp import fully_shard  # loads DTensor (~1 s): only an FSDP2 run pays it

        mp = _mixed_precision(parallel)
        for block in discover_chain(model, blocks).blocks:
            fully_shard(block, reshard_after_forward=parallel.reshard_after_forward, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # the root: torch's default (kept gathered from forward to backward)
        return model

    def shares(self, global_batch: int) -> list[int]:
        """Samples of a global batch per rank: ``G / world``, the first ranks one more when it does not divide."""
        return [global_batch // self.world + (r < global_batch % self.world) for r in range(self.world)]

    def gather_objects(self, obj: Any, what: str = "gathering results") -> list[Any]:
        """Every rank's ``obj``, in rank order (NOTE [ Bounded collectives ])."""
        if self.world <= 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._wire) for _ in range(self.world)]
        self._run(tdist.all_gather(sizes, torch.tensor([data.numel()], device=self._wire), async_op=True), what)
        longest = int(max(int(n.item()) for n in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self._wire)
        padded[: data.numel()] = data.to(self._wire)
        pieces = [torch.empty(longest, dtype=torch.uint8, device=self._wire) for _ in range(self.world)]
        self._run(tdist.all_gather(pieces, padded, async_op=True), what)
        return [pickle.loads(p[: int(n.item())].cpu().numpy().tobytes()) for p, n in zip(pieces, sizes, strict=True)]

    def broadcast(self, obj: Any, what: str = "waiting for rank 0") -> Any:
        """Rank 0's ``obj`` on every rank (NOTE [ Bounded collectives ])."""
        if self.world <= 1:
            return obj
        data = pickle.dumps(obj) if self.is_main else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._wire)
        self._run(tdist.broadcast(size, src=0, async_op=True), what)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._wire)
            if self.is_main
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self._wire)
        )
        self._run(tdist.broadcast(buf, src=0, async_op=True), what)
        return obj if self.is_main else pickle.loads(buf.cpu().numpy().tobytes())

    def any(self, flag: bool, what: str = "agreeing on a stop") -> bool:
        """True on every rank when ``flag`` is True on any (one small all-reduce under torchrun)."""
        if self.world <= 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._wire)
        self._run(tdist.all_reduce(t, op=tdist.ReduceOp.MAX, async_op=True), what)
        return bool(t.item() > 0)

    def barrier(self, what: str = "waiting for every rank") -> None:
        """Wait for every rank."""
        if self.world > 1:
            self._run(tdist.barrier(async_op=True), what)

    def close(self) -> None:
        """End the process group if :meth:`setup` started it (not after a lost rank: ending it
        would wait for that rank once more)."""
        if self._owned and not self.lost:
            tdist.destroy_process_group()

    @property
    def _wire(self) -> torch.device:
        """Where collectives' tensors live: the GPU under NCCL, else the CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _run(self, work: Any, what: str) -> None:
        """Wait for an asynchronous collective in Python: bounded by :attr:`timeout_s`, with
        signal handlers running meanwhile (NOTE [ Bounded collectives ])."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        nap = 1e-4
        graced = False  # the deadline is the signal's grace, not --collective-timeout
        while not work.is_completed():
            now = time.monotonic()
            signum = self.signal_received()
            if signum is not None and deadline > now + SIGNAL_GRACE_S:
                deadline = now + SIGNAL_GRACE_S  # torchrun signals every rank: give the others their window
                graced = True
            if now >= deadline:
                self.lost = True
                waited = now - start
                if signum is not None:
                    within = f"{waited:.0f} s" if graced else f"--collective-timeout {self.timeout_s:g} s"
                    raise CollectiveInterrupted(
                        f"memfit.training: rank {self.rank} was {what} when {_signal_name(signum)} arrived, and the other "
                        f"ranks did not come within {within} (a rank stopped, died or hangs)",
                        signum=signum,
                        what=what,
                    )
                raise CollectiveTimeout(
                    f"memfit.training: rank {self.rank} waited {waited:.0f} s (--collective-timeout) for the other ranks "
                    f"({what}): a rank stopped, died or hangs (check every rank's output; if one is only slow, raise "
                    "--collective-timeout)",
                    what=what,
                    waited_s=waited,
                )
            time.sleep(nap)
            nap = min(nap * 2, 0.01)
        try:
            work.wait()  # raises the collective's own error (a rank that died)
        except RuntimeError:
            self.lost = True
            raise


_TORCHRUN = (
    "torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT: launch with torchrun "
    "--nproc-per-node N -m memfit.cli.main train ..., or unset WORLD_SIZE to run one process"
)


def _env_int(name: str, default: int) -> int:
    """A whole-number environment variable of torchrun's (``default`` when unset)."""
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise SpecError(
            f"memfit.training: {name}={text!r} in the environment is not a whole number. {_TORCHRUN}."
        ) from None
    if value < 0:
        raise SpecError(f"memfit.training: {name}={text!r} in the environment is negative. {_TORCHRUN}.")
    return value


def _check_torchrun_env(world: int) -> int:
    """The rank, after checking the variables ``init_process_group``'s rendezvous reads."""
    if os.environ.get("RANK") is None:
        raise SpecError(f"memfit.training: WORLD_SIZE={world} is set but RANK is not. {_TORCHRUN}.")
    rank = _env_int("RANK", 0)
    if rank >= world:
        raise SpecError(f"memfit.training: RANK={rank} is not below WORLD_SIZE={world}. {_TORCHRUN}.")
    if not os.environ.get("MASTER_ADDR"):
        raise SpecError(f"memfit.training: WORLD_SIZE={world} is set but MASTER_ADDR is not. {_TORCHRUN}.")
    port = os.environ.get("MASTER_PORT", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(f"memfit.training: MASTER_PORT={port!r} is not a port number (1-65535). {_TORCHRUN}.")
    return rank


_LOST_RANK_WORDS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_lost_rank(err: BaseException) -> bool:
    """Whether ``err`` says another rank is gone: memfit's own collective errors, torch's
    ``DistError`` family, or the ``RuntimeError`` a gloo/NCCL collective raises when its peer does
    not answer within the process group's timeout or has closed its connection."""
    if isinstance(err, CollectiveTimeout | CollectiveInterrupted | tdist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        any(w in text for w in _LOST_RANK_WORDS) and ("gloo" in text or "NCCL" in text or "nccl" in text)
    )


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def world_size_from_env() -> int:
    """torchrun's ``WORLD_SIZE`` (1 when unset).

    Raises:
        SpecError: it is not a whole number.
    """
    return _env_int("WORLD_SIZE", 1)


def fsdp2_peak(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, device: torch.device) -> Any:
    """Measure one FSDP2 window on this rank: :func:`memfit.training.fsdp_peak.fsdp2_peak`, a context
    manager that yields its :class:`~memfit.training.fsdp_peak.Fsdp2Peak`."""
    from memfit.training.fsdp_peak import fsdp2_peak as measure  # torch's tracker loads DTensor, the compiler (~1.5 s)

    return measure(model, optimizer, batch, device)


def _mixed_precision(parallel: Parallel) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the layout's ``param_dtype`` / ``reduce_dtype`` (torch's
    default policy, no casts, when neither is set)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # loads DTensor (~1 s): only an FSDP2 run pays it

    def dtype(name: str | None) -> torch.dtype | None:
        return getattr(torch, name) if name else None

    return MixedPrecisionPolicy(param_dtype=dtype(parallel.param_dtype), reduce_dtype=dtype(parallel.reduce_dtype))
