"""Train on the token ids the target generated, not on its decoded text encoded again.

Decoding an answer and encoding the text again does not always give back the ids the target produced
(merges across token boundaries, ids the tokenizer cannot decode, text the template trims), and then the
drafter is taught tokens the target never emits. A local engine journals its ids beside the text; here a
rendered sample's answer span is replaced by those ids when the sample's ids before the answer are exactly
the prompt the target was given (the rendered prefix, compared id for id) and the answer ends with the
token the template ends the turn with. Otherwise the re-encoded answer is kept and the reason counted
(docs/regeneration.md).
"""

from __future__ import annotations

from collections import Counter

from flashdraft.data.render import Rendered

USED = "generated ids used"


def use_generated_ids(
    rendered: list[Rendered],
    turns: list[int],
    generated: list[list[int] | None],
    prompt_of_turn,
    counts: Counter[str],
) -> list[Rendered]:
    """`rendered`: the samples of one conversation (one covering every assistant turn, or one per turn when
    the template rewrites history); `turns`: the message index of each assistant turn; `generated`: the ids
    journaled for each turn (None where a server answered); `prompt_of_turn(i)`: the prompt ids the target
    was given for the turn at message i. Outcomes are counted in `counts`."""
    if not any(ids is not None for ids in generated):
        return rendered
    per_turn = len(rendered) == len(turns) and len(turns) > 1
    groups = [[k] for k in range(len(turns))] if per_turn else [list(range(len(turns)))]
    out = []
    for sample, group in zip(rendered, groups, strict=True):
        ids, mask = list(sample.input_ids), list(sample.loss_mask)
        for k in group:
            new = generated[k] if k < len(generated) else None
            if not new:
                continue
            prompt = prompt_of_turn(turns[k])
            if ids[: len(prompt)] != prompt:
                counts["re-encoded: the rendered prefix differs from the prompt"] += 1
                continue
            start = end = len(prompt)
            while end < len(mask) and mask[end]:
                end += 1
            if end == start or new[-1] != ids[end - 1]:
                counts["re-encoded: the answer ends with another token than the template's"] += 1
                continue
            ids[start:end], mask[start:end] = new, [1] * len(new)
            counts[USED] += 1
        out.append(Rendered(ids, mask))
    return out
