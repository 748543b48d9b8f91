"""The rank arithmetic of the parallel layout (torch-free: the cost model prices it).

``Layout`` cuts ``world_size`` ranks into ``pp`` pipeline stages of consecutive ranks
(Megatron's order: the pipeline outermost), and folds each stage's ranks into ``tp x dp``
for dense layers and ``etp x ep x edp`` for expert layers; it names each rank's groups
(every group but the pipeline's lies inside one stage) and its place in its MoE block
(``moepar.parallel.groups`` explains the folding and creates the process groups from it).
Nothing here imports torch, so ``moepar.cost`` and ``python -m moepar report`` build on it
without loading torch.
"""
from __future__ import annotations

import dataclasses
import math

from .. import checks


def check_positive(**sizes: int) -> None:
    """Raise ValueError naming the first size that is not a positive integer."""
    for name, value in sizes.items():
        checks.positive_int(name, value)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How ``world_size`` ranks fold into tp/dp (dense) and etp/ep/edp (experts)."""

    world_size: int
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        check_positive(world_size=self.world_size, tensor_parallel_size=self.tp,
                       expert_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
                       pipeline_parallel_size=self.pp)
        if self.world_size % self.pp:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by pipeline_parallel_size={self.pp}: "
                f"every pipeline stage needs the same number of ranks")
        where = "world_size" if self.pp == 1 else f"the {self.stage_size} ranks of a pipeline stage"
        if self.stage_size % self.tp:
            raise ValueError(
                f"{where}={self.stage_size} is not divisible by tensor_parallel_size={self.tp}: "
                f"dense layers need {where} = tensor_parallel_size x data_parallel_size")
        if self.stage_size % (self.ep * self.etp):
            raise ValueError(
                f"{where}={self.stage_size} is not divisible by expert_parallel_size={self.ep} x "
                f"expert_tensor_parallel_size={self.etp} = {self.ep * self.etp}: expert layers need "
                f"{where} = ep x etp x expert_data_parallel_size")

    @property
    def stage_size(self) -> int:
        """Ranks in one pipeline stage (all of them when pp = 1)."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        return self.stage_size // self.tp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.ep * self.etp)

    def _per_stage(self, groups: list[list[int]]) -> list[list[int]]:
        """The groups of stage 0 repeated in every stage (stage s holds ranks s*stage_size...)."""
        n = self.stage_size
        return [[s * n + r for r in g] for s in range(self.pp) for g in groups]

    def pp_groups(self) -> list[list[int]]:
        n = self.stage_size
        return [[s * n + i for s in range(self.pp)] for i in range(n)]

    def tp_groups(self) -> list[list[int]]:
        return self._per_stage([[d * self.tp + t for t in range(self.tp)] for d in range(self.dp)])

    def dp_groups(self) -> list[list[int]]:
        return self._per_stage([[d * self.tp + t for d in range(self.dp)] for t in range(self.tp)])

    def etp_groups(self) -> list[list[int]]:
        return [[b * self.etp + t for t in range(self.etp)] for b in range(self.world_size // self.etp)]

    def ep_groups(self) -> list[list[int]]:
        block = self.ep * self.etp
        return self._per_stage([[d * block + e * self.etp + t for e in range(self.ep)]
                                for d in range(self.edp) for t in range(self.etp)])

    def edp_groups(self) -> list[list[int]]:
        block = self.ep * self.etp
        return self._per_stage([[d * block + j for d in range(self.edp)] for j in range(block)])

    @property
    def moe(self) -> int:
        """Ranks in one MoE layer's block: lcm(tp, ep*etp) consecutive ranks, the closure of
        the TP, EP and ETP groups (every collective of one MoE layer stays inside it)."""
        return math.lcm(self.tp, self.ep * self.etp)

    def moe_groups(self) -> list[list[int]]:
        n = self.moe
        return [list(range(s, s + n)) for s in range(0, self.world_size, n)]

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index inside each of its groups."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of {self.world_size} ranks")
        block = self.ep * self.etp
        local = rank % self.stage_size
        return {"tp": local % self.tp, "dp": local // self.tp,
                "etp": local % self.etp, "ep": (local % block) // self.etp, "edp": local // block,
                "moe": local % self.moe, "pp": rank // self.stage_size}

    def all_groups(self) -> dict[str, list[list[int]]]:
        return {"tp": self.tp_groups(), "dp": self.dp_groups(), "etp": self.etp_groups(),
                "ep": self.ep_groups(), "edp": self.edp_groups(), "moe": self.moe_groups(),
                "pp": self.pp_groups()}

    def moe_rows(self, rank: int) -> "MoeRows":
        """Where ``rank``'s peers sit inside its MoE block (indices into the block's ranks)."""
        n = self.moe
        start = rank - rank % n
        c = self.coords(rank)
        stage = c["pp"] * self.stage_size
        sub = stage + c["edp"] * self.ep * self.etp - start   # this rank's EP x ETP sub-block
        ep_rows = tuple(sub + e * self.etp + c["etp"] for e in range(self.ep))
        tp_rows = tuple(stage + c["dp"] * self.tp + t - start for t in range(self.tp))
        return MoeRows(rank - start, sub, ep_rows, tp_rows)


@dataclasses.dataclass(frozen=True)
class MoeRows:
    """A rank's place in its MoE block, as row indices of a block-wide all-gather.

    ``me``: this rank's row; ``sub``: first row of its EP x ETP sub-block, whose rows are
    ``sub + e*etp + t`` for EP index e and ETP index t (so the rows of ETP peer t's EP group
    are ``sub + t :: etp``); ``ep_rows``: the rows of this rank's EP group in EP order;
    ``tp_rows``: the rows of its TP group in TP order."""

    me: int
    sub: int
    ep_rows: tuple[int, ...]
    tp_rows: tuple[int, ...]
