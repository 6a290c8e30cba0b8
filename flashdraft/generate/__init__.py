"""Decoding: the one engine package behind `prepare --regenerate` and `eval` (docs/decoding.md).

- `sampling`: token choice (one logit filter, greedy and seeded picks) and the speculative acceptance rules;
- `kv_cache`: the one static KV cache of both batched engines (regeneration's and the fast engine);
- `static`: decode attention (`decode_attention`), CUDA-graph capture; the batched plain
  decode loop of regeneration;
- `speculative`: DFlash speculative decoding; block size 1 is plain decoding through the same loop (the
  fair speedup baseline);
- `engines`: the other regeneration engines (transformers' `generate`, continuous batching, vLLM) and the
  choice between them.

Imports run one way: `generate` uses `model` and the core modules, never `data`, `infer` or `train`.
"""
