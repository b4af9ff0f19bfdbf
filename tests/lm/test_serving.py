"""Paged KV memory (17.12) and continuous-batching utilisation (17.13) against independent oracles.

Oracles: ``.numel() * .element_size()`` of the allocator's real pool blocks in use and a brute-force
replay of a random workload (``ceil(S / block_size)`` per live sequence, counted here); the tiny GPT's
full forward pass for decoding through the paged cache (float32, ``atol = 2e-5``) and the contiguous
``KVCache`` for the gathered keys and values (exactly equal); for utilisation a slot-by-slot simulation
written in this file (busy slot-steps counted one by one) and the closed forms of static batching
(sum of per-batch maxima) and of one slot (``U = 1``). Utilisations agree to ``rel_tol = 1e-12``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from llmbook.lm import kv_cache as kc
from llmbook.lm import serving as sv
from llmbook.lm.training import pretrained_tiny

# ----------------------------------------------------------------------------- 17.12 paged memory


@pytest.mark.equation("17.12", oracle="numel() * element_size() of the allocator's real pool blocks in use")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_bytes_equal_the_real_blocks(dtype):
    pool = sv.PagedKVAllocator(num_blocks=20, block_size=4, n_layers=3, H_kv=2, d_h=8, dtype=dtype)
    for seq, n in (("a", 5), ("b", 12), ("c", 1), ("a", 4)):
        pool.append(seq, n)
    N = pool.allocated_blocks()
    assert N == math.ceil(9 / 4) + math.ceil(12 / 4) + math.ceil(1 / 4) == 7
    b = torch.finfo(dtype).bits // 8
    used = sorted(x for s in pool.sequences() for x in pool.block_table(s))
    real = sum(p[:, used].numel() * p.element_size() for p in (pool.k_pool, pool.v_pool))
    assert real == pool.allocated_bytes() == sv.paged_kv_bytes(N, 4, 2, 8, b, n_layers=3)
    assert sv.paged_kv_bytes(N, 4, 2, 8, b) * 3 == real  # per layer, as the catalogue writes it
    assert pool.wasted_slots() == 7 * 4 - 22


@pytest.mark.equation("17.12", oracle="brute-force replay of a random append/free workload")
def test_random_workload_against_a_brute_force_count():
    rng = random.Random(0)
    pool = sv.PagedKVAllocator(num_blocks=64, block_size=8, n_layers=1, H_kv=1, d_h=2)
    lengths: dict[int, int] = {}
    for _ in range(400):
        if lengths and rng.random() < 0.2:
            seq = rng.choice(sorted(lengths))
            pool.free(seq)
            del lengths[seq]
        else:
            seq, n = rng.randrange(12), rng.randrange(1, 20)
            if pool.can_append(seq, n):
                pool.append(seq, n)
                lengths[seq] = lengths.get(seq, 0) + n
            else:  # a refusal must be justified: the brute-force need exceeds the blocks
                old = lengths.get(seq, 0)
                need = sum(-(-s // 8) for s in lengths.values()) - -(-old // 8) + -(-(old + n) // 8)
                assert need > 64
        blocks = sum(-(-s // 8) for s in lengths.values())
        assert pool.allocated_blocks() == blocks
        assert pool.allocated_bytes() == sv.paged_kv_bytes(blocks, 8, 1, 2, 4)
        tables = [b for s in pool.sequences() for b in pool.block_table(s)]
        assert len(tables) == len(set(tables)) == blocks  # no block is shared or lost
    with pytest.raises(ValueError, match="out of KV blocks"):
        pool.append("big", 64 * 8 + 1)


def test_paged_decoding_equals_the_full_forward_and_the_contiguous_cache():
    model, tok = pretrained_tiny()
    cfg = model.config
    ids = torch.as_tensor(tok.encode("Pages of keys, pages of values."), dtype=torch.long)[None]
    pool = sv.PagedKVAllocator(num_blocks=32, block_size=4, n_layers=cfg.n_layers, H_kv=cfg.kv_heads,
                               d_h=cfg.head_dim)
    pool.append("other", 6)  # another sequence first, so that this one's blocks are not contiguous
    paged, flat = sv.PagedSequenceCache(pool, "s"), kc.KVCache.for_model(model, 1)
    with torch.no_grad():
        outs = [kc.forward_cached(model, ids[:, :7], paged)]
        kc.forward_cached(model, ids[:, :7], flat)
        for t in range(7, ids.shape[1]):
            outs.append(kc.forward_cached(model, ids[:, t:t + 1], paged))
            kc.forward_cached(model, ids[:, t:t + 1], flat)
            if t == 12:
                pool.append("other", 5)  # interleave another sequence's growth
        torch.testing.assert_close(torch.cat(outs, 1), model(ids), atol=2e-5, rtol=0)
    assert pool.block_table("s")[0] == 2 and pool.length("s") == ids.shape[1]
    for layer in range(cfg.n_layers):
        K, V = pool.gather("s", layer)
        assert torch.equal(K.transpose(0, 1), flat.k[layer][0, :, :flat.length])
        assert torch.equal(V.transpose(0, 1), flat.v[layer][0, :, :flat.length])


# ----------------------------------------------------------------------------- 17.13 utilisation


def _busy_slot_steps(lengths, arrivals, B_max, static):
    """Brute force: a slot array stepped one step at a time; returns (busy slot-steps, steps)."""
    slots, left, busy, step = [None] * B_max, list(lengths), 0, 0
    waiting = sorted(range(len(lengths)), key=lambda i: (arrivals[i], i))
    while waiting or any(s is not None for s in slots):
        if not static or all(s is None for s in slots):
            for j in range(B_max):
                if slots[j] is None and waiting and arrivals[waiting[0]] <= step:
                    slots[j] = waiting.pop(0)
        for j, i in enumerate(slots):
            if i is not None:
                busy += 1
                left[i] -= 1
                if left[i] == 0:
                    slots[j] = None
        step += 1
    return busy, step


@pytest.mark.equation("17.13", oracle="slot-by-slot brute-force simulation counting busy slot-steps")
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_utilization_matches_a_brute_force_simulation(policy, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (50,), generator=g).tolist()
    arrivals = torch.randint(0, 200, (50,), generator=g).tolist() if seed else [0] * 50
    run = sv.simulate_batching(lengths, 8, arrivals, policy=policy)
    busy, steps = _busy_slot_steps(lengths, arrivals, 8, policy == "static")
    assert run.steps == steps and sum(run.occupancy) == busy == sum(lengths)
    U = sv.batching_utilization(lengths, 8, run.steps)
    assert math.isclose(U, busy / (8 * steps), rel_tol=1e-12)


@pytest.mark.equation("17.13", oracle="closed forms: static batching sums per-batch maxima; one slot is always busy")
def test_utilization_closed_forms():
    lengths = [3, 10, 4, 7, 5, 5, 1, 9]
    static = sv.simulate_batching(lengths, 4, policy="static")
    assert static.steps == max(lengths[:4]) + max(lengths[4:]) == 19
    assert sv.batching_utilization(lengths, 4, static.steps) == sum(lengths) / (4 * 19)
    cont = sv.simulate_batching(lengths, 4)
    assert cont.steps < static.steps
    assert sv.batching_utilization(lengths, 1, sv.simulate_batching(lengths, 1).steps) == 1.0
    with pytest.raises(ValueError, match="cannot come out"):
        sv.batching_utilization(lengths, 4, 5)
    with pytest.raises(TypeError):
        sv.batching_utilization(5, 4, 5)
