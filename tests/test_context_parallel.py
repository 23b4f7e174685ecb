"""Context parallelism in scaled_dot_product_attention: Ulysses, Ring and both, against torch's
attention on the same whole inputs, forward and backward: each result as close to the float64
computation as torch's own result in the same dtype, within a small factor (a ring sums its
blocks in another order, so it rounds differently, not worse)."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn.functional import SdpaOption
from dtorch.ops.context_parallel import _visible, zigzag
from dtorch.placement import chunk_range
from helpers import assert_within_torch_error

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
F = dtorch.nn.functional


def mesh_of(shape, names):
    n = 1
    for s in shape:
        n *= s
    return dtorch.DeviceMesh("cpu", torch.arange(n).view(shape).tolist(), mesh_dim_names=names)


@pytest.fixture(scope="session")
def meshes():
    """One mesh per layout, built once (names as the Llama's)."""
    return {
        "ring2": mesh_of((2,), ["ring_cp"]), "ring3": mesh_of((3,), ["ring_cp"]),
        "ring4": mesh_of((4,), ["ring_cp"]), "uly2": mesh_of((2,), ["ulysess_cp"]),
        "uly4": mesh_of((4,), ["ulysses_cp"]),
        "uly_ring": mesh_of((2, 2), ["ulysess_cp", "ring_cp"]),
        "ring_uly": mesh_of((2, 2), ["ring_cp", "ulysess_cp"]),
        "dp_tp_ring": mesh_of((2, 2, 2), ["dp", "tp", "ring_cp"]),
        "tp_uly_ring": mesh_of((2, 2, 2), ["tp", "ulysess_cp", "ring_cp"]),
        "tp": mesh_of((2,), ["tp"]),
    }


def inputs(n=2, hq=4, hk=4, length=8, e=8, s=None, ev=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s, ev = length if s is None else s, e if ev is None else ev
    return (torch.randn(n, hq, length, e, generator=g, dtype=dtype),
            torch.randn(n, hk, s, e, generator=g, dtype=dtype),
            torch.randn(n, hk, s, ev, generator=g, dtype=dtype))


def check(mesh, q_places, kv_places=None, *, causal=True, scale=None, hq=4, hk=4, length=8,
          s=None, ev=None, option=None, dtype=torch.float32):
    """The output and the gradients of query, key and value (the backward is the ring, or the
    exchanges, again) against the float64 attention of the whole inputs, bounded by torch's
    own error in ``dtype`` (``assert_within_torch_error``)."""
    gqa = hq != hk

    def attention(q, k, v, grad):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                               scale=scale, enable_gqa=gqa)
        out.backward(grad)
        return out.detach(), q.grad, k.grad, v.grad

    q, k, v = inputs(hq=hq, hk=hk, length=length, s=s, ev=ev, dtype=dtype)
    grad = torch.randn(q.shape[:-1] + v.shape[-1:],
                       generator=torch.Generator().manual_seed(1)).to(dtype)
    theirs = attention(q, k, v, grad)
    reference = attention(*(t.double() for t in (q, k, v, grad)))
    kv_places = q_places if kv_places is None else kv_places
    dq = dtorch.from_torch(q, device_mesh=mesh, placements=q_places)
    dk, dv = (dtorch.from_torch(t, device_mesh=mesh, placements=kv_places) for t in (k, v))
    for t in (dq, dk, dv):
        t.requires_grad_()
    out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, scale=scale,
                                         enable_gqa=gqa, sdpa_option=option)
    assert out.placements == list(q_places)
    out.backward(dtorch.from_torch(grad, device_mesh=mesh, placements=q_places))
    mine = (out, dq.grad, dk.grad, dv.grad)
    for name, m, t, r in zip(("output", "dq", "dk", "dv"), mine, theirs, reference):
        try:
            assert_within_torch_error(m, r, t)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


