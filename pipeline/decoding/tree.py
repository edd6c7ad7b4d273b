"""Token-tree speculative decoding (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024), lossless at every
temperature (docs/architecture.md, "The decoder"). Both caches keep exactly the accepted path, gathered along the
sequence (tree slots are not in order, so a crop cannot do it); the draft feeds only nodes with children, so it
lacks one or two tokens after a step, as on the chain.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import DynamicCache

from pipeline.decoding import tree_sampling
from pipeline.decoding.loop import DecodeStats, Pair, Profile, additive_mask, check_mask_attention, crop, forward
from pipeline.errors import PipelineError
from pipeline.heads import scatter_to_vocab

MAX_TREE_NODES = 64  # the target verifies every node in one forward; past this a pass costs like a prefill


@dataclass(frozen=True)
class Tree:
    """A static token tree in breadth-first order: depths non-decreasing, parents[i] < i, −1 = root.
    Siblings keep their relative order, which is their draw order (first child = first draw)."""
    parents: tuple[int, ...]

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        return self.depths[-1] if self.parents else 0

    def truncated(self, max_depth: int) -> "Tree":
        """The nodes up to max_depth (a prefix, by breadth-first order)."""
        return Tree(self.parents[:sum(d <= max_depth for d in self.depths)])


@dataclass
class TreeStats(DecodeStats):
    """DecodeStats of a tree decode: `accepted` is the accepted path's depth, `drafted` the tree's nodes."""
    depths: list[int] = field(default_factory=list)  # depth of the (max_new_tokens-truncated) tree per pass

    @property
    def per_depth_acceptance(self) -> list[float]:
        """[d] = P(the path reaches depth d+1 | it reached depth d and the tree has depth d+1)."""
        rates = []
        for d in range(max(self.depths, default=0)):
            reached = [a for a, depth in zip(self.accepted, self.depths) if a >= d and depth > d]
            rates.append(sum(a > d for a in reached) / len(reached) if reached else 0.0)
        return rates


def nodes(factors: tuple) -> int:
    """Nodes of the tree with these branching factors per depth (a chain of γ: γ)."""
    return len(_branching_parents(tuple(factors)))


def tree_key(factors) -> str:
    """The key of a tree's branching factors in speculative.json's `tree_candidates` ("3,2,1")."""
    return ",".join(map(str, factors))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _too_many(n: int) -> PipelineError:
    return PipelineError(f"the tree has {n} nodes, more than the cap of {MAX_TREE_NODES}: use a smaller tree")


def _branching_parents(factors: tuple) -> list[int]:
    if not factors or not all(_is_int(f) and f >= 1 for f in factors):
        raise PipelineError(f"tree branching factors must be integers >= 1, got {factors}: use e.g. (3, 2, 1)")
    parents, level = [], [-1]
    for factor in factors:
        if len(parents) + len(level) * factor > MAX_TREE_NODES:
            raise _too_many(len(parents) + len(level) * factor)
        nodes = list(range(len(parents), len(parents) + len(level) * factor))
        parents += [parent for parent in level for _ in range(factor)]
        level = nodes
    return parents


def _checked_parents(parents: list) -> list[int]:
    if not parents:
        raise PipelineError("the tree's parent list is empty: give at least one node, e.g. [-1]")
    for i, parent in enumerate(parents):
        if not _is_int(parent) or not -1 <= parent < i:
            raise PipelineError(f"the parent list is not a tree: parents[{i}] = {parent!r} must be an integer in "
                                f"[-1, {i}) (−1 = root, else an earlier node): list every node after its parent")
    if len(parents) > MAX_TREE_NODES:
        raise _too_many(len(parents))
    return list(parents)


def parse_tree(tree) -> Tree:
    """A Tree from a tuple of branching factors per depth or a list of parent indices (any static tree)."""
    if isinstance(tree, Tree):
        return tree
    if isinstance(tree, tuple):
        parents = _branching_parents(tree)
    elif isinstance(tree, list):
        parents = _checked_parents(tree)
    else:
        raise PipelineError(f"tree must be a tuple of branching factors or a list of parent indices, got "
                            f"{type(tree).__name__}: use e.g. (3, 2, 1) or [-1, -1, 0]")
    depths = Tree(tuple(parents)).depths
    order = sorted(range(len(parents)), key=lambda i: (depths[i], i))  # stable: siblings keep draw order
    new = {old: i for i, old in enumerate(order)}
    return Tree(tuple(-1 if parents[old] < 0 else new[parents[old]] for old in order))


def children_of(tree: Tree) -> list[list[int]]:
    """Node indices of each slot's children, in draw order (slot 0 = root, slot i+1 = node i)."""
    kids: list[list[int]] = [[] for _ in range(len(tree.parents) + 1)]
    for i, parent in enumerate(tree.parents):
        kids[parent + 1].append(i)
    return kids


