"""The engine and vision-tower benchmark (``bench/gpu_engine.py``), one module per section. Each section
is ``run(bench, out)``: it measures on the ``common.Bench`` of the run and fills its own ``out`` dict, so a
fault keeps what it measured before. Sections, in the order they run:

  ceilings       device copy bandwidth and bf16 matmul rate (this run's roofline: every floor divides by them)
  check          our GPU path (graphs and eager) and the plain torch path in bf16 against an fp32 reference
  decode1        decode at batch 1: graph replay and engine step against the bytes read; what each part gives
  decode64       decode at batch 64 × 2,048-token contexts against weights (MoE: experts touched) + KV bytes
  sampling       batch-64 steps with sampling options on none, one or every row
  prefill        the four-1080p-image prompt (10,903 tokens) against its FLOPs
  prefill_sizes  text prompts of --prefill-lengths tokens, graphs against eager, both floors, kernels by name
  chunked        step budgets against unchunked, a mixed step, a prefix-cache hit, attention after a prefix
  memory         1,000 requests through one engine: no growth
  hf             HF generate()'s decode step on the same architecture
  vit            the tower on 1, 4, 8 × 1080p against HF's
  vit_graphs     the tower through its graphs (pieces, and a graph per batch layout) against eager
  preprocess     one 1080p image to patches: HF's PIL processor against the torch path on the device
  video          10 s and 30 s 720p clips: preprocessing, the tower, HF's tower, the frontend's PyAV decode
  timeline       the batch-1 decode step's critical path, kernel by kernel (torch.profiler)
"""

from bench.engine import (ceilings, check, chunked, decode1, decode64, hf, memory, prefill, prefill_sizes,
                          preprocess, sampling, timeline, video, vit, vit_graphs)

SECTIONS = {module.__name__.rsplit(".", 1)[1]: module.run for module in (
    ceilings, check, decode1, decode64, sampling, prefill, prefill_sizes, chunked, memory, hf, vit, vit_graphs,
    preprocess, video, timeline)}
