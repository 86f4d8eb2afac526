"""The CUDA caching-allocator model (memfit.estimation.allocator) on hand-made sequences whose
result follows from torch's rules (each test names the rule), against a brute-force allocator
written independently from the same rules, and on a fake step's recorded allocations."""

from __future__ import annotations

import random

import pytest

from memfit.errors import SpecError
from memfit.estimation.allocator import (
    AllocatorConfig,
    AllocatorOutOfMemoryError,
    CachingAllocator,
    allocator_model,
    replay_step,
    round_size,
    segment_size,
)
from memfit.estimation.devices import get_device

MiB = 2**20


def test_round_size_and_segment_size_rules() -> None:
    # round_size: at least kMinBlockSize (512 B), multiples of 512 B
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 1536)] == [512, 512, 512, 512, 1024, 1536]
    # get_allocation_size: <= kSmallSize (1 MiB) -> kSmallBuffer (2 MiB); < kMinLargeAlloc (10 MiB)
    # -> kLargeBuffer (20 MiB); else rounded up to kRoundLarge (2 MiB)
    assert segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(10 * MiB + 512) == 12 * MiB


def test_small_requests_pack_into_one_2mib_segment() -> None:
    # small pool: four 512 KiB requests fill one 2 MiB segment (split while >= 512 B remain);
    # the fifth needs a second segment
    a = CachingAllocator()
    for i in range(4):
        a.malloc(i, 512 * 1024)
    assert (a.reserved_bytes, a.segment_count) == (2 * MiB, 1)
    a.malloc(4, 512 * 1024)
    assert (a.reserved_bytes, a.segment_count) == (4 * MiB, 2)
    assert a.allocated_bytes == 5 * 512 * 1024


