"""Sub-split Shards (``Shard(d, sub_split=...)``): what ``cat`` along a sharded dim makes, checked
against plain torch on 1-d and 2-d meshes with uneven segments: the blocks each device holds,
the ops that keep it, the cuts back into plain shards, redistribute to and from every placement,
context-parallel attention on it, and the errors that name the fix. Also: a Shard on a mesh dim
of one device reads back as Replicate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from helpers import assert_close, distribute, fixture_settings, sample
from hypothesis import given
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.placement import decode_placement, encode_placement, local_pieces, normalize_layout

R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
F = dtorch.nn.functional


def blocks_by_hand(t: torch.Tensor, dim: int, segments, parts: int) -> list:
    """Each device's block of a 1-d sub-split, the definition written out: its array_split
    chunk of every segment, joined."""
    pieces = [torch.tensor_split(s, parts, dim) for s in t.split(list(segments), dim)]
    return [torch.cat([p[j] for p in pieces], dim) for j in range(parts)]


# -- the placement as a value ---------------------------------------------------------------------


@pytest.mark.no_runtime
def test_value_semantics():
    a = Shard(2, sub_split=(512, 128))
    assert a == Shard(2, [512, 0, 128]) and hash(a) == hash(Shard(2, (512, 128)))
    assert a != Shard(2) and a != Shard(2, (128, 512)) and a.is_shard(2) and a.is_shard()
    assert a.has_sub_split_coordinates() and a.get_sub_split_coordinates() == (512, 128)
    assert not Shard(2).has_sub_split_coordinates() and R.get_sub_split_coordinates() is None
    assert str(a) == "S(2)[512,128]" and repr(a) == "Shard(dim=2, sub_split=(512, 128))"
    assert eval(repr(a)) == a and Shard(0, (5,)) == Shard(0) and repr(Shard(0)) == "Shard(dim=0)"
    for p in (a, Shard(0), R, P, Partial("max")):
        assert decode_placement(encode_placement(p)) == p


@pytest.mark.no_runtime
def test_bad_sub_splits_raise():
    with pytest.raises(ValueError, match="negative"):
        Shard(0, (3, -1))
    with pytest.raises(TypeError, match="segment sizes"):
        Shard(0, 5)
    with pytest.raises(TypeError, match="must be int"):
        Shard(0, (2.5, 1))
    with pytest.raises(ValueError, match="add up to"):
        normalize_layout((9,), (2,), (Shard(0, (5, 3)),))
    with pytest.raises(ValueError, match="same sub-split"):
        normalize_layout((9, 4), (2, 2), (Shard(0, (5, 4)), Shard(0)))


@pytest.mark.no_runtime
def test_local_pieces_nest_each_segment_over_the_mesh_dims():
    # 11 = segments 7 + 4 over a 2x2 mesh, both mesh dims sharding the dim
    split = Shard(0, (7, 4))
    got = {c: local_pieces((11,), (2, 2), (split, split), c)[0]
           for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert got == {(0, 0): ((0, 2), (7, 1)), (0, 1): ((2, 2), (8, 1)),
                   (1, 0): ((4, 2), (9, 1)), (1, 1): ((6, 1), (10, 1))}
    # empty pieces (a segment smaller than the mesh dim) are left out
    assert local_pieces((4,), (3,), (Shard(0, (1, 3)),), (2,)) == (((3, 1),),)
    # a Shard on a mesh dim of one device is Replicate
    assert normalize_layout((4, 6), (1, 2), (S0, Shard(1, (2, 4)))) == (R, Shard(1, (2, 4)))


@pytest.mark.no_runtime
def test_rows_carry_it_only_to_dims_of_its_extent():
    from dtorch.ops.registry import lookup
    from dtorch.ops.rules import Call, Placed, check_sub_splits, expand
    from dtorch.spec import MeshInfo, intern_spec

    mesh = MeshInfo("cpu", (2,), (0, 1))
    x = intern_spec((8, 3), "float32", mesh, (Shard(0, (5, 3)),))
    row = [((S0,), (S0,))]
    same = Call(lookup("neg"), (x,), {}, [((8, 3), torch.float32)], mesh)
    assert expand(same, row).outs == ((Shard(0, (5, 3)),),)
    longer = Call(lookup("neg"), (x,), {}, [((16, 3), torch.float32)], mesh)
    with pytest.raises(ValueError, match="no rule takes"):
        expand(longer, row)
    # a rule result that reads it as a plain Shard is refused, naming the fix
    with pytest.raises(ValueError, match=r"input = input\.redistribute\(placements=\[Shard\("
                                         r"dim=0\)\]\)"):
        check_sub_splits(same, Placed(((S0,),)))
    check_sub_splits(same, Placed(((P,),)))  # every device's positions, reduced after


# -- blocks, creation, reading back ---------------------------------------------------------------


@pytest.mark.parametrize("segments", [(6, 4), (5, 5), (7, 2, 3)], ids=str)
def test_from_torch_blocks_are_each_devices_piece_of_every_segment(mesh1, segments):
    t = sample((sum(segments), 3))
    x = dtorch.from_torch(t, device_mesh=mesh1, placements=[Shard(0, segments)])
    assert x.placements == [Shard(0, segments)]
    assert_close(x, t, exact=True)
    blocks = blocks_by_hand(t, 0, segments, 3)
    if [b.shape[0] for b in blocks] == [b.shape[0] for b in t.tensor_split(3)]:
        # the blocks themselves, read as a plain Shard's (DTorch's relabel)
        assert_close(x.view([S0]), torch.cat(blocks), exact=True)


def test_two_mesh_dims_on_one_dim(mesh2):
    t = sample((11, 2))
    x = dtorch.from_torch(t, device_mesh=mesh2, placements=[Shard(0, (7, 4))] * 2)
    assert_close(x, t, exact=True)
    order = [0, 1, 7, 2, 3, 8, 4, 5, 9, 6, 10]  # the pieces of test_local_pieces_nest_...
    assert_close(x.view([S0, S0]), t[order], exact=True)


# -- cat makes it ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(5, 3), (4, 4, 7), (1, 6)], ids=str)
def test_cat_along_the_sharded_dim(mesh1, sizes):
    ts = [sample((2, n, 3), seed=n) for n in sizes]
    xs = [dtorch.from_torch(t, device_mesh=mesh1, placements=[S1]) for t in ts]
    y = dtorch.cat(xs, dim=1)
    assert y.placements == [Shard(1, sizes)]
    assert_close(y, torch.cat(ts, 1), exact=True)
    # a sub-split input brings its own segments
    z = dtorch.cat([y, xs[0]], dim=-2)
    assert z.placements == [Shard(1, sizes + sizes[:1])]
    assert_close(z, torch.cat(ts + ts[:1], 1), exact=True)


def test_cat_on_2d_meshes(mesh2):
    a, b = sample((4, 9, 2)), sample((4, 5, 2), seed=1)
    for placements in ([S1, S1], [S0, S1], [S1, R]):
        x, y = (dtorch.from_torch(t, device_mesh=mesh2, placements=placements) for t in (a, b))
        z = dtorch.cat([x, y], 1)
        assert z.placements == [Shard(1, (9, 5)) if p == S1 else p for p in placements]
        assert_close(z, torch.cat([a, b], 1), exact=True)
        assert_close(z + z, 2 * torch.cat([a, b], 1), exact=True)


def test_cat_along_another_dim_keeps_it(mesh1):
    a, b = sample((3, 8)), sample((2, 8), seed=1)
    x = dtorch.cat([dtorch.from_torch(a[:, :5], device_mesh=mesh1, placements=[S1]),
                    dtorch.from_torch(a[:, 5:], device_mesh=mesh1, placements=[S1])], 1)
    y = dtorch.cat([dtorch.from_torch(b[:, :5], device_mesh=mesh1, placements=[S1]),
                    dtorch.from_torch(b[:, 5:], device_mesh=mesh1, placements=[S1])], 1)
    z = dtorch.cat([x, y], 0)
    assert z.placements == [Shard(1, (5, 3))]
    assert_close(z, torch.cat([a, b]), exact=True)


def test_cat_of_sharded_and_replicate_is_refused(mesh1):
    x = dtorch.from_torch(sample((4, 2)), device_mesh=mesh1, placements=[S0])
    y = dtorch.from_torch(sample((4, 2)), device_mesh=mesh1, placements=[R])
    with pytest.raises(ValueError, match=r"redistribute\("):
        dtorch.cat([x, y])


# -- ops on it ------------------------------------------------------------------------------------


def joined(mesh, placements, sizes=(5, 3), rest=(2, 4), dim=1):
    """A sub-split tensor made by cat, and its torch value."""
    ts = [sample(rest[:dim] + (n,) + rest[dim:], seed=n) for n in sizes]
    xs = [dtorch.from_torch(t, device_mesh=mesh, placements=placements) for t in ts]
    return dtorch.cat(xs, dim), torch.cat(ts, dim)


def test_elementwise_and_broadcast(mesh1, mesh2):
    for mesh, placements in ((mesh1, [S1]), (mesh2, [S1, S1]), (mesh2, [S0, S1])):
        x, t = joined(mesh, placements)
        split = x.placements
        assert_close(x * 3 - x.exp(), t * 3 - t.exp())
        # a Replicate operand is cut to the sub-split locally (its broadcast dims stay whole)
        for u in (sample((8, 4), seed=7), sample((1, 8, 1), seed=8)):
            r = dtorch.from_torch(u, device_mesh=mesh, placements=[R] * mesh.ndim)
            assert (x * r).placements == split
            assert_close(x * r, t * u)
            assert_close(r - x, u - t)
        assert_close(dtorch.where(x > 0, x, 2 * x), torch.where(t > 0, t, 2 * t))
        assert x.float().to(torch.float64).placements == split


def test_ops_on_other_dims_keep_it(mesh2):
    x, t = joined(mesh2, [S0, S1], rest=(2, 6))
    assert x.placements == [S0, Shard(1, (5, 3))]
    assert (x.transpose(1, 2)).placements == [S0, Shard(2, (5, 3))]
    assert_close(x.transpose(1, 2), t.transpose(1, 2), exact=True)
    y = x.reshape(2, 8, 3, 2)
    assert y.placements == [S0, Shard(1, (5, 3))]
    assert_close(y, t.reshape(2, 8, 3, 2), exact=True)
    assert x.sum(-1).placements == [S0, Shard(1, (5, 3))]
    assert_close(x.sum(-1), t.sum(-1))
    assert_close(x.softmax(-1), t.softmax(-1))
    w = sample((6, 3), seed=3)
    lin = dtorch.from_torch(w, device_mesh=mesh2, placements=[R, R])
    assert_close(x @ lin, t @ w)
    # reduced over the sub-split dim: each device's positions, then the reduction
    assert_close(x.sum(1), t.sum(1))
    assert_close(x.amax(1), t.amax(1))


def test_a_plain_shard_beside_it_is_refused_with_the_fix(mesh1):
    x, t = joined(mesh1, [S1])
    y = dtorch.from_torch(t, device_mesh=mesh1, placements=[S1])
    with pytest.raises(ValueError, match=r"input = input\.redistribute\(placements=\[Shard\(dim=1\)\]\)"):
        x + y
    assert_close(x.redistribute(placements=[S1]) + y, 2 * t)
    with pytest.raises(ValueError, match="redistribute"):
        x.reshape(2, 32)  # merges the sub-split dim with another
    with pytest.raises(ValueError, match="redistribute"):
        x.cumsum(1)



def test_ops_that_read_their_blocks_position_are_refused_at_the_call(mesh1):
    """tril's diagonal and a vocabulary shard's rows depend on where a block starts: a sub-split
    block starts in several places, so the call is refused (not a failure on the devices)."""
    x, t = joined(mesh1, [S1])
    with pytest.raises(ValueError, match=r"dtorch\.tril\b.*redistribute"):
        x.tril()
    assert_close(x.redistribute(placements=[S1]).tril(), t.tril())
    ids = dtorch.from_torch(torch.zeros(2, dtype=torch.long))
    weight = dtorch.cat([dtorch.from_torch(sample((4, 3)), device_mesh=mesh1, placements=[S0])] * 2)
    with pytest.raises(ValueError, match=r"vocab_parallel_embedding\b.*redistribute"):
        dtorch.nn.functional.vocab_parallel_embedding(ids.redistribute(device_mesh=mesh1), weight)


def test_dropout_of_a_sub_split_draws_each_block_on_its_own(mesh1):
    x, _ = joined(mesh1, [S1], sizes=(4, 4))  # device 0 holds dim 1's [0:2] and [4:6], 1 the rest
    out = dtorch.nn.functional.dropout(dtorch.ones_like(x), 0.5).to_torch()
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    first = torch.cat([out[:, 0:2], out[:, 4:6]], 1)
    second = torch.cat([out[:, 2:4], out[:, 6:8]], 1)
    assert not torch.equal(first, second)  # not one seed for both blocks

# -- cutting it back ------------------------------------------------------------------------------


def test_slices_split_and_chunk_give_back_the_inputs(mesh1, mesh2):
    for mesh, placements in ((mesh1, [S1]), (mesh2, [S1, S1]), (mesh2, [P, S1])):
        x, t = joined(mesh, placements, sizes=(7, 4))
        head, tail = x[:, :7], x[:, 7:]
        assert head.placements == tail.placements == placements
        assert_close(head, t[:, :7])
        assert_close(tail, t[..., 7:, :])
        parts = x.split([7, 4], 1)
        assert [p.placements for p in parts] == [placements] * 2
        assert_close(parts, t.split([7, 4], 1))
    x, t = joined(mesh1, [S1], sizes=(4, 4))
    assert [p.placements for p in x.chunk(2, 1)] == [[S1], [S1]]
    assert_close(x.chunk(2, dim=1), t.chunk(2, 1))
    x, t = joined(mesh1, [S1], sizes=(2, 3, 4))
    assert x[:, 2:].placements == [Shard(1, (3, 4))]
    assert_close(x[:, 2:], t[:, 2:])


def test_cuts_across_segments_are_refused(mesh1):
    x, _ = joined(mesh1, [S1], sizes=(7, 4))
    with pytest.raises(ValueError, match=r"redistribute\("):
        x[:, :5]
    with pytest.raises(ValueError, match=r"redistribute\("):
        x.chunk(2, 1)


# -- redistribute ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [[R], [S0], [S1], [P], [Shard(1, (2, 9))]], ids=str)
def test_redistribute_1d(mesh1, target):
    t = sample((4, 11))
    x = dtorch.from_torch(t, device_mesh=mesh1, placements=[Shard(1, (7, 4))])
    y = x.redistribute(placements=target)
    assert y.placements == target
    assert_close(y, t, exact=target != [P])
    back = y.redistribute(placements=[Shard(1, (7, 4))])
    assert back.placements == [Shard(1, (7, 4))]
    assert_close(back, t)


@pytest.mark.parametrize("target", [[R, R], [S1, S1], [S0, R], [Shard(1, (7, 4)), R],
                                    [R, Shard(1, (7, 4))], [P, Shard(1, (3, 8))]], ids=str)
def test_redistribute_2d(mesh2, target):
    t = sample((5, 11))
    for src in ([Shard(1, (7, 4))] * 2, [S0, Shard(1, (7, 4))]):
        x = distribute(t, mesh2, src)
        y = x.redistribute(placements=target)
        assert y.placements == target
        assert_close(y, t)
        assert_close(y.redistribute(placements=src), t)
        z = distribute(t, mesh2, target).redistribute(placements=src)
        assert z.placements == src
        assert_close(z, t)


# -- context-parallel attention -------------------------------------------------------------------


def joint_inputs(seed=0, lengths=(11, 5)):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(2, 4, n, 8, generator=g) for n in lengths] for _ in range(3)]


@pytest.mark.parametrize("names,shape", [(["ulysess_cp"], (2,)), (["ring_cp"], (3,)),
                                         (["ulysess_cp", "ring_cp"], (2, 2))], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_joint_attention_under_context_parallelism(names, shape, causal):
    """Text and image tokens joined along the sequence under CP, attended together, split."""
    mesh = dtorch.init_device_mesh("cpu", shape, mesh_dim_names=names)
    q, k, v = joint_inputs()
    want = TF.scaled_dot_product_attention(*(torch.cat(x, 2) for x in (q, k, v)),
                                           is_causal=causal)
    placed = [S2] * len(shape)
    q, k, v = (dtorch.cat([dtorch.from_torch(t, device_mesh=mesh, placements=placed)
                           for t in x], dim=2) for x in (q, k, v))
    assert q.placements == [Shard(2, (11, 5))] * len(shape)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.placements == q.placements
    assert_close(out, want)
    assert_close(out[:, :, :11], want[:, :, :11])
    assert_close(out[:, :, 11:].transpose(1, 2).reshape(2, 5, 32),
                 want[:, :, 11:].transpose(1, 2).reshape(2, 5, 32))


def test_attention_with_different_sub_splits_in_query_and_key():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ring_cp"])
    (q1, q2), (k1, k2), (v1, v2) = joint_inputs(1, lengths=(6, 3))
    q = dtorch.cat([dtorch.from_torch(t, device_mesh=mesh, placements=[S2]) for t in (q1, q2)], 2)
    k = dtorch.from_torch(torch.cat([k1, k2], 2), device_mesh=mesh, placements=[S2])
    v = dtorch.from_torch(torch.cat([v1, v2], 2), device_mesh=mesh, placements=[S2])
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.placements == q.placements
    assert_close(out, TF.scaled_dot_product_attention(torch.cat([q1, q2], 2), torch.cat(
        [k1, k2], 2), torch.cat([v1, v2], 2), is_causal=True))


# -- a Shard on a mesh dim of one device ----------------------------------------------------------


def test_shard_on_a_one_device_mesh_dim_is_replicate():
    mesh = dtorch.init_device_mesh("cpu", (2, 1, 1))
    assert dtorch.empty((3, 4), device_mesh=mesh, placements=[R, S1, R]).placements == [R] * 3
    t = sample((4, 6))
    x = dtorch.from_torch(t, device_mesh=mesh, placements=[S0, S1, Shard(0, (1, 3))])
    assert x.placements == [S0, R, R]
    assert_close(x, t, exact=True)
    y = x.redistribute(placements=[R, S0, R])
    assert y.placements == [R, R, R]
    assert_close(y, t, exact=True)
    assert x.redistribute(placements=[S0, S0, R]) is x  # the same layout: nothing to do
    named = dtorch.init_device_mesh("cpu", (2, 1), mesh_dim_names=["dp", "cp"])
    z = dtorch.from_torch(t, device_mesh=named, placements=[R, R])
    z = z.redistribute_by_dict(named, {"dp": S0, "cp": S1})
    assert z.placements == [S0, R]
    assert_close(z, t, exact=True)


def test_attention_sharded_on_a_one_device_cp_dim():
    """tp2 x ulysses2 x ring1: the sequence's Shard on the ring dim of one device is
    Replicate, and attention runs Ulysses alone."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=["tp", "ulysess_cp",
                                                                    "ring_cp"])
    (q, _), (k, _), (v, _) = joint_inputs(2)
    xs = [dtorch.from_torch(t, device_mesh=mesh, placements=[Shard(1), S2, S2])
          for t in (q, k, v)]
    assert xs[0].placements == [Shard(1), S2, R]
    for causal in (False, True):
        out = F.scaled_dot_product_attention(*xs, is_causal=causal)
        assert out.placements == [Shard(1), S2, R]
        assert_close(out, TF.scaled_dot_product_attention(q, k, v, is_causal=causal))


