"""Rank layout of a TP x PP deployment with attention DP and CP.

The layout is SGLang's, so a daemon can sit beside an unmodified deployment
(docs/design.md §3). With attention TP ``ATP = TP / (DP * CP)``::

    g = p*TP + t,   t = (d*CP + c)*ATP + a

Everything here is pure: sizes in, rank sets out.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpcache.errors import InvalidArgument

# How a rank reduces over its domain (docs/design.md §3).
MODES = ("domain", "grid")


@dataclass(frozen=True)
class Coordinates:
    """Where one global rank sits in the layout."""

    pp: int  # pipeline stage p
    dp: int  # attention data-parallel replica d
    cp: int  # attention context-parallel rank c
    atp: int  # attention tensor-parallel rank a


@dataclass(frozen=True)
class Group:
    """A named set of global ranks, sorted ascending."""

    name: str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"topology: {name} must be a positive integer, got {value!r}")
        if self.tp % (self.dp * self.cp):
            raise InvalidArgument(
                f"topology: tp={self.tp} is not divisible by dp*cp={self.dp}*{self.cp}="
                f"{self.dp * self.cp}; attention TP would not be a whole number"
            )

    @property
    def atp(self) -> int:
        """Attention TP size: the TP ranks of one (DP replica, CP rank)."""
        return self.tp // (self.dp * self.cp)

    @property
    def world_size(self) -> int:
        """CP splits the TP ranks of a stage; it does not multiply them."""
        return self.tp * self.pp

    def scheduler_mismatch(self, rank: int, scheduler: Topology, scheduler_rank: int) -> str:
        """What differs between this daemon's place in the deployment and the
        one its scheduler declares ("" when they agree)."""
        differs = [f"{name} {getattr(scheduler, name)} (daemon: {getattr(self, name)})"
                   for name in ("tp", "cp", "dp", "pp") if getattr(scheduler, name) != getattr(self, name)]
        if scheduler_rank != rank:
            differs.append(f"rank {scheduler_rank} (daemon: {rank})")
        return ", ".join(differs)

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidArgument(
                f"topology: rank {rank} is outside the world of {self.world_size} ranks "
                f"(tp={self.tp} x pp={self.pp})"
            )

    def coordinates(self, rank: int) -> Coordinates:
        self.check_rank(rank)
        p, t = divmod(rank, self.tp)
        a = t % self.atp
        c = (t // self.atp) % self.cp
        d = t // (self.cp * self.atp)
        return Coordinates(pp=p, dp=d, cp=c, atp=a)

    def rank_of(self, coords: Coordinates) -> int:
        return coords.pp * self.tp + (coords.dp * self.cp + coords.cp) * self.atp + coords.atp

    def attn_tp(self, rank: int) -> Group:
        """Contiguous: the attention-TP ranks of this rank's (p, d, c)."""
        k = self.coordinates(rank)
        base = k.pp * self.tp + (k.dp * self.cp + k.cp) * self.atp
        return Group("attn_tp", tuple(base + a for a in range(self.atp)))

    def attn_cp(self, rank: int) -> Group:
        """Stride ATP: the CP ranks of this rank's (p, d, a)."""
        k = self.coordinates(rank)
        base = k.pp * self.tp + k.dp * self.cp * self.atp + k.atp
        return Group("attn_cp", tuple(base + c * self.atp for c in range(self.cp)))

    def tp_group(self, rank: int) -> Group:
        p = self.coordinates(rank).pp
        return Group("tp", tuple(p * self.tp + t for t in range(self.tp)))

    def pp_group(self, rank: int) -> Group:
        t = rank % self.tp
        self.check_rank(rank)
        return Group("pp", tuple(p * self.tp + t for p in range(self.pp)))

    def domain(self, rank: int) -> Group:
        """The ranks that must take this rank's decisions: its CP x ATP grid in
        one DP replica, over every PP stage."""
        k = self.coordinates(rank)
        ranks = sorted(
            self.rank_of(Coordinates(pp=p, dp=k.dp, cp=c, atp=a))
            for p in range(self.pp)
            for c in range(self.cp)
            for a in range(self.atp)
        )
        return Group("domain", tuple(ranks))

    def domains(self) -> list[Group]:
        """Every agreement domain of the world, ordered by lowest rank."""
        seen: dict[tuple[int, ...], Group] = {}
        for rank in range(self.world_size):
            group = self.domain(rank)
            seen.setdefault(group.ranks, group)
        return sorted(seen.values(), key=lambda g: g.ranks)

    def grid_groups(self, rank: int) -> list[Group]:
        """The groups `grid` mode reduces over in order, whose sequential
        reductions give the domain-wide one: attn_cp then attn_tp (then pp),
        deduplicated by rank set, size-1 groups skipped. Without an attention
        split (dp = cp = 1) attn_tp is the whole TP group and goes by `tp`."""
        no_attention_split = self.dp == 1 and self.cp == 1
        candidates = [
            self.attn_cp(rank),
            self.tp_group(rank) if no_attention_split else self.attn_tp(rank),
            self.pp_group(rank),
        ]
        chosen: list[Group] = []
        for group in candidates:
            if group.size > 1 and all(group.ranks != g.ranks for g in chosen):
                chosen.append(group)
        return chosen

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp} (attention tp={self.atp})"
