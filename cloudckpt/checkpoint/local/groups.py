"""Which ranks hold copies of which rank's part: nvidia-resiliency-ext's clique groups.

Ranks are numbered node by node, ``jump`` ranks per node (failure domain). Ranks are
cut into blocks of ``jump * factor`` consecutive ranks; inside a block, group ``i``
is ``{start + i + k * jump : k < factor}``: one rank on each of ``factor`` different
nodes. Every member of a group holds the part of every other member, so a group
survives the loss of ``factor - 1`` of its nodes.

    world 4, jump 2, factor 2: nodes {0, 1} {2, 3}; groups {0, 2} {1, 3}
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError


@dataclass(frozen=True)
class Replication:
    world_size: int
    factor: int
    jump: int

    def __post_init__(self) -> None:
        w, f, j = self.world_size, self.factor, self.jump
        if not isinstance(f, int) or f < 1:
            raise ConfigError(f"replication_factor={f!r} is not allowed: use 1 (no copies) or more")
        if not isinstance(j, int) or j < 1:
            raise ConfigError(f"replication_jump={j!r} is not allowed: use the number of ranks per node (>= 1)")
        if w % j:
            raise ConfigError(f"replication_jump={j} does not divide the world size {w}: set it to the number of ranks "
                              "per node (LOCAL_WORLD_SIZE by default)")
        nodes = w // j
        if f > nodes:
            raise ConfigError(f"replication_factor={f} is larger than the number of nodes ({nodes} = world size {w} / "
                              f"replication_jump {j}): a part cannot have {f} copies on different nodes; use <= {nodes}")
        if w % (j * f):
            raise ConfigError(f"the world size {w} is not divisible by replication_jump x replication_factor "
                              f"({j} x {f}): use a factor that divides the number of nodes ({nodes})")

    @property
    def nodes(self) -> int:
        return self.world_size // self.jump

    def node_of(self, rank: int) -> int:
        return rank // self.jump

    def group_of(self, rank: int) -> tuple[int, ...]:
        block = rank - rank % (self.jump * self.factor)
        i = (rank - block) % self.jump
        return tuple(block + i + k * self.jump for k in range(self.factor))

    def groups(self) -> list[tuple[int, ...]]:
        seen, out = set(), []
        for r in range(self.world_size):
            g = self.group_of(r)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    def transfers(self) -> list[tuple[int, int]]:
        """Every ``(source, destination)`` copy of one step's replication, in one order
        all ranks agree on."""
        return sorted((s, d) for g in self.groups() for s in g for d in g if s != d)
