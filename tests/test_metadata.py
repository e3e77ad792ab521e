"""BatchMetadata and build_metadata: cu lens, slot formula, bucketing, page allocation, and every error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.core.metadata import BatchMetadata, bucket, build_metadata, cu_seqlens_from_lens

# (query_lens, context_lens): named scenarios, with empty and length-1 requests and awkward lengths.
SCENARIOS = {
    "decode_only": ([1, 1, 1, 1], [0, 15, 16, 130]),
    "prefill_only": ([17, 1, 64, 113], [0, 0, 0, 0]),
    "chunked_prefill": ([33, 7], [64, 5]),
    "verification": ([6, 6, 6], [0, 1, 239]),
    "mixed": ([1, 0, 37, 6, 1, 0], [200, 9, 0, 31, 0, 0]),
}


def slots_by_loop(md):
    """The slot formula, one token at a time."""
    slots = [-1] * md.num_tokens
    for i in range(md.num_seqs):
        for j in range(int(md.cu_query_lens[i + 1] - md.cu_query_lens[i])):
            pos = int(md.context_lens[i]) + j
            page = int(md.block_tables[i][pos // md.block_size])
            slots[int(md.cu_query_lens[i]) + j] = page * md.block_size + pos % md.block_size
    return slots


def test_cu_seqlens_from_lens():
    cu = cu_seqlens_from_lens([3, 0, 5, 1])
    assert cu.dtype == np.int32
    assert cu.tolist() == [0, 3, 3, 8, 9]
    assert cu_seqlens_from_lens([]).tolist() == [0]


def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 16, 17)] == [1, 1, 2, 4, 8, 16, 32]
    assert bucket(3, 16) == 16 and bucket(17, 16) == 32 and bucket(2, 5) == 8


@pytest.mark.parametrize("block_size", [1, 4, 16, 48, 544])  # pages of 48 and 544: not powers of two
@pytest.mark.parametrize("name", SCENARIOS)
def test_fields_and_slot_formula(name, block_size):
    query_lens, context_lens = SCENARIOS[name]
    md = build_metadata(query_lens, context_lens, block_size, seed=3)
    md.validate()
    q, c = np.array(query_lens), np.array(context_lens)
    assert md.cu_query_lens.tolist() == [0, *np.cumsum(q).tolist()]
    assert md.seq_lens.tolist() == (q + c).tolist()
    assert md.context_lens.tolist() == c.tolist()
    for field in ("cu_query_lens", "seq_lens", "context_lens", "block_tables", "slot_mapping"):
        assert getattr(md, field).dtype == np.int32, field
    assert md.slot_mapping.tolist() == slots_by_loop(md)
    assert md.slot_mapping.shape == (md.num_tokens,)
    assert (md.slot_mapping[q.sum():] == -1).all()
    assert md.num_seqs == len(q) and md.query_lens.tolist() == q.tolist()
    # Static maxima: powers of two bounding the batch (max_seq_len: or the table's capacity, which it never passes);
    # tables past each request's pages hold -1.
    for value in (md.num_tokens, md.max_query_len, md.max_blocks):
        assert value & (value - 1) == 0
    assert md.max_seq_len & (md.max_seq_len - 1) == 0 or md.max_seq_len == md.max_blocks * block_size
    assert md.num_tokens >= max(q.sum(), 16) and md.max_query_len >= q.max()
    assert (q + c).max() <= md.max_seq_len <= md.max_blocks * block_size
    for i, s in enumerate(q + c):
        assert (md.block_tables[i, -(-s // block_size):] == -1).all()


def test_docstring_example_unbucketed():
    md = build_metadata([3, 1], [0, 7], block_size=4, shuffle_pages=False, bucket=False)
    assert md.block_tables.tolist() == [[0, -1], [1, 2]]
    assert md.slot_mapping.tolist() == [0, 1, 2, 11]
    assert (md.num_tokens, md.max_query_len, md.max_seq_len) == (4, 3, 8)


@pytest.mark.parametrize("num_blocks", [None, 50])
def test_shuffled_pages_cover_each_request_exactly_once(num_blocks):
    query_lens, context_lens = SCENARIOS["mixed"]
    md = build_metadata(query_lens, context_lens, 8, num_blocks=num_blocks, seed=1)
    seq_lens = np.add(query_lens, context_lens)
    owned = np.concatenate([md.block_tables[i, : -(-s // 8)] for i, s in enumerate(seq_lens)])
    assert owned.size == sum(-(-s // 8) for s in seq_lens)
    assert np.unique(owned).size == owned.size  # no page shared between or within requests
    assert ((owned >= 0) & (owned < (num_blocks or owned.size))).all()
    if num_blocks is None:
        assert sorted(owned.tolist()) == list(range(owned.size))
    assert owned.tolist() != sorted(owned.tolist())  # shuffled: not an identity table
    unshuffled = build_metadata(query_lens, context_lens, 8, shuffle_pages=False)
    assert np.concatenate([unshuffled.block_tables[i, : -(-s // 8)] for i, s in enumerate(seq_lens)]).tolist() == (
        list(range(owned.size))
    )


def test_seed_changes_pages_deterministically():
    a = build_metadata([5, 9], [40, 3], 4, seed=0)
    b = build_metadata([5, 9], [40, 3], 4, seed=0)
    c = build_metadata([5, 9], [40, 3], 4, seed=1)
    assert (a.block_tables == b.block_tables).all() and (a.slot_mapping == b.slot_mapping).all()
    assert not (a.block_tables == c.block_tables).all()


def test_one_bucket_one_program():
    """Two batches of one bucket: same static fields, same shapes, one trace."""
    a = build_metadata([3, 1, 9], [10, 50, 0], 16, num_seqs=4)
    b = build_metadata([12, 2], [0, 33], 16, num_seqs=4, seed=5)
    static = lambda md: (md.block_size, md.max_query_len, md.max_seq_len, md.num_tokens)
    assert static(a) == static(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert [x.shape for x in jax.tree_util.tree_leaves(a)] == [x.shape for x in jax.tree_util.tree_leaves(b)]

    traces = []

    @jax.jit
    def total_slots(md):
        traces.append(1)
        assert isinstance(md.num_tokens, int) and isinstance(md.block_size, int)  # static under jit
        return jnp.sum(jnp.where(md.slot_mapping >= 0, 1, 0)) + md.num_tokens

    assert int(total_slots(a)) == 13 + a.num_tokens
    assert int(total_slots(b)) == 14 + b.num_tokens
    assert len(traces) == 1


def test_pytree_round_trip_keeps_static_fields():
    md = build_metadata([2], [3], 4)
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert len(leaves) == 5
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, BatchMetadata) and again.max_seq_len == md.max_seq_len
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.block_size = 8


def test_num_seqs_pads_with_empty_requests():
    md = build_metadata([4, 1], [0, 6], 4, num_seqs=4)
    md.validate()
    assert md.num_seqs == 4
    assert md.cu_query_lens.tolist() == [0, 4, 5, 5, 5]
    assert md.seq_lens.tolist() == [4, 7, 0, 0] and md.context_lens.tolist() == [0, 6, 0, 0]
    assert (md.block_tables[2:] == -1).all()


def test_explicit_sizes_are_used_as_given():
    md = build_metadata([3], [5], 4, num_tokens=21, max_blocks=5, num_blocks=40)
    md.validate()
    assert md.num_tokens == 21 and md.max_blocks == 5 and md.max_seq_len <= 20
    assert md.block_tables[0, :2].max() < 40


def test_explicit_block_tables():
    tables = np.array([[7, 2, 99], [4, -1, -1]])
    md = build_metadata([2, 3], [7, 0], 4, block_tables=tables, num_seqs=3)
    md.validate()
    assert md.block_tables.shape == (3, 4)  # width 3 bucketed to 4, one empty padding request
    assert md.block_tables[:2, :3].tolist() == tables.tolist()
    assert (md.block_tables[:, 3] == -1).all() and (md.block_tables[2] == -1).all()
    assert md.slot_mapping[:5].tolist() == [2 * 4 + 3, 99 * 4 + 0, 16, 17, 18]
    assert md.slot_mapping.tolist() == slots_by_loop(md)


# ------------------------------------------------------------------------------------------------------- errors
# One case per raise: (kwargs for build_metadata, words the message must contain).
ERRORS = {
    "negative_query_len": (dict(query_lens=[1, -2], context_lens=[0, 0]), ["query_lens", "non-negative", "-2"]),
    "negative_context_len": (dict(query_lens=[1], context_lens=[-1]), ["context_lens", "non-negative", "-1"]),
    "mismatched_lengths": (dict(query_lens=[1, 1], context_lens=[0]), ["query_lens", "context_lens", "2", "1"]),
    "query_lens_not_1d": (dict(query_lens=[[1]], context_lens=[0]), ["query_lens", "1-D", "(1, 1)"]),
    "context_lens_float": (dict(query_lens=[1], context_lens=[0.5]), ["context_lens", "integers", "float"]),
    "block_size_not_pow2": (dict(block_size=12), ["block_size=12", "power of two"]),
    "block_size_zero": (dict(block_size=0), ["block_size=0", "power of two"]),
    "block_size_not_int": (dict(block_size=16.0), ["block_size=16.0", "int"]),
    "block_size_not_multiple_of_16": (dict(block_size=40), ["block_size=40", "a multiple of 16 up to 1024"]),
    "block_size_past_1024": (dict(block_size=1040), ["block_size=1040", "a multiple of 16 up to 1024"]),
    "num_blocks_negative": (dict(num_blocks=-1), ["num_blocks=-1", "non-negative"]),
    "max_blocks_not_int": (dict(max_blocks=2.5), ["max_blocks=2.5", "int"]),
    "pool_too_small": (dict(num_blocks=3), ["num_blocks=3", "needs 4"]),
    "num_tokens_too_small": (dict(num_tokens=5), ["num_tokens=5", "sum(query_lens)=6"]),
    "num_seqs_too_small": (dict(num_seqs=1), ["num_seqs=1", "2 requests"]),
    "max_blocks_too_small": (dict(max_blocks=1), ["max_blocks=1", "2"]),
    "explicit_max_blocks_narrower_than_table": (
        dict(block_tables=[[0, 1, 5], [2, 3, 4]], max_blocks=2), ["max_blocks=2", "width of block_tables", "3"]),
    "tables_not_2d": (dict(block_tables=[0, 1, 2]), ["block_tables", "2-D", "(3,)"]),
    "tables_not_int": (dict(block_tables=[[0.0, 1.0], [2.0, 3.0]]), ["block_tables", "integers", "float"]),
    "tables_wrong_rows": (dict(block_tables=[[0, 1], [2, 3], [4, 5]]), ["block_tables", "3 rows", "2"]),
    "tables_too_short": (dict(block_tables=[[0], [2]]), ["block_tables", "1 columns", "request 0", "seq_len=6"]),
    "tables_negative_page": (dict(block_tables=[[0, -1], [2, 3]]), ["block_tables[0, :2]", "[0, -1]", ">= 0"]),
    "tables_page_past_pool": (
        dict(block_tables=[[0, 1], [9, 3]], num_blocks=4), ["block_tables[1, :2]", "num_blocks=4"]),
    "int32_overflow": (dict(block_tables=[[0, 1], [2**31 - 2, 3]]), ["int32", "block_size"]),
}
BASE = dict(query_lens=[5, 1], context_lens=[1, 4], block_size=4)  # seq_lens [6, 5]: 2 pages each


@pytest.mark.parametrize("name", ERRORS)
def test_errors_name_the_argument(name):
    kwargs, words = ERRORS[name]
    with pytest.raises(ValueError) as info:
        build_metadata(**{**BASE, **kwargs})
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_cu_seqlens_from_lens_rejects_negative():
    with pytest.raises(ValueError, match=r"lens must be non-negative, got lens\[1\]=-3"):
        cu_seqlens_from_lens([1, -3])


# Each corruption breaks one validity rule that `validate` checks.
CORRUPTIONS = {
    "shapes": (lambda md: dict(seq_lens=md.seq_lens[:1]), "inconsistent shapes"),
    "slot_mapping_shape": (lambda md: dict(slot_mapping=md.slot_mapping[:-1]), "slot_mapping has shape"),
    "cu_not_from_zero": (lambda md: dict(cu_query_lens=md.cu_query_lens + 1), "must start at 0"),
    "query_len_over_max": (lambda md: dict(max_query_len=2), "exceed md.max_query_len=2"),
    "seq_len_under_query_len": (lambda md: dict(seq_lens=np.array([0, 5], np.int32)), "seq_lens=[0, 5]"),
    "context_lens": (lambda md: dict(context_lens=md.context_lens + 1), "context_lens=[2, 5]"),
    "max_seq_len_past_table": (lambda md: dict(max_seq_len=64), "exceeds max_blocks * block_size"),
    "owned_page_negative": (lambda md: dict(block_tables=np.full_like(md.block_tables, -1)), "must be page ids"),
    "slot": (lambda md: dict(slot_mapping=np.where(np.arange(md.num_tokens) == 2, 0, md.slot_mapping)),
             "slot_mapping[2]"),
    "block_size": (lambda md: dict(block_size=3), "block_size=3"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_validate_catches(name):
    md = build_metadata(**BASE)
    change, words = CORRUPTIONS[name]
    with pytest.raises(ValueError) as info:
        dataclasses.replace(md, **change(md)).validate()
    assert words in str(info.value), str(info.value)


def test_segment_items_maps_slots_to_request_items():
    """Zero-count requests own no slot; slots past the last item are -1 (index 0)."""
    from pallas_attn.core.metadata import segment_items
    owner, index, cu = segment_items(jnp.asarray([2, 0, 3], jnp.int32), 7)
    assert np.asarray(owner).tolist() == [0, 0, 2, 2, 2, -1, -1]
    assert np.asarray(index).tolist() == [0, 1, 0, 1, 2, 0, 0]
    assert np.asarray(cu).tolist() == [0, 2, 2, 5]
