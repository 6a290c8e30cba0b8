"""How many graphs dynamo holds for a compiled function: the tests' measure of "compiled once"."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compiled_graphs(function: Callable) -> int:
    """The cache entries dynamo keeps for `function`'s code: one per graph it compiled (recompiles
    included)."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__))
