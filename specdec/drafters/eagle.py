"""EAGLE drafting: the head (`eagle_head.EagleHead`) runs autoregressively on the target's features and its
own, and its guesses form a chain, a static tree or EAGLE-2's dynamic tree, verified in one target forward.
Papers: EAGLE (arXiv 2401.15077), EAGLE-2 (2406.16858), EAGLE-3 (2503.01840); the lesson, Ch. 5.

Keeping in step. The loop hands over the aux-layer features of every newly committed position
(`Context.features`: the prompt's at prefill, the root's and the accepted path's after each verify). The
head's own KV cache holds one entry per committed position t: (f_t, x_{t+1}) at RoPE position t. With the
root r = x_c not yet run by the target, the newest entry (f_{c-1}, r) already predicts the token after the
root: the first draft depth costs no head forward. Draft entries written while building a tree are dropped
at the end of `propose` (rollback is truncation to the committed length, as for the target's cache).

EAGLE-2 dynamic tree (`tree="dynamic"`; the default where verifying is wide, `auto_tree`). Every drafted
node carries its cumulative draft log-probability (its path's sum). Depth by depth, the `topk` best nodes of
the newest depth are expanded in one head forward (each sees the committed entries, its ancestors and
itself: a tree mask), each proposing its `topk` best children; then all drafted nodes are reranked and the
best N kept. Scores fall along a path, so the best N always include each node's ancestors. Example, topk 2,
N 4: root children a (-0.1), b (-1.2); expanding a and b gives aa (-0.3), ab (-2.0), ba (-1.5), bb (-3.0);
the draft is a, aa, b, ba.
Static tree: Medusa-style rank paths (`medusa.calibrated_paths` over a prior of acceptance by rank), the
same per-depth expansion. Chain: the top token per depth (greedy), or, under sampling, a token drawn from
the draft distribution q per depth.

Exactness. Tree siblings are distinct tokens of a deterministic choice (top ranks), so trees go out with
q = None and the verifier's multi-candidate rule keeps greedy output equal to plain decoding and sampled
output distributed as plain sampling (q from the softmax would be wrong here: top-k picks are not draws
from q). The sampled chain carries q: the draft softmax over the draft vocabulary mapped into the target
vocabulary, 0 for tokens outside it, which are never drafted.
"""

from __future__ import annotations

import copy

import torch

from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter
from specdec.drafters.eagle_head import EagleHead
from specdec.drafters.medusa import TreeLayout, calibrated_paths, chain
from specdec.errors import SpecdecError
from specdec.options import check_tree
from specdec.runtime import kernels
from specdec.runtime.kernels import quant
from specdec.runtime.config import ModelConfig
from specdec.sampling import probs_from_logits, sample

KIND = "eagle"
TREES = ("dynamic", "static", "chain")
DEPTH = 6          # deepest draft (EAGLE-2's default depth)
TOPK = 8           # children per expanded node and nodes expanded per depth (EAGLE-2 uses 10 on GPUs)
MIN_NODES = 4      # the smallest tree the probe's budget may choose
STATIC_PRIOR = [0.6, 0.15, 0.08, 0.05, 0.03]  # static tree: assumed acceptance of a node by its rank


