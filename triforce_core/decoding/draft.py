"""Tier 0, resolved once from what the user asked for: a draft model, prompt lookup, or none."""
from __future__ import annotations

from dataclasses import dataclass

from triforce.config import SpecParams
from triforce.errors import UserError


@dataclass(frozen=True)
class Draft:
    kind: str            # model | lookup | none
    model: object = None  # the LoadedModel when kind is model

    @property
    def has_tier0(self) -> bool:
        """Whether something drafts for the tier above (a model, or lookup at no cost)."""
        return self.kind != "none"


LOOKUP, NO_DRAFT = Draft("lookup"), Draft("none")


def resolve_draft(value, spec: SpecParams, load=None, refuse_unused: bool = True) -> Draft:
    """value: a Draft, a loaded model, 'lookup', 'none', None (lookup where the method drafts)
    or a path, which `load(path)` turns into a model. Methods without a tier 0 get NO_DRAFT and,
    with refuse_unused (a user's flags), refuse a draft model; naive needs one."""
    if isinstance(value, Draft):
        value = value.model if value.kind == "model" else value.kind
    if not spec.uses_draft:
        if refuse_unused and value not in (None, "none", "lookup"):
            raise UserError(f"--draft is only used by --method triforce and naive, not {spec.method}")
        return NO_DRAFT
    if value == "none":
        if spec.method == "naive":
            raise UserError("--method naive needs a draft (a model path or 'lookup')")
        return NO_DRAFT
    if value in (None, "lookup"):
        return LOOKUP
    if isinstance(value, str):
        if load is None:
            raise ValueError("a draft path needs a loader")
        value = load(value)
    return Draft("model", value)
