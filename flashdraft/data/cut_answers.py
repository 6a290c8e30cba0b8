"""Answers cut at --max-new-tokens, kept truthfully (`prepare --cut-answers keep`, docs/regeneration.md).

A cut answer's tokens are what the target produced after its prompt, so they are fit to train on; what is
false is the end of turn the chat template puts after them: the target never ended that turn there. A kept
cut answer therefore ends its sample: its tokens are supervised and nothing follows them, neither an
end-of-turn nor a later turn (which was answered after a context closed by that same false end-of-turn).
"""

from __future__ import annotations

from collections import Counter

from flashdraft.data.render import Rendered

CUT_POLICIES = ("keep", "drop")


def first_cut_turn(finish_reasons: list[str | None]) -> int | None:
    """The index (among the regenerated assistant turns) of the first answer cut at --max-new-tokens."""
    return next((k for k, reason in enumerate(finish_reasons) if reason == "length"), None)


def end_at_cut_answer(
    sample: Rendered,
    prompt: list[int],
    generated: list[int] | None,
    end_of_turn: int | None,
    counts: Counter[str],
) -> Rendered | None:
    """`sample`: the rendering of a conversation whose last assistant turn is the cut answer; `prompt`: the
    ids the target was given for it; `generated`: the ids it produced (None: a server answered).

    Returns the sample ending with the answer's last token: the generated ids themselves when the rendered
    prefix is exactly the prompt, else the re-encoded answer without the template's end-of-turn (the last
    supervised token of a rendered turn). None when neither holds (the caller counts it dropped)."""
    ids, mask = list(sample.input_ids), list(sample.loss_mask)
    if generated and ids[: len(prompt)] == prompt:
        counts["cut answer: generated ids used"] += 1
        return Rendered(ids[: len(prompt)] + list(generated), mask[: len(prompt)] + [1] * len(generated))
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    if end and end_of_turn is not None and ids[end - 1] == end_of_turn:
        counts["cut answer: re-encoded, end-of-turn removed"] += 1
        return Rendered(ids[: end - 1], mask[: end - 1])
    return None