def top_logprobs(logits: torch.Tensor, n: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best log-probabilities of logits [.., Vd] and their indices, per row (topk less the logsumexp: no
    full log-softmax over the draft vocabulary). `normalize=False` returns the raw logits, same order: a
    static tree or chain ranks children and never compares scores across parents (the logsumexp cost about
    0.1 ms a round, a sixth of a SmolLM2 head forward, on a Zen 4)."""
    top = logits.topk(min(n, logits.shape[-1]))
    return (top.values - logits.logsumexp(-1, keepdim=True) if normalize else top.values), top.indices


class Eagle(Drafter):
    """Drafts from an EAGLE head. `embed`: the target's token embedding (a module, token ids -> [.., D])."""

    name = KIND
    tau_prior = 0.1

    def __init__(self, head: EagleHead, embed, tree: str = "dynamic", nodes: int = 16, depth: int = DEPTH,
                 topk: int = TOPK, prior_alpha: float = 0.6, path: str | None = None):
        if tree not in TREES:
            raise ValueError(f"EAGLE tree must be one of {', '.join(TREES)}, got {tree!r}")
        if nodes < 1:
            raise ValueError(f"tree nodes must be at least 1, got {nodes}")
        self.head, self.embed, self.tree = head.float().eval(), embed, tree
        if path:  # quantized or bf16 weights through specdec's kernels (`EagleHead.use_kernel`)
            self.head.use_kernel(path)
        self.wants_hidden_layers = head.cfg.aux_layers
        self.deterministic = tree != "chain"
        self.topk = max(1, min(topk, nodes))
        self.budget = nodes
        self.prior_alpha = prior_alpha
        if tree == "dynamic":
            self.k_max = depth
            self.layout = None
        else:
            paths = chain(min(depth, nodes)) if tree == "chain" else calibrated_paths(
                [STATIC_PRIOR] * depth, nodes)
            self.layout = TreeLayout(paths)
            self.paths = set(paths)
            self.k_max = self.layout.max_depth
        self.cache = None
        self.root: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits [Vd], hidden [D]) after the root
        self.stale = False
        self._vocab_ids = head.to_target(torch.arange(head.cfg.draft_vocab_size))

    def nodes(self, k: int) -> int:
        """Draft positions of a round of depth k."""
        if self.layout is not None:
            return self.layout.size[min(k, self.k_max)]
        k = min(k, self.k_max)
        return min(self.budget, self.topk + max(k - 1, 0) * self.topk * self.topk) if k > 0 else 0

    room = nodes

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.root = None

    def fresh(self) -> "Eagle":
        """Another request's drafter on the same head and settings (the server's, one per request): its own
        head cache and root, the head's weights shared."""
        other = copy.copy(self)
        other.cache, other.root, other.stale = None, None, False
        return other

    @torch.inference_mode()
    def _emb(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(self._vocab_ids[draft_ids]).float()

    @torch.inference_mode()
    def _ingest(self, ctx: Context) -> None:
        """Feed the head the committed positions whose features arrived since the last proposal."""
        start, rows = ctx.take_features()
        if rows is None:
            return
        m = len(rows)
        slots = len(ctx.tokens) + ctx.remaining + self.k_max * max(self.topk, self.budget)  # + a tree's entries
        if self.cache is None:
            self.cache = self.head.new_cache(slots)
        if self.cache.length != start:
            raise RuntimeError(f"EAGLE: features start at position {start}, the head holds {self.cache.length}")
        self.cache.grow(slots)  # once per request at most: the context plus what it may still commit is fixed
        tokens = torch.tensor(ctx.tokens[start + 1:start + m + 1])
        emb = self.embed(tokens).float()
        logits, h = self.head(emb[None], self.head.fuse(rows.float())[None], torch.arange(start, start + m)[None],
                              self.cache)
        self.root = logits[0, -1], h[0, -1]
        self.stale = m > 2  # catching up after plain steps: this round's time is not the draft's tau

    def propose(self, ctx: Context, k: int) -> Draft:
        self._ingest(ctx)
        if self.root is None or k <= 0:  # nothing committed with features yet (a one-token prompt)
            return Draft.empty()
        committed = self.cache.length
        try:
            if self.tree == "chain" and not ctx.sampling.greedy:
                return self._sampled_chain(ctx, min(k, self.k_max))
            return self._tree(min(k, self.k_max))
        finally:
            self.cache.rewind(self.cache.length - committed)

    @torch.inference_mode()
    def _step(self, tokens: list[int], hidden: torch.Tensor, position: int, seen: list[list[int]]):
        """One head forward over F draft entries (draft ids `tokens`, hidden [F, D]) at one position, written
        after the cache's content: entry i sees the committed entries and the slots seen[i] (its ancestors
        and itself). Returns logits [F, Vd], hidden [F, D]."""
        start, f = self.cache.length, len(tokens)
        mask = torch.zeros(1, f, start + f, dtype=torch.bool)
        mask[0, :, :self.committed] = True
        for i, slots in enumerate(seen):
            mask[0, i, slots] = True
        logits, h = self.head(self._emb(torch.tensor(tokens))[None], hidden[None], torch.full((1, f), position),
                              self.cache, mask)
        return logits[0], h[0]

    def _tree(self, depth: int) -> Draft:
        """A dynamic or static tree `depth` deep (see the module docstring)."""
        self.committed = self.cache.length
        dynamic = self.layout is None
        ranks = self.topk if dynamic else self.layout.ranks
        # the pool of drafted nodes, parents first: draft token, parent (-1: the root), score, rank path
        tok, par, score, path = [], [], [], []
        slot, hid = {}, {-1: self.root[1]}  # expanded nodes: head-cache slot, output hidden

        def add_children(parents: list[int], logits: torch.Tensor) -> list[int]:
            """The best `ranks` children of each parent (logits [len(parents), Vd]: one topk for them all)."""
            values, ids = top_logprobs(logits, ranks, normalize=dynamic)
            new = []
            for parent, vs, ts in zip(parents, values.tolist(), ids.tolist()):
                above, prefix = (score[parent], path[parent]) if parent >= 0 else (0.0, ())
                for r, (v, t) in enumerate(zip(vs, ts)):
                    if dynamic or prefix + (r,) in self.paths:
                        new.append(len(tok))
                        tok.append(t), par.append(parent), score.append(above + v), path.append(prefix + (r,))
            return new

        def ancestors(i: int) -> list[int]:
            out, j = [], par[i]
            while j >= 0:
                out.append(slot[j])
                j = par[j]
            return out

        level = add_children([-1], self.root[0][None])
        for d in range(1, depth):
            if dynamic:  # EAGLE-2: expand the best nodes of the newest depth
                grow = sorted(level, key=lambda i: -score[i])[:self.topk]
            else:        # static: the nodes the layout gives children
                grow = [i for i in level if any(path[i] + (r,) in self.paths for r in range(ranks))]
            if not grow:
                break
            base = self.cache.length
            logits, h = self._step([tok[i] for i in grow], torch.stack([hid[par[i]] for i in grow]),
                                   self.committed + d - 1, [ancestors(i) + [base + n] for n, i in enumerate(grow)])
            for n, i in enumerate(grow):
                slot[i], hid[i] = base + n, h[n]
            level = add_children(grow, logits)
        keep = list(range(len(tok)))
        if dynamic and len(keep) > self.budget:  # rerank: the best N by score (ties: parents, drafted first)
            order = torch.sort(torch.tensor(score), descending=True, stable=True).indices[:self.budget]
            keep = sorted(order.tolist())
        index = {i: n for n, i in enumerate(keep)}
        tokens = self._vocab_ids[torch.tensor([tok[i] for i in keep])]
        return Draft(tokens, torch.tensor([index[par[i]] if par[i] >= 0 else -1 for i in keep]))

    def _sampled_chain(self, ctx: Context, depth: int) -> Draft:
        """Under sampling: one token per depth drawn from q, the draft's distribution (with the request's
        temperature, top-k, top-p), carried in target-vocabulary rows for exact verification."""
        self.committed = self.cache.length
        logits, h = self.root
        tokens, qs, slots = [], [], []
        for d in range(depth):
            q = probs_from_logits(logits.float(), ctx.sampling)
            t = int(sample(q, ctx.generator))
            tokens.append(t), qs.append(q)
            if d + 1 < depth:
                slots.append(self.cache.length)
                out, hs = self._step([t], h[None], self.committed + d, [list(slots)])
                logits, h = out[0], hs[0]
        q = torch.zeros(depth, self.head.cfg.vocab_size)
        q[:, self._vocab_ids] = torch.stack(qs)
        return Draft.chain(self._vocab_ids[torch.tensor(tokens)], q)


def find_head(name: str, folder, target: ModelConfig, heads_dir: str | None = None) -> EagleHead:
    """The EAGLE head for the target `name` (model folder, config): `--heads DIR` (ours or a published EAGLE-3
    folder), else the store's, else the package's; refused with one line when built for another target."""
    from specdec.training import heads as store

    found = store.find(name, KIND, heads_dir)
    head = EagleHead.load(found, target.num_layers)
    head.cfg.check_target(target, name, store.target_fingerprint(folder, head.cfg.target_fingerprint))
    return head


def auto_tree(budget: int) -> str:
    """`--tree auto`: EAGLE-2's dynamic tree where one forward verifies more nodes than a chain holds (budget
    - 1 > DEPTH) for about the cost of one, else a chain. A tree of N nodes costs a head forward over up to
    TOPK nodes per depth and a verify over N; where N is a chain's length anyway, the chain drafts one node per
    head forward for the same verify. Measured (BENCHMARKS.md, session 7): SmolLM2 q4 on a Zen 5, budget 3,
    chain 1.14x plain, dynamic tree 0.96x on Spec-Bench. Example: budget 3 -> chain, 64 (a GPU) -> dynamic."""
    return "dynamic" if budget - 1 > DEPTH else "chain"


def build(llm, heads_dir: str | None = None, tree: str = "auto", tree_nodes: int | None = None) -> Eagle:
    """The EAGLE drafter for an `LLM`: tree 'auto' ('dynamic' when `tree_nodes` is given, else `auto_tree` of
    the probe's budget), 'dynamic' (EAGLE-2), 'static' or 'chain'; N nodes = `tree_nodes`, else the positions
    one forward evaluates for about the cost of one (`specdec probe`), less the root, at least MIN_NODES (for a
    chain: its depth, at most DEPTH)."""
    check_tree(tree, "eagle")  # the same check `specdec.LLM` makes before the head loads
    if tree_nodes is not None and tree_nodes < 1:
        raise SpecdecError(f"--tree-nodes must be at least 1, got {tree_nodes}")
    head = find_head(llm.name, llm.folder, llm.model.cfg, heads_dir)
    if tree == "auto":
        tree = "dynamic" if tree_nodes else auto_tree(llm.budget())  # a node count asks for a tree
    nodes = tree_nodes or (DEPTH if tree == "chain" else max(llm.budget() - 1, MIN_NODES))
    alpha = (head.cfg.training.get("val") or {}).get("alpha") or [0.6]  # validation alpha per depth (training)
    embed, path = llm.model.embed, None
    if llm.model.device.type == "cpu":  # q8 on the quantized matmul (half the bf16 bytes), else bf16's kernel
        path = "q8" if quant.isa() != "torch" else kernels.matmul_path()
    else:  # a target on a GPU: the head is host code, so it embeds its drafts with a host copy of the table
        embed = copy.deepcopy(embed).cpu()
    return Eagle(head, embed, tree=tree, nodes=nodes, prior_alpha=float(min(alpha[0], 0.95)), path=path)
