"""Experiment: batch-1 decode attention tilings at the Llama-2-7B (32 q / 32 kv heads) and
MiMo-7B (32 / 8) shapes, ctx 1k and 4k: the default BlockConfig against a grid of pages a
block / KV splits / warps / stages. Times the op (kernel + split combine) with
launch/bench_paged_attention.py's inputs and loop; one JSON line per tiling.

    PYTHONPATH=. python launch/exp_b1_attention.py      # GPU; on a CPU: a tiny interpreted run"""
import os, sys, json, itertools
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
from bench_paged_attention import Layer, make_inputs, ours, time_per_call, DEFAULT
from pallas_kernels.paged_attention import BlockConfig
cpu = jax.devices()[0].platform == "cpu"
layers = [Layer("llama", 32, 32, 128, 128), DEFAULT]
ctxs = (64,) if cpu else (1024, 4096)
grid = [(8, s, 4, 2) for s in (2, 4, 8, 16)] + [(4, s, 4, 2) for s in (8, 16, 32)] + \
       [(4, s, 2, 2) for s in (8, 16, 32)] + [(2, s, 2, 2) for s in (16, 32, 64)] + \
       [(2, s, 1, 2) for s in (16, 32, 64)] + [(1, s, 1, 2) for s in (32, 64)] + [(8, 8, 4, 1), (4, 16, 2, 1)]
if cpu:
  grid = grid[:2]
res = []
for layer, ctx in itertools.product(layers, ctxs):
  args = make_inputs(1, ctx, 1, jax.random.key(0), layer=layer)
  cfgs = [None] + [BlockConfig(pages_per_block=p, num_splits=s, rows_per_block=16, num_warps=w, num_stages=st)
                   for p, s, w, st in grid if s * p * 16 <= 4 * ctx]
  for cfg in cfgs:
    try:
      _, best, med = time_per_call(ours(cfg, interpret=cpu), args, 2 if cpu else 200, 1 if cpu else 5)
    except Exception as e:
      print(layer.name, ctx, cfg, "FAILED", str(e)[:200], flush=True)
      continue
    kv_bytes = ctx * layer.kvh * (layer.d + layer.dv) * 2
    r = dict(layer=layer.name, ctx=ctx, cfg=None if cfg is None else [cfg.pages_per_block, cfg.num_splits, cfg.num_warps, cfg.num_stages],
             us=best * 1e6, tbs=kv_bytes / best / 1e12)
    res.append(r)
    print(json.dumps(r), flush=True)
if os.environ.get("OUT"):
  json.dump(res, open(os.path.join(os.environ["OUT"], "b1_attn.json"), "w"))
