"""The fused all-reduce boundaries of a tensor-parallel DSpark draft: the
adapter ``dspark_core.runtime.decode.DraftDecode`` takes as ``all_reduce``
(its ``AllReduceBoundaries`` protocol).

``DraftAllReduce(mailbox, plan, draft, rank)`` binds one ``AllReduceBoundary``
per residual boundary of ``draft`` (the ``DraftDescription`` of a rank's
shard, any model's), in the order of ``draft.boundaries()`` (layer i's
attention boundary 2i, its
feed-forward boundary 2i + 1), each to its plan part's ``BoundaryConstants``,
its connection's ``alpha`` / ``beta`` and its post and pre norms' weights, in
the plan's sum order (``plan.all_reduce.constants.sum_order``). It implements
``DraftDecode``'s ``AllReduceBoundaries``:

- ``tp``: the TP size;
- ``takes(partial)``: whether the call runs fused, from the partial's row
  count alone (``1 <= m <= capacity``), so every rank decides the same (a
  rank fusing alone would wait for partials that never come);
- ``run(index, partial, stream, store_stream)``: boundary ``index``'s fused
  all-reduce + residual boundary, ``(new_stream or None, out)``;
- ``all_reduce(partial)``: the stock all-reduce of the mailbox's group (NCCL
  with a ``TorchGroup`` over an NCCL process group) on a copy of the partial,
  for the calls ``takes`` refuses; the executor then runs the boundary unfused;
- ``project(index, x, weight)``: boundary ``index``'s branch GEMM. Where the
  plan runs that projection on the package GEMM (``plan.package_gemms``, in
  the boundaries' order: layer i's o_proj, then its down_proj) and the call
  fuses, the GEMM publishes this rank's partial into the mailbox and
  ``(None, True)`` comes back (``run(..., published=True)`` then only
  consumes it); otherwise the stock GEMM's ``(partial, False)``. The package
  GEMM sums in its own order (not cuBLAS's), so that path is exact to the
  stock all-reduce of its own partials, not bitwise the stock TP forward.
  Where the plan's part holds ``OrderedGemmConstants`` (the ordered GEMM
  opt-in), the projection is the **exact** package GEMM
  (``cutedsl.ordered_package.OrderedPackageGemm``): ``prepare`` runs its
  build-time check against the live cuBLAS (``F.linear`` on the shard, the
  GEMM of vLLM's RowParallelLinear) at 1 .. capacity rows, and the ranks
  keep the row counts every rank's check bound (``exact_rows``); there it
  publishes cuBLAS's partial bit for bit, so the fused step is the stock
  TP forward's bits; other row counts run the stock GEMM, then the fused
  all-reduce.

At TP2 the mailbox's sum (either order) and NCCL's BF16 sum are one correctly
rounded ``bf16(a + b)``, so the fused path, the fallback and the stock TP
forward (``TPDraftModel.forward`` over NCCL) give the same bits. Beyond TP2
NCCL's order is not fixed: the fused path is then bit for bit
``protocol.reference_sum`` of the plan's order, the fallback NCCL's.

``prepare()`` compiles every variant the executor launches (the first
boundary on an FP32 and a BF16 stream; every boundary but the last stores its
new stream) before CUDA graph capture; ``build_draft_decode`` calls it. It is
collective: it ends by agreeing over the mailbox's group that every rank
compiled (a failure on any rank raises on all).
"""

from __future__ import annotations

import logging

from dspark_comm import protocol
from dspark_core.contracts.constants import OrderedGemmConstants
from dspark_core.errors import ranges

log = logging.getLogger("dspark.decode")


