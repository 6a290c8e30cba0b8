"""How every flashdraft command sets transformers up before it imports a model: no progress bars in run
logs, and no scikit-learn.

transformers 5.17 imports scikit-learn, and with it scipy and pandas, whenever it is installed: for one
option of assisted generation (the assistant's confidence threshold), which flashdraft never uses. That
import was 1.6 s of `flashdraft train`'s start-up on the H200 host (docs/shards.md, "The first step").
transformers asks `is_sklearn_available()` before importing it; reporting the package absent before
`transformers.generation` is first imported skips the import. Newer transformers import it only when the
option is used; there the answer changes nothing flashdraft runs.
"""

from __future__ import annotations

import sys


def _sklearn_unused() -> bool:
    return False


def prepare_transformers() -> None:
    """Call once, early, before any transformers model is imported (the CLI's `main` does)."""
    from transformers import utils as hf_utils
    from transformers.utils import import_utils, logging

    logging.disable_progress_bar()  # weight-loading bars are noise in run logs
    if "transformers.generation.candidate_generator" in sys.modules:
        return  # too late to matter, and its own binding is already taken
    for module in (hf_utils, import_utils):  # candidate_generator imports it from transformers.utils
        if hasattr(module, "is_sklearn_available"):
            module.is_sklearn_available = _sklearn_unused