class TreePlan:
    """Device-side index tables of one tree. Slot 0 is the root, slot i+1 is node i."""

    def __init__(self, tree: Tree, device: torch.device):
        n, parents, depths = len(tree.parents), tree.parents, tree.depths
        self.n, self.depth = n, tree.depth
        kids = [[i + 1 for i in nodes] for nodes in children_of(tree)]  # as slots
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(parents):
            if parent >= 0:
                ancestors[i] = ancestors[parent]
            ancestors[i, i] = True
        width = max(1, *map(len, kids))
        children = torch.full((n + 1, width), -1, dtype=torch.long)
        for slot, slots in enumerate(kids):
            children[slot, :len(slots)] = torch.tensor(slots, dtype=torch.long)
        fed = [i for i in range(n) if kids[i + 1]]  # the nodes the draft feeds: those with children
        self.fed_position = {node: k for k, node in enumerate(fed)}
        self.frontier = [[0]] + [[i + 1 for i in fed if depths[i] == d] for d in range(1, self.depth)]
        self.widths = [max(len(kids[s]) for s in slots) for slots in self.frontier]
        self.visible = [None] + [ancestors[[s - 1 for s in slots]][:, fed[:sum(depths[i] <= d for i in fed)]]
                                 for d, slots in enumerate(self.frontier[1:], 1)]
        self.assign = [self._assignments(children, slots, w) for slots, w in zip(self.frontier, self.widths)]
        to = dict(device=device)
        self.children, self.ancestors = children.to(**to), ancestors.to(**to)
        self.depths = torch.tensor(depths, dtype=torch.long, **to)
        self.frontier = [torch.tensor(slots, **to) for slots in self.frontier]
        self.visible = [None if v is None else v.to(**to) for v in self.visible]
        self.assign = [tuple(t.to(**to) for t in a) for a in self.assign]

    @staticmethod
    def _assignments(children: torch.Tensor, slots: list[int], width: int):
        """(child slots, frontier rows, ranks) of the children proposed from the frontier `slots`."""
        table = children[slots, :width]
        rows, ranks = (table >= 0).nonzero(as_tuple=True)
        return table[rows, ranks], rows, ranks


