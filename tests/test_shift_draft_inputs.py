"""Tests for pallas_kernels.shift_draft_inputs: reference vs a numpy loop, kernels vs reference.

Kernel tests run in interpret mode on any host and natively where the backend matches
(the base class skips elsewhere). Rejected verify rows are NaN (hidden) and -1 (tokens)
so any leak into the window fails the exact comparisons.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.shift_draft_inputs import (
    BACKEND_ENV_VAR,
    DROP_SLOT,
    BlockSizes,
    resolve_backend,
    shift_draft_inputs,
    shift_draft_inputs_reference,
)

PAGE_SIZE = 4
# Jitted once per shape: op-by-op dispatch would compile every jnp op separately.
reference = jax.jit(shift_draft_inputs_reference, static_argnames="page_size")


def numpy_shift(hist_t, hist_h, new_t, new_h, n_acc, anchor, tables, page_size, limit):
    """Independent per-element loop over the contract."""
    b, k = hist_t.shape
    limit = np.broadcast_to(limit, (b,))
    win_t = np.zeros((b, k + 1), hist_t.dtype)
    win_h = np.zeros((b, k + 1) + hist_h.shape[2:], hist_h.dtype)
    pos = np.zeros((b, k + 1), np.int32)
    slots = np.zeros((b, k + 1), np.int32)
    for i in range(b):
        for j in range(k + 1):
            src = n_acc[i] + j
            if src < k:
                win_t[i, j], win_h[i, j] = hist_t[i, src], hist_h[i, src]
            else:
                win_t[i, j], win_h[i, j] = new_t[i, src - k], new_h[i, src - k]
            p = anchor[i] - k + j
            pos[i, j] = p
            if 0 <= p < limit[i] and p < tables.shape[1] * page_size:
                slots[i, j] = tables[i, p // page_size] * page_size + p % page_size
            else:
                slots[i, j] = DROP_SLOT
    return win_t, win_h, pos, slots, win_t[:, 1:], win_h[:, 1:]


def make_case(k, d, dtype, seed=0, every_pair=True):
    """Requests for every n in 0..K, each anchored at a short prompt (negative positions),
    mid-sequence, or across the limit (a in {limit, limit+1}). every_pair: all (n, anchor kind)
    pairs; else each n once, kinds in turn, every kind at least once (the kernels copy by
    n only; the anchor-dependent outputs are the reference's jnp code, tested pair by pair)."""
    rng = np.random.default_rng(seed)
    num_pages = (4 * k + 8) // PAGE_SIZE + 1  # capacity leaves room for all three kinds
    if every_pair:
        pairs = [(n, kind) for n in range(k + 1) for kind in range(3)]
    else:
        pairs = [(n, n % 3) for n in range(k + 1)]
        pairs += [(k, kind) for kind in range(k + 1, 3)]  # K=1: add the limit kind
    n_acc, anchor, limit = [], [], []
    for n, kind in pairs:
        lim = int(rng.integers(3 * k + 4, num_pages * PAGE_SIZE + 1))
        length = (1, int(rng.integers(k + 2, lim - k)), lim - n + 1 + int(rng.integers(0, 2)))[kind]
        n_acc.append(n)
        anchor.append(length + n - 1)  # a = L + n - 1
        limit.append(lim)
    b = len(n_acc)
    n_acc = np.array(n_acc, np.int32)
    tables = rng.permutation(b * num_pages).reshape(b, num_pages).astype(np.int32)
    hist_t = rng.integers(0, 50_000, (b, k)).astype(np.int32)
    new_t = rng.integers(0, 50_000, (b, k + 1)).astype(np.int32)
    hist_h = rng.standard_normal((b, k, d)).astype(np.float32)
    new_h = rng.standard_normal((b, k + 1, d)).astype(np.float32)
    garbage = np.arange(k + 1)[None, :] > n_acc[:, None]  # rejected verify rows
    new_t[garbage] = -1
    new_h[garbage] = np.nan
    hist_h = np.asarray(jnp.asarray(hist_h, dtype))  # round to dtype once, numpy keeps it
    new_h = np.asarray(jnp.asarray(new_h, dtype))
    return (hist_t, hist_h, new_t, new_h, n_acc, np.array(anchor, np.int32), tables,
            np.array(limit, np.int32))


def assert_outputs_equal(got, want):
    names = ("tokens", "hidden", "positions", "slots", "next_tokens", "next_hidden")
    for name, g, w in zip(names, got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=name)  # exact: it is a copy


@pytest.mark.parametrize("k, dtype", [(1, jnp.float32), (2, jnp.float32), (3, jnp.bfloat16),
                                      (5, jnp.float32), (7, jnp.bfloat16)])
def test_reference_matches_numpy_loop(k, dtype):
    *args, limit = make_case(k, 16, dtype, seed=k)
    want = numpy_shift(*args, PAGE_SIZE, limit)
    got = reference(*args, page_size=PAGE_SIZE, limit=limit)
    assert_outputs_equal(got, want)
    pos, slots = want[2], want[3]
    assert (slots == DROP_SLOT).any() and (pos < 0).any() and (pos >= limit[:, None]).any()


def test_reference_scalar_limit_and_table_end():
    *args, _ = make_case(3, 8, jnp.float32, seed=1)
    limit = 10**6  # beyond the table: the table end drops instead
    want = numpy_shift(*args, PAGE_SIZE, np.int32(limit))
    got = reference(*args, page_size=PAGE_SIZE, limit=limit)
    assert_outputs_equal(got, want)


def test_window_follows_committed_positions_over_steps():
    """Drive the carry for several steps: the window is always h(a-K .. a)."""
    k, d, b = 3, 8, 4
    rng = np.random.default_rng(7)
    hidden_of = lambda p: np.repeat((np.asarray(p, np.float32) + 0.5)[..., None], d, axis=-1)
    token_of = lambda p: 1000 + np.asarray(p, np.int32)
    length = np.array([1, 2, 5, 9])  # committed lengths L
    hist_pos = length[:, None] - k - 1 + np.arange(k)  # carry positions L-K-1 .. L-2
    hist_t, hist_h = token_of(hist_pos), hidden_of(hist_pos)
    tables = np.arange(b * 16, dtype=np.int32).reshape(b, 16)
    step = jax.jit(functools.partial(shift_draft_inputs, page_size=PAGE_SIZE, limit=64,
                                     backend="reference"))
    for _ in range(6):
        n = rng.integers(0, k + 1, b).astype(np.int32)
        verify_pos = length[:, None] - 1 + np.arange(k + 1)
        ok = np.arange(k + 1)[None] <= n[:, None]
        new_t = np.where(ok, token_of(verify_pos), -1)
        new_h = np.where(ok[..., None], hidden_of(verify_pos), np.nan)
        anchor = (length + n - 1).astype(np.int32)
        win_t, win_h, pos, _, hist_t, hist_h = step(hist_t, hist_h, new_t, new_h, n, anchor, tables)
        np.testing.assert_array_equal(pos, anchor[:, None] - k + np.arange(k + 1))
        np.testing.assert_array_equal(win_t, token_of(pos))
        np.testing.assert_array_equal(win_h, hidden_of(pos))
        length = length + n + 1


class ShiftKernelTest:
    """Kernel vs reference. Subclasses set BACKEND; INTERPRET=False runs natively."""

    BACKEND = "gpu"
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and jax.default_backend() != self.BACKEND:
            pytest.skip(f"needs a {self.BACKEND} device (interpret subclass runs anywhere)")

    def shift(self, hist_t, hist_h, new_t, new_h, n, anchor, tables, limit, **kwargs):
        """The op as the decode step calls it: inside an outer jit, limit traced."""

        @jax.jit
        def step(hist_t, hist_h, new_t, new_h, n, anchor, tables, limit):
            return shift_draft_inputs(hist_t, hist_h, new_t, new_h, n, anchor, tables,
                                      page_size=PAGE_SIZE, limit=limit, backend=self.BACKEND,
                                      interpret=self.INTERPRET, **kwargs)

        return step(hist_t, hist_h, new_t, new_h, n, anchor, tables, limit)

    @pytest.mark.parametrize("k", [1, 2, 3, 5])
    @pytest.mark.parametrize("d", [128, 256])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_matches_reference(self, k, d, dtype):
        *args, limit = make_case(k, d, dtype, seed=10 * k + d, every_pair=False)
        want = reference(*args, page_size=PAGE_SIZE, limit=limit)
        assert (want[2] < 0).any() and (want[2] >= limit[:, None]).any()  # both drop kinds
        # block_d=128 splits D=256 into two blocks per request.
        got = self.shift(*args, limit, block_sizes=BlockSizes(block_d=128))
        assert_outputs_equal(got, want)


class TestShiftGpu(ShiftKernelTest):
    BACKEND = "gpu"


class TestShiftGpuInterpret(TestShiftGpu):
    INTERPRET = True


class TestShiftTpu(ShiftKernelTest):
    BACKEND = "tpu"


class TestShiftTpuInterpret(TestShiftTpu):
    INTERPRET = True


def test_dispatch(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    default = {"cpu": "reference"}.get(jax.default_backend(), jax.default_backend())
    assert resolve_backend(None) == default
    monkeypatch.setenv(BACKEND_ENV_VAR, "tpu")
    assert resolve_backend(None) == "tpu"
    assert resolve_backend("reference") == "reference"  # an explicit argument wins
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("cuda-graph")

    *args, limit = make_case(1, 128, jnp.float32)
    run = lambda **kw: shift_draft_inputs(*args, page_size=PAGE_SIZE, limit=limit, **kw)
    assert "pallas_call" in str(jax.make_jaxpr(lambda: run(interpret=True))())  # env: tpu
    assert "pallas_call" not in str(jax.make_jaxpr(lambda: run(backend="reference"))())


def test_shape_errors():
    hist_t, hist_h, new_t, new_h, n, anchor, tables, limit = make_case(2, 128, jnp.float32)
    with pytest.raises(ValueError, match="new_hidden"):
        shift_draft_inputs_reference(hist_t, hist_h, new_t, new_h[:, :2], n, anchor, tables,
                                     page_size=PAGE_SIZE, limit=limit)
    with pytest.raises(ValueError, match="dtypes differ"):
        shift_draft_inputs_reference(hist_t, hist_h, new_t, new_h.astype(np.float16), n, anchor,
                                     tables, page_size=PAGE_SIZE, limit=limit)


def test_block_sizes():
    with pytest.raises(ValueError):
        BlockSizes(block_d=96)
    with pytest.raises(ValueError):
        BlockSizes(num_warps=3)
    bs = BlockSizes(block_d=2048)
    assert bs.gpu_block_d(8192) == 2048 and bs.gpu_block_d(2880) == 64
    assert bs.tpu_block_d(3584) == 1792 and bs.tpu_block_d(2880) == 2880
    assert bs.tpu_block_d(128) == 128
