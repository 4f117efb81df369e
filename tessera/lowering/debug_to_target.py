"""Tile IR's debugging ops -> Target IR: `tile.assert` and the profile stamps.

Neither has a platform choice in it: each becomes the Target IR op of the same meaning, which
the backend writes out (PTX: `__assertfail` behind the negated condition; a `%clock64` read
stored by one thread per block). Their provenance (`tessera.loc`) goes along with them, like
every rewritten op's (`provenance.CarryProvenance`).
"""
from __future__ import annotations

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from ..ir import target, tile


class LowerAssert(RewritePattern):
    """tile.assert -> tessera_target.assert."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AssertOp, rewriter: PatternRewriter) -> None:
        rewriter.replace(op, target.AssertOp(op.cond, op.message.data))


class LowerProfileStamp(RewritePattern):
    """tile.profile_begin / profile_end -> tessera_target.profile_begin / profile_end."""

    TARGET_OPS = {tile.ProfileBeginOp: target.ProfileBeginOp, tile.ProfileEndOp: target.ProfileEndOp}

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        lowered = self.TARGET_OPS.get(type(op))
        if lowered is not None:
            rewriter.replace(op, lowered(op.label.data, op.buffer, op.slot.value.data))


def patterns() -> tuple[RewritePattern, ...]:
    return LowerAssert(), LowerProfileStamp()