class DraftAllReduce:
    """The ``AllReduceBoundaries`` of one rank of a TP draft (module
    docstring). ``boundary`` builds each boundary (default
    ``dspark_comm.boundary.AllReduceBoundary``) and ``gemm`` each package GEMM
    (default ``dspark_comm.package_gemm.PackageGemm``), ``exact`` each exact
    one (default ``OrderedPackageGemm``; CPU tests pass stand-ins);
    ``reduce(partial)``: the stock all-reduce of the calls ``takes`` refuses
    (default: the group's, ``all_reduce``); ``package_gemm=False`` keeps
    every branch GEMM stock;
    ``one_row_gemv=True`` (opt-in) runs the package GEMMs' one-row calls on
    the one-token GEMV (``PackageGemm(one_row_gemv=True)``: its own order);
    ``positive_zero=True`` sums -0.0 as +0.0 (``protocol``: the stock of a
    Lamport all-reduce whose empty marker is -0.0)."""

    def __init__(self, mailbox, plan, draft, rank: int, *, boundary=None, gemm=None, exact=None, reduce=None,
                 package_gemm: bool = True, one_row_gemv: bool = False, positive_zero: bool = False) -> None:
        tp = plan.target.tp
        if plan.draft_reason is not None:
            raise ValueError(f"the plan keeps the whole draft stock ({plan.draft_reason})")
        part = plan.all_reduce
        if part is None or not part.fused:
            why = part.reason if part is not None else "no all-reduce part"
            raise ValueError(f"the plan keeps the all-reduce stock: {why}")
        if mailbox.layout.tp != tp:
            raise ValueError(f"a TP{tp} plan on a mailbox of TP{mailbox.layout.tp}")
        if rank != mailbox.rank:
            raise ValueError(f"rank {rank} on the mailbox of rank {mailbox.rank}")
        if draft.tp != tp:
            raise ValueError(f"a TP{draft.tp} shard of the draft for a TP{tp} plan")
        bounds = draft.boundaries()
        if len(bounds) != len(plan.boundaries):
            raise ValueError(f"a plan of {len(plan.boundaries)} boundaries for a draft of {len(bounds)}")
        h = draft.hidden_size
        if mailbox.layout.hidden_size != h:
            raise ValueError(f"a draft of {h} features on a mailbox of {mailbox.layout.hidden_size}")
        if boundary is None:
            from dspark_comm.cutedsl.all_reduce_boundary import AllReduceBoundary as boundary
        self.tp, self.rank, self._reduce = tp, rank, reduce
        self.mailbox, self.plan, self.draft = mailbox, plan, draft
        self.sum_order = part.constants.sum_order
        self.capacity = mailbox.layout.capacity
        self.positive_zero = bool(positive_zero)
        zero = {"positive_zero": True} if positive_zero else {}
        self.boundaries = []
        for p, b in zip(plan.boundaries, bounds):
            if not p.fused:  # the plan's all-reduce fuses only where every boundary does
                raise ValueError(f"{p.name} keeps its stock modules: {p.reason}")
            self.boundaries.append(boundary(mailbox, p.constants, b.connection.alpha, b.connection.beta,
                                            b.post.weight, b.pre.weight, self.sum_order, **zero))
        # Per boundary: its package GEMM (bound to its projection's weight), or None.
        self.gemms: list = [None] * len(self.boundaries)
        # Per boundary: the row counts its exact package GEMM publishes (prepare).
        self.exact_rows: list[frozenset] = [frozenset()] * len(self.boundaries)
        self.exact: set[int] = set()  # the boundaries whose GEMM is an exact package GEMM
        self.weights = [w for layer in draft.layers for w in (layer.attention.o_proj_weight, layer.mlp.down_weight)]
        extra = {"one_row_gemv": True} if one_row_gemv else {}
        for index, (p, weight) in enumerate(zip(plan.package_gemms, self.weights)):
            if not p.fused:
                continue
            if isinstance(p.constants, OrderedGemmConstants):  # exact: the plan's ordered GEMM opt-in decides
                if exact is None:
                    from dspark_comm.cutedsl.ordered_package import OrderedPackageGemm as exact
                self.gemms[index] = exact(p.constants.role, weight, mailbox)
                self.exact.add(index)
            elif package_gemm:
                if gemm is None:
                    from dspark_comm.cutedsl.package_gemm import PackageGemm as gemm
                self.gemms[index] = gemm(p.constants, weight, mailbox, rank, **extra)

    def prepare(self, failed: BaseException | None = None) -> None:
        """Compile every variant the executor launches (module docstring),
        then agree with the other ranks over the mailbox's group (collective:
        every rank calls it). No rank leaves before every rank has compiled,
        so none waits in a mailbox call on a peer still compiling; and a rank
        whose compile failed makes every rank raise RuntimeError (its own
        error chained) instead of leaving the others waiting for it.
        ``failed``: an error this rank already hit preparing the rest of the
        decode; it compiles nothing more and only takes part in the agreement."""
        import torch

        error = failed
        if error is None:
            try:
                last = len(self.boundaries) - 1
                for index, (b, g) in enumerate(zip(self.boundaries, self.gemms)):
                    dtypes = (torch.float32, torch.bfloat16) if index == 0 else (torch.float32,)
                    if g is None:
                        b.prepare(stream_dtypes=dtypes, store_stream=(index != last,))
                        continue
                    b.prepare(stream_dtypes=dtypes, store_stream=(index != last,), published=(False, True))
                    if index in self.exact:  # its rows from the check against the live cuBLAS
                        g.check(range(1, min(self.capacity, g.max_rows) + 1))
                    else:
                        g.prepare()
            except Exception as e:  # noqa: BLE001 (re-raised below, after every rank has heard of it)
                error = e
        try:  # raises on every rank where any rank failed
            self.mailbox.group.agree(error is None, "preparing the TP draft's kernels (DraftAllReduce.prepare)")
        except RuntimeError as disagreement:
            raise disagreement from error
        self._agree_exact_rows()

    def _agree_exact_rows(self) -> None:
        """Collective: each exact package GEMM publishes at the row counts
        every rank's check bound (a rank publishing alone would leave its
        peers waiting on partials that never come); said once per GEMM."""
        mine = [sorted(g.orders) if index in self.exact else [] for index, g in enumerate(self.gemms)]
        everyone = self.mailbox.group.all_gather_object(mine)
        for index in sorted(self.exact):
            common = frozenset.intersection(*(frozenset(rows[index]) for rows in everyone))
            self.exact_rows[index] = common
            others = sorted(set(range(1, self.capacity + 1)) - common)
            log.info("boundary %d's exact package GEMM publishes cuBLAS's partial at %s rows; cuBLAS, then the "
                     "fused all-reduce, at %s (the check against cuBLAS found no order on some rank)",
                     index, ranges(common) or "no", ranges(others) or "no other")

    def takes(self, partial) -> bool:
        """Whether a call runs fused: its row count alone."""
        return protocol.takes(int(partial.shape[0]), self.capacity)

    def project(self, index: int, x, weight):
        """Boundary ``index``'s branch ``x @ weight^T`` (module docstring):
        ``(None, True)`` where the package GEMM published it, else the stock
        GEMM's ``(partial, False)``. The row count decides, the same on every
        rank."""
        from dspark_core.spec.layers import linear

        gemm = self.gemms[index]
        if gemm is None or not self.takes(x):
            return linear(x, weight), False
        if index in self.exact and int(x.shape[0]) not in self.exact_rows[index]:
            return linear(x, weight), False
        if weight is not self.weights[index]:
            raise ValueError(f"boundary {index}'s package GEMM is bound to another weight")
        gemm.run(x.contiguous(), publish=True)
        return None, True

    def run(self, index: int, partial, stream, store_stream: bool, published: bool = False):
        """Boundary ``index``'s all-reduce and residual boundary, fused:
        ``(new_stream or None, out)``; ``published``: the partial is already
        in the mailbox (``project``), ``partial`` is None."""
        if published:
            return self.boundaries[index].run(None, stream, store_stream, published=True)
        return self.boundaries[index].run(partial, stream, store_stream)

    def all_reduce(self, partial):
        """The stock all-reduce of a copy of ``partial`` (the sum): ``reduce``'s,
        else the group's."""
        if self._reduce is not None:
            return self._reduce(partial.contiguous().clone())
        return self.mailbox.group.all_reduce_(partial.contiguous().clone())


__all__ = ["DraftAllReduce"]
