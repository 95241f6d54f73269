"""Decode lanes attend exactly as a gather from the page store would, while rows join, leave,
miss a step, outgrow the lanes' capacity and the buffer is rebuilt compact."""

import torch

from workers.decode_lanes import DecodeLanes

KVH, HEADS, DIM, LAYERS, SLOTS = 2, 4, 8, 2, 4096


def _reference(store_k, store_v, layer, query, slots_by_row):
    """Attention of each row's query over its context gathered from the store (GQA by repeat)."""
    outs = []
    for q, slots in zip(query, slots_by_row, strict=True):
        k = store_k[layer][slots].transpose(0, 1).repeat_interleave(HEADS // KVH, dim=0)
        v = store_v[layer][slots].transpose(0, 1).repeat_interleave(HEADS // KVH, dim=0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[:, None], k, v)[:, 0])
    return torch.stack(outs)


def test_lanes_match_a_gather_through_joins_leaves_growth_and_compaction():
    gen = torch.Generator().manual_seed(0)
    store_k = [torch.randn(SLOTS, KVH, DIM, generator=gen) for _ in range(LAYERS)]
    store_v = [torch.randn(SLOTS, KVH, DIM, generator=gen) for _ in range(LAYERS)]
    perm = torch.randperm(SLOTS, generator=gen)
    slots = {f"r{i}": perm[i * 200:(i + 1) * 200] for i in range(18)}  # each row's slots, scattered
    pos = {"r0": 5, "r1": 30, "r2": 1}
    lanes = DecodeLanes(LAYERS, KVH, DIM, torch.float32, torch.device("cpu"))
    # step -> rows joining (with their prompt length) / leaving
    joins = {3: {"r3": 100}, 4: {f"r{i}": 10 + i for i in range(4, 18)}, 9: {"r1": 20}}
    leaves = {2: ["r1"], 6: [f"r{i}" for i in range(2, 17)]}
    skipped = {5: "r0"}  # decodes not at all this step: its lane goes, then is refilled
    for step in range(12):
        pos.update(joins.get(step, {}))
        for rid in leaves.get(step, []):
            pos.pop(rid)
        rows = [(rid, p, slots[rid]) for rid, p in pos.items() if skipped.get(step) != rid]
        ls = lanes.prepare(rows, store_k, store_v)
        for layer in range(LAYERS):
            q = torch.randn(len(rows), HEADS, DIM, generator=gen)
            new_k = torch.randn(len(rows), KVH, DIM, generator=gen)
            new_v = torch.randn(len(rows), KVH, DIM, generator=gen)
            for i, (_rid, p, s) in enumerate(rows):  # the step's write into the page store
                store_k[layer][s[p]], store_v[layer][s[p]] = new_k[i], new_v[i]
            got = lanes.attend(layer, q, new_k, new_v, ls, None)
            want = _reference(store_k, store_v, layer, q, [s[:p + 1] for _r, p, s in rows])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for rid, _p, _s in rows:
            pos[rid] += 1
        if step == 4:  # r3 outgrew the first capacity (64): grown, earlier lanes kept
            assert lanes.capacity == 128 and len(lanes.owner) == 17
    assert len(lanes.owner) <= 2 * len(pos) + 8  # rebuilt compact after most rows left
    assert lanes.capacity >= max(pos.values())
