"""Which ranks hold copies of which rank's part: nvidia-resiliency-ext's clique groups.

Ranks are numbered node by node, ``jump`` ranks per node (failure domain). Ranks are
cut into blocks of ``jump * factor`` consecutive ranks; inside a block, group ``i``
is ``{start + i + k * jump : k < factor}``: one rank on each of ``factor`` different
nodes. Every member of a group holds the part of every other member, so a group
survives the loss of ``factor - 1`` of its nodes.

    world 4, jump 2, factor 2: nodes {0, 1} {2, 3}; groups {0, 2} {1, 3}

The node (machine) of a rank is ``rank // per_node``, ``per_node`` being the ranks
each machine runs (torchrun's ``LOCAL_WORLD_SIZE``): it names the machine's folder
(``{node}`` in ``local_dir``) and which copies a rank can link instead of fetch. It
does not depend on ``jump``, which may span several machines (a rack): a jump of 16
with 8 ranks per machine keeps machines 0 and 1 apart in their folders and puts a
part's copies on another rack. ``jump`` must be a multiple of ``per_node``, or a
failure domain would cut a machine in two and a part's copies could share it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ...errors import ConfigError


@dataclass(frozen=True)
class Replication:
    world_size: int
    factor: int
    jump: int
    per_node: int = 0  # ranks per machine; 0: ``jump`` (one machine per failure domain)

    def __post_init__(self) -> None:
        if self.per_node == 0:
            object.__setattr__(self, "per_node", self.jump)
        w, f, j, m = self.world_size, self.factor, self.jump, self.per_node
        if not isinstance(f, int) or f < 1:
            raise ConfigError(f"replication_factor={f!r} is not allowed: use 1 (no copies) or more")
        if not isinstance(j, int) or j < 1:
            raise ConfigError(f"replication_jump={j!r} is not allowed: use the number of ranks per node (>= 1)")
        if w % j:
            raise ConfigError(f"replication_jump={j} does not divide the world size {w}: set it to the number of ranks "
                              "per node (LOCAL_WORLD_SIZE by default)")
        if not isinstance(m, int) or m < 1 or w % m:
            raise ConfigError(f"{m!r} ranks per node (LOCAL_WORLD_SIZE) does not divide the world size {w}: the local "
                              "tier needs the same number of ranks on every node")
        if j % m:
            raise ConfigError(f"replication_jump={j} is not a multiple of the ranks per node ({m}, LOCAL_WORLD_SIZE): "
                              "a failure domain would cut a node in two, and copies of a part could land on the node "
                              f"that holds it; use {m} (one node) or a multiple of it (a rack)")
        nodes = w // j
        if f > nodes:
            raise ConfigError(f"replication_factor={f} is larger than the number of failure domains (nodes, or "
                              f"racks: {nodes} = world size {w} / replication_jump {j}): a part cannot have {f} "
                              f"copies on different nodes; use <= {nodes}")
        if w % (j * f):
            raise ConfigError(f"the world size {w} is not divisible by replication_jump x replication_factor "
                              f"({j} x {f}): use a factor that divides the number of nodes ({nodes})")

    @property
    def domains(self) -> int:
        """Failure domains (``world_size / jump``)."""
        return self.world_size // self.jump

    def node_of(self, rank: int) -> int:
        """The machine ``rank`` runs on (ranks are numbered machine by machine)."""
        return rank // self.per_node

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


def on_machines(rep: Replication, environ=os.environ) -> Replication:
    """``rep`` with ``per_node`` from ``LOCAL_WORLD_SIZE`` (set by torchrun and most
    launchers: the ranks of this machine); unset: ``rep`` as it is (one machine per
    failure domain, ``per_node = jump``)."""
    raw = environ.get("LOCAL_WORLD_SIZE", "")
    if not raw:
        return rep
    try:
        per_node = int(raw)
    except ValueError:
        per_node = -1
    if per_node < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE={raw[:40]!r} is not a number of ranks per node: the local tier needs it "
                          "to tell which ranks share a node (unset it to use one node per replication_jump ranks)")
    return replace(rep, per_node=per_node)
