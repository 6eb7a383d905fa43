"""Trivial policies for tests and measurements."""

from __future__ import annotations

from .base import Decision, DiffFn, StepContext, cache, compute


class NeverCache:
    """Always compute: the hooks run but nothing is reused (measures hook overhead)."""

    uses_diff = False  # never measures a diff

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision:
        return compute("policy")


class AlwaysCache:
    """Cache every step once a middle residual is stored (the first call of a branch computes)."""

    uses_diff = False  # decides on `has_residual` alone

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision:
        return cache("policy") if ctx.has_residual else compute("no_residual")
