"""Mosaic GPU (Hopper) kernel for the SwiGLU gate+up product: silu(x @ W_gate) * (x @ W_up).

Layouts: x [M, K]; w [K, 2F], the model's [K, 2, F] gate_up with its middle axis merged
(columns 0..F-1 gate, F..2F-1 up); out [M, F] in x.dtype.

One CTA computes one [block_m, block_n] output tile, persistent over the SMs: tile t runs
M blocks fastest (t % m_blocks), so the CTAs of a wave share the same weight columns and
each weight tile comes from DRAM about once. Three warpgroups: a memory warpgroup issues
TMA loads of the x block [block_m, block_k] and the gate and up blocks [block_k, block_n]
into a ring of `stages` shared-memory slots; two compute warpgroups each own block_m / 2
rows and keep two f32 wgmma accumulators, gate and up [block_m / 2, block_n] (64 + 64
registers a thread at the default 128 x 128 tile). The epilogue rounds both to x.dtype
(the value the model's einsum hands to its SwiGLU), computes silu(g) * u in f32
(with Step-3.5's clamp when `limit` is set), rounds once, and stores the tile through
shared memory with a TMA copy. The [M, 2F] product is never written to memory and the
SwiGLU is no kernel of its own.

Shapes the kernel takes: M % block_m == 0, K % block_k == 0, F % block_n == 0; the
wrapper in swiglu_matmul.py sends anything else to the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import check_positive_ints, swiglu


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiling of one call.

  block_m: rows of x per tile; the two compute warpgroups take block_m / 2 each (a
           multiple of 64, wgmma's row count).
  block_n: output columns per tile (each of gate and up); a multiple of 64.
  block_k: contraction chunk per pipeline stage; 64 bf16 = one 128-byte swizzle row.
  stages:  shared-memory slots in the TMA ring.
  mma_in_flight: wgmma groups left running when a K chunk's body returns (0 or 1); with
           1 a slot is released one chunk later, so the tensor cores need not drain
           between chunks.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  mma_in_flight: int = 0

  def __post_init__(self):
    check_positive_ints(self, skip=("mma_in_flight",))
    if self.mma_in_flight not in (0, 1) or self.mma_in_flight >= self.stages:
      raise ValueError(f"{self}: mma_in_flight must be 0 or 1, and below stages.")
    if self.block_m % 128 or self.block_n % 64 or self.block_k % 16:
      raise ValueError(f"{self} needs block_m % 128 == 0 (two warpgroups of 64-row "
                       "wgmma), block_n % 64 == 0 and block_k % 16 == 0.")


def smem_bytes(block: BlockConfig, itemsize: int) -> int:
  """Shared memory the kernel allocates: the TMA ring (x, gate and up blocks per slot)
  and the output tile of each compute warpgroup."""
  ring = block.stages * (block.block_m * block.block_k + 2 * block.block_k * block.block_n)
  return (ring + block.block_m * block.block_n) * itemsize


def _transforms(minor_elems: int, itemsize: int):
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _swiglu_matmul_kernel(x_gmem, w_gmem, o_gmem, *, block: BlockConfig, limit):
  m, k = x_gmem.shape
  f = o_gmem.shape[1]
  dtype = x_gmem.dtype
  itemsize = jnp.dtype(dtype).itemsize
  bm, bn, bk = block.block_m, block.block_n, block.block_k
  wg_rows = bm // 2
  m_blocks, n_blocks = m // bm, f // bn
  in_tf = _transforms(bk, itemsize)
  out_tf = _transforms(bn, itemsize)

  def pipeline(body, compute_context):
    spec_x = plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=in_tf,
                             memory_space=plgpu.SMEM, delay_release=block.mma_in_flight)
    spec_w = plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=in_tf,
                             memory_space=plgpu.SMEM, delay_release=block.mma_in_flight)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k // bk,), memory_registers=40, in_specs=[spec_x, spec_w, spec_w],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=block.stages,
        compute_context=compute_context)

  unused = lambda *_, **__: None  # the allocations do not depend on the bodies

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(unused, unused).get_allocations(x_gmem, w_gmem, w_gmem),
      out_smem=plgpu.SMEM((2, wg_rows, bn), dtype, transforms=out_tf),
      collective_axes="wg")
  def _scope(allocs, out_smem):
    wg = lax.axis_index("wg")
    my_rows = pl.ds(wg * wg_rows, wg_rows)

    @plgpu.nd_loop((m_blocks * n_blocks,), collective_axes="sm")
    def _tile(info):
      (t,) = info.index
      mi, ni = t % m_blocks, t // m_blocks
      rows = pl.ds(mi * bm, bm)

      def compute_context(run):
        @functools.partial(pl.run_scoped, acc_g=plgpu.ACC((wg_rows, bn), jnp.float32),
                           acc_u=plgpu.ACC((wg_rows, bn), jnp.float32))
        def _accs(acc_g, acc_u):
          run((acc_g, acc_u))
          plgpu.wgmma_wait(0)
          g = acc_g[...].astype(dtype).astype(jnp.float32)
          u = acc_u[...].astype(dtype).astype(jnp.float32)
          y = swiglu(g, u, limit).astype(dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last tile's store has read it
          out_smem[wg] = y
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                  o_gmem.at[rows, pl.ds(ni * bn, bn)].at[my_rows])

      def body(_, x_smem, g_smem, u_smem, accs):
        acc_g, acc_u = accs
        plgpu.wgmma(acc_g, x_smem.at[my_rows], g_smem)
        plgpu.wgmma(acc_u, x_smem.at[my_rows], u_smem)
        # the slot of chunk kk - mma_in_flight is released when the body returns
        plgpu.wgmma_wait(block.mma_in_flight)
        return accs

      pipeline(body, compute_context)(
          x_gmem.at[rows, :], w_gmem.at[:, pl.ds(ni * bn, bn)],
          w_gmem.at[:, pl.ds(f + ni * bn, bn)], allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def swiglu_matmul_gpu(x, w, *, block: BlockConfig | None = None, limit=None,
                      num_sms: int | None = None, interpret=None):
  """silu(x @ w[:, :F]) * (x @ w[:, F:]) for x [M, K], w [K, 2F] (module docstring).

  num_sms: CTAs of the persistent grid (default: the device's SM count).
  interpret: a Mosaic GPU interpret-mode params object to run on the CPU, or None."""
  block = block or BlockConfig()
  m, k = x.shape
  k2, two_f = w.shape
  if k2 != k or two_f % 2:
    raise ValueError(f"x {x.shape} and w {w.shape}: need w [K, 2F] with K = {k}.")
  if w.dtype != x.dtype:
    raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}.")
  f = two_f // 2
  if m % block.block_m or k % block.block_k or f % block.block_n:
    raise ValueError(f"swiglu_matmul_gpu: M={m}, K={k}, F={f} must be multiples of "
                     f"block_m={block.block_m}, block_k={block.block_k}, "
                     f"block_n={block.block_n}.")
  if num_sms is None:
    num_sms = jax.devices()[0].core_count
  tiles = (m // block.block_m) * (f // block.block_n)
  body = functools.partial(_swiglu_matmul_kernel, block=block, limit=limit)
  body.__name__ = "swiglu_matmul"  # the kernel's name in profiles (a partial has none)
  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, f), x.dtype),
      grid=(min(num_sms, tiles),), grid_names=("sm",),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({} if interpret is None else {"interpret": interpret}),
  )(x, w)