CASES = [  # mesh, query placements, key/value placements (None: the query's), length, heads
    ("ring2", [S2], None, 8, (4, 4)),
    ("ring2", [S2], None, 7, (4, 4)),
    ("ring3", [S2], None, 7, (4, 4)),
    ("ring3", [S2], None, 9, (4, 2)),
    ("ring4", [S2], None, 10, (4, 4)),
    ("ring4", [S2], None, 10, (4, 1)),
    ("uly2", [S2], None, 8, (4, 4)),
    ("uly2", [S2], None, 7, (4, 2)),  # GQA, key heads sharded
    ("uly4", [S2], None, 10, (8, 4)),
    ("uly4", [S2], None, 9, (8, 2)),  # GQA, 2 key heads over 4: repeated first
    ("uly_ring", [S2, S2], None, 8, (4, 4)),
    ("uly_ring", [S2, S2], None, 11, (4, 2)),
    ("ring_uly", [S2, S2], None, 8, (4, 4)),
    ("ring_uly", [S2, S2], None, 11, (4, 1)),
    ("dp_tp_ring", [S0, S1, S2], None, 7, (4, 4)),
    ("dp_tp_ring", [S0, S1, S2], None, 9, (4, 2)),  # GQA, key heads sharded on tp
    ("dp_tp_ring", [S0, S1, S2], [S0, R, S2], 9, (4, 2)),  # GQA, key heads whole on tp
    ("tp_uly_ring", [S1, S2, S2], None, 10, (8, 4)),
    ("tp_uly_ring", [S1, S2, S2], [R, S2, S2], 10, (8, 2)),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name, q_places, kv_places, length, heads", CASES)
def test_matches_torch(meshes, name, q_places, kv_places, length, heads, causal):
    check(meshes[name], q_places, kv_places, causal=causal, hq=heads[0], hk=heads[1],
          length=length)


def causal_work(q_pieces, k_blocks):
    """Query-key pairs a member scores (``_visible``'s parts: a triangle counts half)."""
    work = 0
    for q in q_pieces:
        for block in k_blocks:
            for k in block:
                for _, ql, _, kl, causal in _visible(q, k, True):
                    work += kl * (kl + 1) / 2 + (ql - kl) * kl if causal else ql * kl
    return work


@pytest.mark.parametrize("n, length", [(2, 64), (3, 100), (4, 66), (8, 1000)])
def test_causal_ring_balances_the_work(n, length):
    """Members r and n - 1 - r swap the second halves of their queries: every member scores
    about the same number of pairs (contiguous blocks: the last member about 2n - 1 times the
    first's; a few positions per half balance less: the halves are uneven), and all positions
    are still covered once."""
    blocks = [[chunk_range(length, n, i)] for i in range(n)]
    held = [blocks[r] if r == n - 1 - r else zigzag(blocks, r)[1] for r in range(n)]
    assert sorted(p for b in held for start, size in b for p in range(start, start + size)) \
        == list(range(length))
    balanced = [causal_work(h, blocks) for h in held]
    contiguous = [causal_work(b, blocks) for b in blocks]
    assert max(balanced) / min(balanced) < 1.1 < 2.5 < max(contiguous) / min(contiguous)


def test_scale(meshes):
    check(meshes["uly_ring"], [S2, S2], scale=0.3)
    check(meshes["ring3"], [S2], causal=False, scale=2.0, length=5)


def test_key_length_unlike_the_query(meshes):
    """A one-token query (a decode step: one device's block is empty) over a cache of 5, and a
    causal query shorter than its keys (torch's top-left triangle)."""
    check(meshes["ring2"], [S2], causal=False, length=1, s=5)
    check(meshes["ring3"], [S2], causal=True, length=4, s=9)
    check(meshes["uly_ring"], [S2, S2], causal=True, length=6, s=10)


def test_value_embedding_and_dtype(meshes):
    """A value embedding unlike the query's (the explicit-scores block kernel); bfloat16 (float32
    accumulators, rounded once)."""
    check(meshes["uly_ring"], [S2, S2], ev=5, length=9)
    check(meshes["ring3"], [S2], causal=False, ev=3)
    check(meshes["ring_uly"], [S2, S2], length=16, dtype=torch.bfloat16)


def test_option_names_the_dims(meshes):
    """An int names a dim of an unnamed mesh; None turns a dim off (the sequence whole there
    then, so the plain attention runs after the ordinary placement rule refuses S(2))."""
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2])
    check(mesh, [S2], option=SdpaOption(ulysess_cp_dim=None, ring_cp_dim=0), length=7)
    check(mesh, [S2], option=SdpaOption(ulysess_cp_dim=-1, ring_cp_dim=None), hq=3, hk=3)
    with pytest.raises(ValueError, match="no rule takes"):
        check(meshes["ring2"], [S2], option=SdpaOption(ring_cp_dim=None))