def test_medium_requests_share_a_20mib_segment_and_unsplit_remainder_counts_allocated() -> None:
    # 1-10 MiB requests come from a 20 MiB segment; a remainder above 1 MiB is split off
    a = CachingAllocator()
    a.malloc("a", 6 * MiB)
    a.malloc("b", 6 * MiB)
    a.malloc("c", 6 * MiB)
    assert (a.reserved_bytes, a.allocated_bytes) == (20 * MiB, 18 * MiB)
    # the 2 MiB left is split off only if more than 1 MiB remains: a 1.5 MiB request leaves 0.5 MiB,
    # so the whole 2 MiB block is handed out and counted as allocated
    a.malloc("d", 3 * MiB // 2)
    assert (a.reserved_bytes, a.allocated_bytes) == (20 * MiB, 20 * MiB)


def test_freed_blocks_stay_cached_and_merge() -> None:
    # free_block: a freed block merges with free neighbours and stays reserved (no cudaFree)
    a = CachingAllocator()
    a.malloc("a", 12 * MiB)  # its own 12 MiB segment
    a.free("a")
    assert (a.reserved_bytes, a.allocated_bytes) == (12 * MiB, 0)
    a.malloc("b", 4 * MiB)  # best fit: the cached 12 MiB block, split (8 MiB > 1 MiB remain)
    a.malloc("c", 4 * MiB)
    a.malloc("d", 4 * MiB)
    assert a.reserved_bytes == 12 * MiB
    a.free("b")
    a.free("c")  # merges with b's block: one free 8 MiB block
    a.malloc("e", 8 * MiB)
    assert a.reserved_bytes == 12 * MiB


def test_fragmentation_grows_reserved() -> None:
    # A larger request finds no cached block big enough: a new segment although 2 x 12 MiB are free
    a = CachingAllocator()
    a.malloc("a", 12 * MiB)
    a.malloc("b", 12 * MiB)
    a.free("a")
    a.free("b")  # separate segments: no merge across segments
    a.malloc("c", 14 * MiB)
    assert a.reserved_bytes == 38 * MiB
    assert a.max_allocated_bytes == 24 * MiB


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    a = CachingAllocator()
    a.malloc("a", 30 * MiB)  # its own 30 MiB segment
    a.malloc("x", 2 * MiB)  # a 20 MiB segment, 18 MiB left free
    a.malloc("b", 14 * MiB)  # best fit: the 18 MiB block (no new segment), 4 MiB left
    a.malloc("y", 2 * MiB)  # 2 MiB left
    assert a.reserved_bytes == 50 * MiB
    a.free("a")
    a.free("b")  # free: 2 MiB, 14 MiB (b), 30 MiB (a)
    a.malloc("c", 13 * MiB)  # best fit: b's 14 MiB (not a's 30 MiB), unsplit (only 1 MiB left)
    a.malloc("d", 29 * MiB)  # then a's 30 MiB, unsplit
    assert a.reserved_bytes == 50 * MiB
    assert a.allocated_bytes == (2 + 14 + 2 + 30) * MiB


def test_streams_do_not_share_cached_blocks() -> None:
    # blocks freed on one stream are reused only on that stream
    a = CachingAllocator()
    a.malloc("a", 12 * MiB, stream=0)
    a.free("a")
    a.malloc("b", 12 * MiB, stream=1)
    assert a.reserved_bytes == 24 * MiB


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    # max_split_size: a request below it does not take a block at or above it
    cfg = AllocatorConfig(max_split_size_bytes=16 * MiB)
    a = CachingAllocator(cfg)
    a.malloc("a", 32 * MiB)
    a.free("a")
    a.malloc("b", 12 * MiB)
    assert a.reserved_bytes == 44 * MiB
    # without it, the cached 32 MiB block would have been split
    b = CachingAllocator()
    b.malloc("a", 32 * MiB)
    b.free("a")
    b.malloc("b", 12 * MiB)
    assert b.reserved_bytes == 32 * MiB


def test_expandable_segments_grow_in_pages() -> None:
    # one segment per pool and stream; large-pool pages of 20 MiB, blocks split at 512 B
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a.malloc("a", 12 * MiB)
    assert a.reserved_bytes == 20 * MiB
    a.malloc("b", 12 * MiB)  # 8 MiB free at the end: map one more page
    assert a.reserved_bytes == 40 * MiB
    a.free("a")
    a.malloc("c", 14 * MiB)  # a's 12 MiB hole does not fit; the end has 16 MiB free
    assert a.reserved_bytes == 40 * MiB
    assert a.segment_count == 1
    a.malloc("d", 100)  # the small pool's segment: 2 MiB pages
    assert a.reserved_bytes == 42 * MiB


def test_capacity_releases_cached_segments_then_ooms() -> None:
    # cudaMalloc failing: release cached whole segments and retry; still over: out of memory
    a = CachingAllocator(AllocatorConfig(capacity_bytes=40 * MiB))
    a.malloc("a", 24 * MiB)
    a.free("a")
    a.malloc("b", 30 * MiB)  # 24 + 30 > 40: the cached 24 MiB segment goes, then it fits
    assert (a.reserved_bytes, a.retries) == (30 * MiB, 1)
    with pytest.raises(AllocatorOutOfMemoryError, match="out of memory"):
        a.malloc("c", 12 * MiB)


def test_bad_keys_are_refused() -> None:
    a = CachingAllocator()
    a.malloc("a", 10)
    with pytest.raises(SpecError, match="allocated already"):
        a.malloc("a", 10)
    with pytest.raises(SpecError, match="not allocated"):
        a.free("b")


# ---------------------------------------------------------------- brute force


class _Naive:
    """The same rules, written the slow way: segments as lists of [offset, size, owner] (owner None
    when free), best fit by scanning every free block."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, bool, list[list]]] = []  # (base address, small?, blocks)
        self.where: dict = {}
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.base = 0

    def malloc(self, key, n: int) -> None:
        size = round_size(n)
        small = size <= MiB
        best = None
        for base, s_small, blocks in self.segments:
            if s_small != small:
                continue
            for b in blocks:
                if b[2] is None and b[1] >= size:
                    cand = (b[1], base + b[0])
                    if best is None or cand < best[0]:
                        best = (cand, blocks, b)
        if best is None:
            alloc = segment_size(size)
            blocks = [[0, alloc, None]]
            self.segments.append((self.base, small, blocks))
            self.base += alloc
            self.reserved += alloc
            self.max_reserved = max(self.max_reserved, self.reserved)
            b = blocks[0]
        else:
            _, blocks, b = best
        rest = b[1] - size
        if (rest >= 512) if small else (rest > MiB):
            blocks.insert(blocks.index(b) + 1, [b[0] + size, rest, None])
            b[1] = size
        b[2] = key
        self.where[key] = (blocks, b)
        self.allocated += b[1]
        self.max_allocated = max(self.max_allocated, self.allocated)

    def free(self, key) -> None:
        blocks, b = self.where.pop(key)
        self.allocated -= b[1]
        b[2] = None
        i = blocks.index(b)
        if i + 1 < len(blocks) and blocks[i + 1][2] is None:
            b[1] += blocks.pop(i + 1)[1]
        if i > 0 and blocks[i - 1][2] is None:
            blocks[i - 1][1] += blocks.pop(i)[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_matches_brute_force_allocator(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [1, 700, 200_000, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB + 3, 33 * MiB]
    fast, slow = CachingAllocator(), _Naive()
    live: list[int] = []
    for i in range(1500):
        if live and rng.random() < 0.47:
            k = live.pop(rng.randrange(len(live)))
            fast.free(k)
            slow.free(k)
        else:
            n = rng.choice(sizes) + rng.randrange(0, 4096)
            fast.malloc(i, n)
            slow.malloc(i, n)
            live.append(i)
        assert (fast.allocated_bytes, fast.reserved_bytes) == (slow.allocated, slow.reserved), i
    assert (fast.max_allocated_bytes, fast.max_reserved_bytes) == (slow.max_allocated, slow.max_reserved)


def test_reserved_bounds_on_random_streams() -> None:
    # reserved is never below allocated, with or without expandable segments
    rng = random.Random(7)
    events: list[tuple[int, int]] = []
    live: list[int] = []
    for i in range(3000):
        if live and rng.random() < 0.5:
            events.append((live.pop(rng.randrange(len(live))), -1))
        else:
            events.append((i, rng.choice([300, 90_000, 2 * MiB + 5, 7 * MiB, 24 * MiB + 11])))
            live.append(i)
    plain = replay_step(events, steps=1)
    exp = replay_step(events, steps=1, config=AllocatorConfig(expandable_segments=True))
    assert plain.max_reserved_bytes >= plain.max_allocated_bytes
    assert exp.max_reserved_bytes >= exp.max_allocated_bytes


def test_replay_step_repeats_and_frees_what_the_step_kept() -> None:
    # pre-existing 40 MiB of weights; the step makes a 30 MiB activation, frees it, keeps a 12 MiB
    # gradient. Step 2 frees the gradient first (zero_grad) and reuses the cached blocks.
    events = [(1, 40 * MiB), (2, 30 * MiB), (3, 12 * MiB), (2, -1)]
    rep = replay_step(events, step_start=1, steps=3)
    assert rep.reserved_bytes_by_step == ((40 + 30 + 12) * MiB,) * 3
    assert rep.max_allocated_bytes == (40 + 30 + 12) * MiB


def test_allocator_model_without_events_is_a_lower_bound() -> None:
    h200 = get_device("h200")
    pred = allocator_model(100 * MiB + 3, h200)
    assert pred.method == "bound"
    assert pred.predicted_allocated_bytes == 100 * MiB + 3 + 2 * 32 * MiB
    assert pred.predicted_reserved_bytes % (2 * MiB) == 0
    cpu = allocator_model(5, get_device("cpu"))
    assert cpu.predicted_reserved_bytes == 5


def test_fake_step_allocations_replay_above_the_tracked_peak() -> None:
    from memfit import StepSpec
    from memfit.estimation import estimate

    est = estimate("demo?n_layer=2", device="h100-sxm", step=StepSpec(batch_size=2))
    assert est.predicted_reserved_bytes is not None
    ws = 2 * 32 * MiB
    # allocated: the tracked peak plus the workspaces, and up to a block's rounding per tensor
    assert est.peak_bytes + ws <= est.predicted_allocated_bytes <= est.peak_bytes + ws + 4 * MiB
    assert est.predicted_reserved_bytes >= est.predicted_allocated_bytes
    assert est.predicted_reserved_bytes % (2 * MiB) == 0


def test_published_mfu_table_is_the_benchmark_fit() -> None:
    # estimation.devices.PUBLISHED_MFU quotes benchmarks/results/published_runs.json: they must agree
    import json
    from pathlib import Path

    from memfit.estimation.devices import PUBLISHED_MFU

    data = json.loads((Path(__file__).parent.parent / "benchmarks/results/published_runs.json").read_text())
    fitted = data["calibrated_mfu"]
    assert set(PUBLISHED_MFU) == set(fitted)
    for cls, pub in PUBLISHED_MFU.items():
        assert pub.mfu == pytest.approx(fitted[cls]["mfu"], abs=5e-4), cls
        assert ("compute only" in pub.on) == fitted[cls]["on"].startswith("compute only"), cls


def test_rank_allocator_adds_the_one_process_cache_and_collective_pools() -> None:
    from memfit.estimation.allocator import AllocatorPrediction, collective_pool_bytes, rank_allocator_model

    h100 = get_device("h100-sxm")
    single = AllocatorPrediction(
        tensor_peak_bytes=0, workspace_bytes=0, predicted_allocated_bytes=100 * MiB, predicted_reserved_bytes=130 * MiB
    )
    # FSDP2: the all-gather copy-in pool holds max(root, 2 blocks) of flat outputs, one block's live at the peak;
    # the reduce-scatter pool holds the gradient shards
    pools = collective_pool_bytes("fsdp2", [40 * MiB] * 4 + [100 * MiB], grad_shard_bytes=25 * MiB)
    assert pools == (100 - 40 + 25) * MiB
    assert collective_pool_bytes("ddp", [40 * MiB], grad_shard_bytes=25 * MiB) == 0
    rank = rank_allocator_model(500 * MiB, h100, single=single, collective_pool_bytes=pools)
    assert rank.predicted_allocated_bytes == 500 * MiB + 64 * MiB
    assert rank.predicted_reserved_bytes == 500 * MiB + 64 * MiB + 30 * MiB + pools
    assert rank.method == "rank"


def test_a_sharded_optimizer_step_caches_its_share_of_the_one_process_cache() -> None:
    """What a rank's replay caches from its optimizer step scales with 1/world_size: 96 MiB of weights
    and 192 MiB of optimizer state, a 96 MiB gradient, then a 96 MiB temporary freed before a 144 MiB
    one that cannot reuse its segment (requests of 10 MiB and more get segments of their own size):
    the first temporary's segment stays cached at the step's allocated peak."""
    from memfit.estimation.allocator import shard_model_states

    events = [
        (1, 96 * MiB), (2, 192 * MiB),  # model states
        (3, 12 * MiB),  # the batch
        (4, 96 * MiB),  # backward: the gradient
        (6, 96 * MiB), (6, -96 * MiB), (7, 144 * MiB), (7, -144 * MiB),  # the optimizer step's temporaries
    ]  # fmt: skip

    def cached(shards: int) -> int:
        stream = shard_model_states(events, states_end=2, step_start=3, optimizer_start=4, shards=shards)
        rep = replay_step(stream, step_start=3, steps=3)
        return rep.max_reserved_bytes - rep.max_allocated_bytes

    assert cached(1) == 96 * MiB
    for world in (2, 4, 8):  # every size / world stays a whole number of 2 MiB pages of 10 MiB or more
        assert cached(world) == 96 * MiB // world
    # the batch keeps its bytes; a free takes its allocation's size
    stream = shard_model_states(events, states_end=2, step_start=3, optimizer_start=4, shards=4)
    assert stream[2] == events[2] and stream[3] == (4, 24 * MiB) and stream[5] == (6, -24 * MiB)
    assert shard_model_states(events, states_end=2, step_start=3, optimizer_start=4, shards=1) == events
    with pytest.raises(SpecError, match="shards=0"):
        shard_model_states(events, states_end=2, step_start=3, optimizer_start=4, shards=0)


_SHARDED_LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=512&intermediate_size=2048&num_attention_heads=8"
    "&vocab_size=16000&seq_len=32&padding=false"
)


def test_a_replay_with_sharded_states_holds_a_ranks_states_not_the_one_process_ones() -> None:
    """A fake step's stream with its model states at 1/8: the replay's allocated peak is below half of
    the one process's parameters, gradients and AdamW state (fp32: 16 bytes a parameter), which the
    unsharded replay holds (the activations of 32 tokens are small beside them)."""
    from memfit import StepSpec
    from memfit.estimation import estimate

    one = estimate(_SHARDED_LLAMA, device="a100-80gb", step=StepSpec(batch_size=1))
    rank = estimate(_SHARDED_LLAMA, device="a100-80gb", step=StepSpec(batch_size=1), states_shards=8)
    states_bytes = 16 * one.n_params
    assert one.breakdown["allocator"]["replay"]["max_allocated_bytes"] > states_bytes
    assert rank.breakdown["allocator"]["replay"]["max_allocated_bytes"] < states_bytes / 2
    assert (rank.peak_bytes, rank.params_bytes) == (one.peak_bytes, one.params_bytes)  # the rest: one process
    with pytest.raises(SpecError, match="states_shards=0"):
        estimate(_SHARDED_LLAMA, device="a100-80gb", step=StepSpec(batch_size=1), states_shards=0)


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_an_fsdp2_ranks_allocator_term_replays_its_shard_and_a_ddp_rank_the_whole(monkeypatch) -> None:
    import memfit.estimation.parallel as parallel
    from memfit.plan.parallel import Parallel, ParallelKind

    shards = []
    real = parallel.estimate

    def spy(*args, **kwargs):
        shards.append(kwargs.get("states_shards", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(parallel, "estimate", spy)
    for kind in (ParallelKind.FSDP2, ParallelKind.DDP):
        rs, plan, pred = parallel.estimate_rank(
            _SHARDED_LLAMA, parallel=Parallel(kind=kind, world_size=8), device="a100-80gb", batch_size=1
        )
        parallel.estimate_rank_allocator(
            _SHARDED_LLAMA, rank=rs, plan=plan, peak_bytes=pred.peak_bytes, device="a100-80gb"
        )
    assert shards == [8, 1]