# -- plans and a property over layouts ------------------------------------------------------------


@pytest.mark.no_runtime
def test_plans_go_through_replicate():
    from dtorch.redistribute import plan_redistribute

    split = Shard(0, (3, 2))

    def kinds(src, dst):
        return [s.kind for s in plan_redistribute(tuple(src), tuple(dst))]

    assert kinds([split], [S1]) == ["all_gather", "chunk"]
    assert kinds([split], [S0]) == ["all_gather", "chunk"]
    assert kinds([P], [split]) == ["all_reduce", "chunk"]
    assert kinds([split], [P]) == ["all_gather", "partition"]
    assert kinds([split, split], [S0, S0]) == ["all_gather", "all_gather", "chunk", "chunk"]
    assert kinds([S1, R], [S1, split]) == ["chunk"]  # another tensor dim: no conflict


layouts = st.sampled_from([
    ("mesh1", lambda s: [s]), ("mesh2", lambda s: [s, s]), ("mesh2", lambda s: [S1, s]),
    ("mesh2", lambda s: [s, R]), ("mesh2", lambda s: [P, s]), ("mesh3", lambda s: [s, S1, s]),
])


@given(data=st.data())
@fixture_settings(max_examples=25)
def test_any_sub_split_round_trips(request, data):
    """from_torch, to_torch, an elementwise op and a redistribute to a random layout and back,
    for random segments (empty pieces included: segments smaller than the mesh dim)."""
    segments = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=4), label="segments")
    mesh_name, make = data.draw(layouts, label="layout")
    mesh = request.getfixturevalue(mesh_name)
    t = sample((sum(segments), 3), seed=len(segments))
    src = make(Shard(0, segments))
    x = distribute(t, mesh, src)
    assert x.placements == src
    assert_close(x * 2, t * 2)
    choices = [R, S0, S1, P, Shard(0, segments[::-1])]
    dst = [data.draw(st.sampled_from(choices), label=f"mesh dim {i}") for i in range(mesh.ndim)]
    if len({p.sub_split for p in dst if p.is_shard(0)}) > 1:
        dst = [R if p.is_shard(0) else p for p in dst]
    y = x.redistribute(placements=dst)
    assert_close(y, t)
    assert_close(y.redistribute(placements=src), t)