def test_replicate_sequence_on_a_cp_dim_is_plain_attention(meshes):
    check(meshes["dp_tp_ring"], [S0, S1, R], length=5)


def test_gqa_key_heads_sharded_without_cp(meshes):
    """Without CP too, GQA key heads may shard on tp where the blocks line up."""
    check(meshes["tp"], [S1], hq=4, hk=2)
    with pytest.raises(ValueError, match="do not line up"):
        check(meshes["tp"], [S1], hq=6, hk=3)


def test_input_failed_on_one_device(meshes):
    """A query block that failed upstream on one ring member only: that member still takes
    part in the ring and the Ulysses exchange (its peers would wait forever otherwise), every
    result is poisoned with the upstream error, and the runtime goes on. So for the backward:
    every member skips it together, and the gradient carries the upstream error."""
    mesh = meshes["ring_uly"]
    table = dtorch.from_torch(torch.randn(5, 8), device_mesh=mesh, placements=[R, R])
    table.requires_grad_()
    ids = torch.tensor([[[0, 1, 2, 3, 4, 0, 1, 2], [4, 3, 2, 1, 0, 4, 3, 9]]])
    ids = dtorch.from_torch(ids, device_mesh=mesh, placements=[S2, S2])  # 9: on the last device
    q = F.embedding(ids, table)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with pytest.raises(Exception, match="index out of range"):
        out.to_torch()
    out.sum().backward()
    with pytest.raises(Exception, match="dtorch.embedding failed.*index out of range"):
        table.grad.to_torch()
    check(mesh, [S2, S2], length=5)


def test_refusals_leave_the_runtime_usable(meshes):
    mesh = meshes["uly2"]
    q, k, v = inputs(hq=3, hk=3)
    dq = dtorch.from_torch(q, device_mesh=mesh, placements=[S2])
    with pytest.raises(ValueError, match=r"attention heads\(3, 3\) cannot be divided evenly by "
                                         r"ulysess_cp_size\(2\)"):
        F.scaled_dot_product_attention(dq, dq, dq)
    with pytest.raises(ValueError, match=r"a device holds \[1\] of them"):
        check(meshes["tp_uly_ring"], [S1, S2, S2], hq=2, hk=2)
    mesh = meshes["ring2"]
    q, k, v = inputs()
    dq, dk = (dtorch.from_torch(t, device_mesh=mesh, placements=[S2]) for t in (q, k))
    whole_v = dtorch.from_torch(v, device_mesh=mesh, placements=[R])
    mask = dtorch.from_torch(torch.ones(8, 8, dtype=torch.bool), device_mesh=mesh)
    with pytest.raises(ValueError, match=r"takes no attn_mask.*is_causal=True.*redistribute"):
        F.scaled_dot_product_attention(dq, dk, dk, attn_mask=mask)
    with pytest.raises(ValueError, match=r"value is \[Replicate\(\)\].*value = value\."
                                         r"redistribute\(placements=\[Shard\(dim=2\)\]\)"):
        F.scaled_dot_product_attention(dq, dk, whole_v)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        F.scaled_dot_product_attention(dq, dk, dk, dropout_p=0.1)
    dp_mesh = meshes["dp_tp_ring"]
    x = dtorch.from_torch(q, device_mesh=dp_mesh, placements=[S2, R, S2])
    with pytest.raises(ValueError, match=r"also sharded on mesh dim\(s\) \[0\]"):
        F.scaled_dot_product_attention(x, x, x)
    check(mesh, [S2], length=5)  # still usable