def tree_mask(n_cached: int, n_pending: int, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask [1, 1, P + R, n_cached + P + M] for P pending committed tokens (causal) followed by
    R tree nodes that see every committed token and, among the M tree slots, what `visible` [R, M] allows
    (their ancestors and themselves)."""
    rows, slots = visible.shape
    width = n_cached + n_pending
    allowed = torch.zeros(n_pending + rows, width + slots, dtype=torch.bool, device=visible.device)
    allowed[:n_pending, :width] = torch.ones(n_pending, width, dtype=torch.bool, device=visible.device).tril(n_cached)
    allowed[n_pending:, :width] = True
    allowed[n_pending:, width:] = visible
    return additive_mask(allowed, dtype).view(1, 1, *allowed.shape)


def keep_path(cache: DynamicCache, committed: int, positions: list[int]) -> None:
    """Keeps the first `committed` cached tokens and then those at `positions` (ascending): a gather along
    the sequence dim of each layer's keys and values, then a crop of the rest."""
    n = len(positions)
    if n and positions != list(range(committed, committed + n)):
        index = torch.tensor(positions, device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys[..., committed:committed + n, :] = layer.keys.index_select(-2, index)
            layer.values[..., committed:committed + n, :] = layer.values.index_select(-2, index)
    crop(cache, committed + n)


def _propose(pair: Pair, logits: torch.Tensor, width: int):
    """Children (target ids [R, width], in draw order), their validity and q [R, K] (None for a greedy draft,
    whose children are its top-`width` tokens)."""
    if pair.q.greedy:
        index = logits.topk(width, -1).indices
        valid, q = torch.ones_like(index, dtype=torch.bool), None
    else:
        q = pair.q.probs(logits)  # exactly the distribution the children are drawn from
        index, valid = tree_sampling.draw_without_replacement(q, width, pair.generator)
    return (index if pair.draft_vocab is None else pair.draft_vocab[index]), valid, q


def _draft_tree(pair: Pair, seq: torch.Tensor, cache: DynamicCache, plan: TreePlan, profile: Profile):
    """Every node's token, one draft forward per depth: tokens [N+1] (slot 0 = root), valid [N+1], the
    distributions q [N+1, K] each slot's children were drawn from (None for a greedy draft)."""
    committed = seq.shape[1]
    tokens, valid = seq.new_zeros(plan.n + 1), torch.ones(plan.n + 1, dtype=torch.bool, device=seq.device)
    qs = None
    with profile.part("draft"):
        logits = forward(pair.draft, seq[:, cache.get_seq_length():], cache, pair.draft_head)
    for depth in range(plan.depth):
        with profile.part("sampling"):
            children, rows, ranks = plan.assign[depth]
            ids, ok, q = _propose(pair, logits, plan.widths[depth])
            tokens[children], valid[children] = ids[rows, ranks], ok[rows, ranks]
            if q is not None:
                qs = q.new_zeros(plan.n + 1, q.shape[-1]) if qs is None else qs
                qs[plan.frontier[depth]] = q
        if depth + 1 < plan.depth:
            with profile.part("draft"):
                nodes = plan.frontier[depth + 1]
                mask = tree_mask(committed, 0, plan.visible[depth + 1], pair.draft.dtype)
                positions = torch.full_like(nodes, committed + depth).view(1, -1)  # root at committed − 1, d at +d
                logits = forward(pair.draft, tokens[nodes].view(1, -1), cache, pair.draft_head, len(nodes), mask,
                                 positions)
    return tokens, valid, qs


def _verify_tree(pair: Pair, plan: TreePlan, logits, tokens, valid, qs) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted child slot per slot [N+1], −1 when none; the slot's token when none is accepted [N+1])."""
    kids = plan.children.clamp_min(0)
    child_tokens, child_valid = tokens[kids], (plan.children >= 0) & valid[kids]
    if pair.greedy:
        rank, fallback = tree_sampling.greedy_verify_siblings(logits.argmax(-1), child_tokens, child_valid)
    else:
        p = pair.p.probs(logits)
        q = None if qs is None else scatter_to_vocab(qs, pair.draft_vocab, p.shape[-1])
        rank, fallback = tree_sampling.verify_siblings(p, q, child_tokens, child_valid, pair.generator,
                                                       draft_greedy=pair.q.greedy)
    child = plan.children.gather(1, rank.clamp_min(0).view(-1, 1)).view(-1)
    return torch.where(rank >= 0, child, torch.full_like(child, -1)), fallback


def _walk(result: list[int], n: int) -> tuple[list[int], int]:
    """The accepted path (slots) from the root and the token after it, from the host copy of _verify_tree."""
    accepted, fallback = result[:n + 1], result[n + 1:2 * n + 2]
    slot, path = 0, []
    while accepted[slot] >= 0:
        slot = accepted[slot]
        path.append(slot)
    return path, fallback[slot]


def tree_step(pair: Pair, seq: torch.Tensor, caches: tuple[DynamicCache, DynamicCache], plan: TreePlan,
              stats: TreeStats, profile: Profile) -> tuple[torch.Tensor, list[int]]:
    """Drafts the tree, verifies it in one target pass, keeps the accepted path in both caches.
    seq [1, C] holds every committed token. Returns the extended seq and the new ids."""
    target_cache, draft_cache = caches
    committed = seq.shape[1]
    tokens, valid, qs = _draft_tree(pair, seq, draft_cache, plan, profile)
    with profile.part("target"):  # the committed tokens the target has not seen and every node: logits [N+1, V]
        cached = target_cache.get_seq_length()
        ids = torch.cat([seq[0, cached:], tokens[1:]]).view(1, -1)
        positions = torch.cat([torch.arange(cached, committed, device=seq.device), committed - 1 + plan.depths])
        mask = tree_mask(cached, committed - cached, plan.ancestors, pair.target.dtype)
        logits = forward(pair.target, ids, target_cache, pair.target_head, plan.n + 1, mask, positions.view(1, -1))
    with profile.part("sampling"):
        accepted, fallback = _verify_tree(pair, plan, logits, tokens, valid, qs)
        result = torch.cat([accepted, fallback, tokens]).tolist()  # the one host sync of the step
    with profile.part("cache"):
        path, next_token = _walk(result, plan.n)
        new_tokens = [result[2 * plan.n + 2 + slot] for slot in path] + [next_token]
        seq = torch.cat([seq, torch.tensor(new_tokens, device=seq.device).view(1, -1)], 1)
        keep_path(target_cache, committed, [committed + slot - 1 for slot in path])
        fed = [plan.fed_position[slot - 1] for slot in path if slot - 1 in plan.fed_position]
        keep_path(draft_cache, committed, [committed + k for k in fed])
    stats.accepted.append(len(path))
    stats.drafted.append(plan.n)
    stats.depths.append(plan.depth)
    stats.target_passes += 1
    return seq, new_tokens


def check_tree(tree: Tree, pair: Pair) -> None:
    """One-line errors for a tree these models cannot run."""
    check_mask_attention("tree speculation", target=pair.target, draft=pair.draft)
    rows, width = pair.draft_head[0].shape[0], max(map(len, children_of(tree)))
    if width > rows:
        raise PipelineError(f"the tree gives a node {width} children but the draft proposes from only {rows} "
                            "tokens (draft_vocab): use a narrower tree")
