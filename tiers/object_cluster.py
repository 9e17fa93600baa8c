"""Multi-node steps on the object tier, the tier's half (a mixin of ObjectTier): a node commits its part, a node that
sees every part commits the step.  The protocol and the merge are tiers/cluster.py's; this is the public interface
a multi-writer step is written through: ``write_part`` (this node's files and part manifest), ``try_commit`` /
``wait_and_commit`` (the step, once every part is in), ``commit_cluster_step`` (both, as one node of a cluster),
``verify_parts`` (audit)."""
from __future__ import annotations

import dataclasses
import logging
import time

from flowcheck.errors import ClusterError, FlowcheckError, StepExistsError, StepIncompleteError, StepNotFoundError
from flowcheck.manifest import Manifest, ParentRef, parse
from flowcheck.state import Snapshot
from flowcheck.tiers.base import MANIFEST, Problem, step_dir
from flowcheck.tiers.cluster import NODES, POLL_MAX_S, body_of, merge, part_dir, part_manifest, placements
from flowcheck.tiers.object_write import attempt_dir

log = logging.getLogger(__name__)


class ObjectCluster:
    """The multi-writer half of ObjectTier (a mixin: it uses the tier's listing, exclusive create and signing)."""

    def commit_cluster_step(self, snapshot: Snapshot, parent: ParentRef | None) -> Manifest:
        """Commit this node's part of a step, then the step once every node's part is in.

        Returns the committed step manifest; StepIncompleteError if other nodes' parts are still
        missing after ``commit_wait_s`` (this node's part stays; the step commits when the last part
        lands, or GC removes it).
        """
        committed = self._committed_step(snapshot.step)
        if committed is not None:
            return self._check_member(committed, snapshot, parent)
        self.write_part(snapshot, parent)
        return self.wait_and_commit(snapshot.step)

    def write_part(self, snapshot: Snapshot, parent: ParentRef | None) -> Manifest | None:
        """Upload this node's files and commit its part manifest (exclusive create); the step itself is not committed
        here (``wait_and_commit`` does that here; a DCP save's coordinator commits it, flowcheck/dcp/parts.py).
        Returns the committed part (None in the odd case that a racing writer's create won and its part then vanished)."""
        step, node = snapshot.step, self.node
        existing = self._read_part(step, node)  # a retry after this node's commit of the step failed
        if existing is None:
            attempt = attempt_dir(part_dir(step, node))
            part = self.store_files(snapshot, parent, attempt)
            try:
                self.create_exclusive(part_manifest(step, node), part.to_bytes(), f"committing node {node}'s part")
                log.info("object self: node %s committed its part of step %d", node, step)
                return part
            except FileExistsError:
                existing = self._read_part(step, node)  # another writer with this node's name raced us
                if existing is not None and existing.files != part.files:  # equal: our own create, its answer lost
                    self.discard(attempt)  # the part that won names other files: ours are nobody's
        if existing is not None and not self._same_part(existing, snapshot, parent):
            raise StepExistsError(
                f"object self {self.url}: node {node}'s part of step {step} is already committed with other content "
                f"({part_manifest(step, node)}); a node writes each step once"
            )
        return existing

    def wait_and_commit(self, step: int) -> Manifest:
        """Commit the step as soon as every node's part is in, polling up to ``commit_wait_s``."""
        deadline = time.monotonic() + self.cluster.commit_wait_s
        delay = 0.05
        while True:
            m, missing = self.try_commit(step)
            if m is not None:
                self.publish_latest(step)
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise StepIncompleteError(
                    f"object self {self.url}: step {step}: expected the parts of nodes {self.cluster.nodes}, "
                    f"still missing {missing} after {self.cluster.commit_wait_s:g}s; the step stays uncommitted "
                    "(the last node to commit its part commits it; otherwise GC removes it)"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX_S)

    def try_commit(self, step: int) -> tuple[Manifest | None, list[str]]:
        """(the committed step manifest, []) — or (None, nodes whose parts are missing)."""
        committed = self._committed_step(step)
        if committed is not None:
            return committed, []
        expected = list(self.cluster.nodes)
        present = self._parts_present(step)
        stray = sorted(present - set(expected))
        if stray:
            raise ClusterError(
                f"object self {self.url}: step {step}: found parts of nodes {stray} that cluster.nodes {expected} does "
                "not list; every node of a cluster must have the same cluster.nodes"
            )
        missing = [n for n in expected if n not in present]
        if missing:
            return None, missing
        parts = {n: self._read_part(step, n) for n in expected}
        later = [s for s in self.steps() if s > step]
        if later:
            raise StepIncompleteError(
                f"object self {self.url}: step {step}: every part is in, but later step {later[0]} is already "
                "committed; committing this one now would fork the lineage, so it stays uncommitted (GC removes it)"
            )
        m = self.sign(merge(parts, cluster=self.cluster, parent=self._chain_parent(step)))
        try:
            self.create_exclusive(f"{step_dir(step)}/{MANIFEST}", m.to_bytes(), "committing the step manifest")
            log.info("object self: node %s committed step %d (%d nodes)", self.node, step, len(parts))
            return m, []
        except FileExistsError:
            winner = self._await_winner(step)
            return (self._check_winner(step, winner, m) if winner else None), []

    def _await_winner(self, step: int, timeout_s: float = 10.0) -> Manifest | None:
        """The manifest that beat ours: a store may refuse a conditional create (a concurrent one is in
        flight) a moment before the winner's object is readable. None if it never appears: the caller
        tries again, since the concurrent create may have failed."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            try:
                return self.manifest(step, fresh=True)
            except StepNotFoundError:
                if time.monotonic() >= deadline:
                    log.warning("object self: step %d: the create was refused but no manifest appeared in %gs; retrying",
                                step, timeout_s)
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _forget_step_listings(self, step: int) -> None:
        """Drop every cached listing under the step (fsspec's invalidate_cache(path) keeps the children's,
        so a part committed after ``nodes/<n>/`` was first listed would stay invisible)."""
        prefix = self._p(step_dir(step))
        self.fs.invalidate_cache(prefix)
        cache = getattr(self.fs, "dircache", None)
        if cache is not None:
            stripped = self.fs._strip_protocol(prefix).rstrip("/")
            for key in [k for k in list(cache) if k == stripped or k.startswith(stripped + "/")]:
                cache.pop(key, None)

    def _committed_step(self, step: int) -> Manifest | None:
        self._forget_step_listings(step)
        if not self._exists(f"{step_dir(step)}/{MANIFEST}"):
            return None
        return self.manifest(step, fresh=True)

    def _parts_present(self, step: int) -> set[str]:
        """Nodes whose part manifest of ``step`` is committed (one listing)."""
        pattern = self._p(f"{step_dir(step)}/{NODES}/*/{MANIFEST}")
        self._forget_step_listings(step)
        try:
            found = self.call("listing node parts", self.fs.glob, pattern)
        except FileNotFoundError:
            return set()
        return {p.rstrip("/").split("/")[-2] for p in found}

    def _read_part(self, step: int, node: str) -> Manifest | None:
        rel = part_manifest(step, node)
        try:
            raw = self.read_bytes(rel, f"reading node {node}'s part manifest")
        except FileNotFoundError:
            return None
        m = parse(raw, f"object self {self.url}/{rel}")
        self.check_signature(m)
        if (m.run, m.step, m.producer.node) != (self.run, step, node):
            raise ClusterError(
                f"object self {self.url}/{rel}: expected node {node}'s part of {self.run} step {step}, "
                f"found node {m.producer.node!r}'s part of {m.run} step {m.step}"
            )
        return m

    def _chain_parent(self, step: int) -> ParentRef | None:
        """The step chain: a step's parent is the newest committed step before it on its branch in this self,
        or, for a branch's first step, this self's state at the branch's fork point."""
        earlier = [s for s in self.steps() if s < step]
        if earlier:
            return self.manifest(earlier[-1], check_signature=False).parent_ref()
        record = self.branch_record()
        if record is None or record.fork is None:
            return None
        fork = record.fork
        if fork.branch is not None:
            holder = self if fork.branch == self.branch else self.at_branch(fork.branch)
            if fork.step in holder.steps():
                return holder.manifest(fork.step, check_signature=False).parent_ref()
        return ParentRef(fork.step, fork.manifest_digest)

    def _check_winner(self, step: int, winner: Manifest, ours: Manifest) -> Manifest:
        """Another node created the step manifest first: it must be the manifest we computed."""
        if body_of(winner) != body_of(ours):
            raise ClusterError(
                f"object self {self.url}: step {step} was committed by another node with a manifest other than the one "
                f"node {self.node} computed from the same parts (digest {winner.digest()} vs {ours.digest()}); "
                "check that every node runs the same flowcheck and cluster config, then run `flowcheck audit`"
            )
        if winner.parent != ours.parent:  # a step before this one committed between the two attempts
            log.warning("object self: step %d: the committed parent %s differs from node %s's view %s",
                        step, winner.parent, self.node, ours.parent)
        return winner

    def _same_part(self, part: Manifest, snapshot: Snapshot, parent: ParentRef | None) -> bool:
        """Whether a stored part holds this snapshot (a fresh write differs from it only in its time)."""
        ours = self.identity(snapshot, parent)[1]
        return dataclasses.replace(ours, created_at=part.created_at).digest() == part.digest()

    def _check_member(self, committed: Manifest, snapshot: Snapshot, parent: ParentRef | None) -> Manifest:
        """The step is already committed (a retry): it must list this node's part, holding this snapshot."""
        listed = {n.node: n.manifest_digest for n in committed.nodes}
        part = self._read_part(snapshot.step, self.node) if self.node in listed else None
        if part is None or part.digest() != listed[self.node] or not self._same_part(part, snapshot, parent):
            raise StepExistsError(
                f"object self {self.url}: step {snapshot.step} is already committed "
                f"{'without a part of' if self.node not in listed else 'with another part of'} node {self.node}"
            )
        return committed

    def verify_parts(self, m: Manifest) -> list[Problem]:
        """Each listed part manifest: present, intact, of the digest the step lists, and merged as stored."""
        problems: list[Problem] = []
        merged = placements(m)
        from_parts: set[tuple] = set()
        for ref in m.nodes:
            rel = part_manifest(m.step, ref.node)
            try:
                part = self._read_part(m.step, ref.node)
            except FlowcheckError as e:
                problems.append(Problem(self.name, m.step, f"node {ref.node}: {e}", rel))
                continue
            if part is None:
                problems.append(Problem(self.name, m.step, f"node {ref.node}: part manifest listed by the step is missing", rel))
                continue
            if part.digest() != ref.manifest_digest:
                problems.append(Problem(self.name, m.step, f"node {ref.node}: part manifest digest {part.digest()} != "
                                        f"step manifest's {ref.manifest_digest}", rel))
                continue
            placed = placements(part)
            if not placed <= merged or not set(part.files) <= set(m.files):
                problems.append(Problem(self.name, m.step, f"node {ref.node}: the step manifest does not hold this part's "
                                        "shards and files as the part records them", rel))
            from_parts |= placed
        if not problems and from_parts != merged:
            problems.append(Problem(self.name, m.step, f"{len(merged - from_parts)} shard(s) of the step manifest belong "
                                    "to no node part", MANIFEST))
        return problems
