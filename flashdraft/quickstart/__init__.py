"""`flashdraft quickstart`: the whole path on an embedded default target, apart from the benchmarks.

- `flow`: the command (target, target-generated data, a drafter trained, real speculative decoding, the
  summary);
- `tiny_lm`: its default target, a tiny code model trained here on the standard library's Python source
  (docs/real-target.md).
"""
