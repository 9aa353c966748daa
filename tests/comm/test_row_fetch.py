"""comm's row fetch on its own: the rows each rank asked for, and each row's gradients summed at its owner.

Every rank holds rows `rank * 10 + i` of one global table. Rank d asks every peer
for rows by local index (as sparse attention does, after its request exchange),
including a row two ranks ask for, so that row's owner adds two gradients. The
values are small integers in float64: every sum is exact, so the checks are equalities.
"""

from __future__ import annotations

import torch

from cpcompose.comm import CommMeter, CPGroup, fetch_rows, plan_by_peer

ROWS, WIDTH = 6, 3


def _asked(src: int, dst: int) -> list[int]:
    """The local rows of rank `src` that rank `dst` asks for (none from itself)."""
    return [] if src == dst else [(src + dst) % ROWS, 0]


def fetch_case(mesh) -> dict:
    cp = CPGroup.from_mesh(mesh)
    x = (cp.rank * 10 + torch.arange(ROWS, dtype=torch.float64)).repeat(WIDTH, 1).T.contiguous().requires_grad_()
    send = [torch.tensor(_asked(cp.rank, d), dtype=torch.long) for d in range(cp.world)]
    counts = [len(_asked(s, cp.rank)) for s in range(cp.world)]
    meter = CommMeter()
    rows = fetch_rows(x, plan_by_peer(send, counts, moves=True, row_dim=0), cp, meter)
    rows.sum().backward()
    return {"rows": rows.detach()[:, 0].tolist(), "grad": x.grad[:, 0].tolist(), "bytes": meter.total}


def test_rows_arrive_in_rank_order_and_gradients_add_up_at_their_owner(pools) -> None:
    world = 3
    for rank, got in enumerate(pools.get(world).run(fetch_case)):
        want = [float(s * 10 + row) for s in range(world) for row in _asked(s, rank)]
        asks = [0] * ROWS
        for d in range(world):
            for row in _asked(rank, d):
                asks[row] += 1
        sent_rows = sum(asks)
        assert got["rows"] == want, f"rank {rank}"
        assert got["grad"] == [float(n) for n in asks], f"rank {rank}: one gradient per rank that asked"
        assert got["bytes"] == (sent_rows + len(want)) * WIDTH * 8, f"rank {rank}: rows forward, gradients back"
