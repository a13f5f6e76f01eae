"""Expert parallelism (--ep N): each rank holds E/N experts whole, and every (token,
chosen expert) pair's hidden row travels to the rank holding that expert and back.

Rank r holds experts [r*E/N, (r+1)*E/N) (engines/tp/plan.py `held_experts`). Every rank
enters a mixture layer with the same rows x [T, hidden] (after the attention's
all-reduce, or from an attention replicated on every rank) and runs the router itself,
so every rank knows every pair's expert: the dispatch needs no exchange of counts or
ids, only the rows. (The rows are the same bits on every rank: an all-reduce leaves
each rank the same sums, and a replicated attention computes the same ones. Ranks
that routed differently would disagree on the split sizes, which gloo answers by
aborting, or send rows to experts their owner did not expect.) Rank r owns the tokens [ceil(rT/N), ceil((r+1)T/N)); for each pair
of its tokens it sends the row to the expert's rank (one all-to-all), which runs its
experts on all it received at once (the backend's grouped `experts`: on a GPU the
fused-MoE kernel) and scales them by their routing weights; a second all-to-all brings
the products back, and the source adds them into its tokens' rows. Each rank then
holds its own tokens' sums and zeros elsewhere: the layer's one all-reduce (which TP's
expert split needs as well) gives every rank every row. Shared experts (GLM) are whole
on every rank and added after it, outside the sum.

Cost (why not just the all-reduce): since every rank has every row, a rank could also
run its experts on every token that chose them and let the all-reduce sum; that moves
less (no all-to-all). The all-to-all pays where ranks hold different tokens (DP
attention, several batches), the case the dispatch is built for; here each rank's send
is T/N * k rows rather than T, and each rank's experts read only their own tokens.

The collectives are the group's process group's all-to-all: gloo on the CPU, NCCL on
CUDA (the same calls; the split sizes are host lists, one device sync per layer).
"""
from __future__ import annotations

import torch

from engines.backend import Backend, ExpertWeights


class ExpertParallel:
    """One group's dispatch and combine, shared by every mixture layer of a rank's model
    (engines/tp/shard.py attaches it as SparseMoe.parallel)."""

    def __init__(self, group, rank: int, size: int, num_experts: int) -> None:
        """`group`: the rank's TpGroup (engines/tp/group.py), whose process group the
        all-to-alls and the all-reduce run on."""
        self.group, self.rank, self.size = group, rank, size
        self.num, self.per = num_experts, num_experts // size
        self.first = rank * self.per

    def forward(self, moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                backend: Backend) -> torch.Tensor:
        """A mixture layer `moe` (SparseMoe) at x [T, hidden], routed to ids/weights
        [T, k]: the layer's output, whole on every rank."""
        out = self.group.all_reduce(self.routed(x, ids, weights, moe.experts, backend))
        if moe.shared_experts is not None:
            out = out + moe.shared_experts.partial(x, backend)     # whole here: no sum
        return out

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               experts: ExpertWeights, backend: Backend) -> torch.Tensor:
        """This rank's tokens' sums of their routed experts, zeros in the others' rows."""
        t, k = ids.shape
        n, r = self.size, self.rank
        flat = ids.reshape(-1)
        dest = torch.div(flat, self.per, rounding_mode="floor")          # each pair's rank
        lo, hi = -(-r * t // n), -(-(r + 1) * t // n)                    # our tokens
        # ours to send: our pairs in expert order (so by destination rank)
        send = lo * k + torch.argsort(flat[lo * k:hi * k], stable=True)
        # theirs to run here: pairs of our experts, in (source rank, expert) order
        source = torch.div(torch.arange(t, device=x.device) * n, t,
                           rounding_mode="floor").repeat_interleave(k)
        here = (dest == r).nonzero()[:, 0]
        recv = here[torch.argsort(source[here] * self.num + flat[here], stable=True)]
        counts = torch.stack([torch.bincount(dest[send], minlength=n),
                              torch.bincount(source[here], minlength=n)]).tolist()
        rows = self._exchange(x.index_select(0, send // k), counts[1], counts[0])
        done = rows
        if len(recv):           # (a rank none of whose experts was chosen runs nothing)
            local = (flat[recv] - self.first)[:, None]
            done = backend.experts(rows, local, weights.reshape(-1)[recv][:, None], experts)
        back = self._exchange(done, counts[0], counts[1])
        return torch.zeros_like(x).index_add_(0, send // k, back)

    def _exchange(self, rows: torch.Tensor, recv_counts: list[int], send_counts: list[int]
                  ) -> torch.Tensor:
        """All-to-all of rows: send_counts[d] of ours (in order) to rank d, recv_counts[s]
        from rank s into ours (in rank order)."""
        out = rows.new_empty((sum(recv_counts), rows.shape[1]))
        self.group.group.alltoall_base(out, rows.contiguous(), recv_counts, send_counts).wait()
        return out
