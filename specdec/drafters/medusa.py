"""Medusa: K extra heads on the target's last hidden state guess the K tokens after the next one in one
shot, and their top candidates form a tree verified in one forward (Cai et al. 2024; the lesson, Ch. 4).

Heads. Head i is a residual SiLU block on the hidden state h_t at the last accepted position t,
h_i = h_t + SiLU(W_i h_t + b_i), read by the target's own frozen LM head: it predicts token t + i + 2
(head 0: the token after the one the target itself emits this round). W_i starts at zero, so an untrained
head predicts what the LM head predicts. The hidden state comes from the verify pass the drafter rode
in (`Context.hidden`): drafting costs K small matmuls and no target pass.

Draft vocabulary. The K x V LM-head product is the main draft cost (V = 49k for SmolLM2, 152k for Qwen2.5),
so heads score only the `vocab` most frequent target predictions of the training corpus (8192 by
default, FR-Spec's reduced vocabulary; the coverage is in the heads' config). The rows are the LM head's
own, gathered once. Verification is untouched: the target still scores the full vocabulary.

Trees. A tree is a list of paths of candidate ranks (Medusa's `medusa_choices`): (0,) is head 0's top
token, (0, 1) head 1's second candidate after it, (1,) head 0's runner-up. Each path becomes one draft
node whose parent is the path without its last rank:

    paths = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]      top[i] = head i's candidates, best first
    tokens  = [top[0][0], top[0][1], top[1][0], top[1][1], top[2][0]]
    parents = [-1, -1, 0, 0, 2]

Siblings are distinct ranks of one head, hence distinct tokens, so the deterministic draft (q = None)
is verified exactly under sampling by the multi-candidate rule (`specdec.verify`): greedy output equals
plain decoding, sampled output is distributed as plain sampling.

Calibrated sparse tree (Medusa's paper, the lesson's 64-node example): with acc[i][r] the validation
rate at which head i's rank-r candidate is the target's token when heads 0 .. i-1 were right (heads
fail together: head 1 is right far more often after head 0 was), a path's chance of being accepted is
estimated as the product of acc along it; greedily adding the most likely extension of the current tree
gives, for every N, the N-node tree with the highest expected accepted length 1 + sum of those products.
Example: acc = [[.6, .2], [.4, .15]] picks (0,) .6, (0, 0) .24, (1,) .2, (0, 1) .09, ... `auto_nodes`
then picks N maximizing that expectation over the probe's cost curve, cost(N + 1).
"""

from __future__ import annotations

import heapq
import json
import numbers
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter
from specdec.errors import SpecdecError
from specdec.options import OptionError
from specdec.runtime.model import Linear

KIND = "medusa"
MAX_TREE = 64


class MedusaHeads(nn.Module):
    """K residual SiLU blocks: h [..., D] -> [..., K, D] (zero-initialised: each returns h)."""

    def __init__(self, heads: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(heads, hidden_size))

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("...d,ked->...ke", h, self.weight) + self.bias
        return h.unsqueeze(-2) + F.silu(z)


# --- trees ------------------------------------------------------------------------------------------

def chain(depth: int) -> list[tuple[int, ...]]:
    """The top candidate of heads 0 .. depth-1, one after the other."""
    return [(0,) * d for d in range(1, depth + 1)]


def calibrated_paths(acc: Sequence[Sequence[float]], n: int) -> list[tuple[int, ...]]:
    """The n paths, in the order the greedy picks them, with the highest estimated acceptance
    (product of acc[depth][rank] along the path). Every prefix of the result is a tree."""
    heads, ranks = len(acc), len(acc[0])
    heap = [(-acc[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < n:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < heads:
            for r in range(ranks):
                heapq.heappush(heap, (neg * acc[len(path)][r], path + (r,)))
    return out


def path_probability(acc, path) -> float:
    p = 1.0
    for depth, rank in enumerate(path):
        p *= acc[depth][rank]
    return p


def auto_nodes(acc, cost, limit: int = MAX_TREE) -> int:
    """Tree size N maximizing (1 + sum of the N best path probabilities) / cost(N + 1)."""
    paths = calibrated_paths(acc, limit)
    best, e = (1.0, 0), 1.0
    for n, path in enumerate(paths, 1):
        e += path_probability(acc, path)
        best = max(best, (e / cost(n + 1), n))
    return max(best[1], 1)


def check_paths(paths, heads: int, ranks: int) -> list[tuple[int, ...]]:
    """Validate a list of rank paths (every prefix present, depth <= heads, ranks < ranks): lists (or tuples) of
    integers, never a float or a bool read as one."""
    shape = "a tree is a non-empty list of distinct paths, each a list of integer ranks, e.g. [[0], [1], [0, 0]]"
    if (not isinstance(paths, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in paths)
            or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for p in paths for r in p)):
        raise OptionError(shape)
    out = [tuple(int(r) for r in p) for p in paths]
    have = set(out)
    if not out or len(have) != len(out):
        raise OptionError(shape)
    for p in out:
        if not p or len(p) > heads or min(p) < 0 or max(p) >= ranks:
            raise OptionError(f"tree path {list(p)}: needs 1..{heads} ranks, each in [0, {ranks})")
        if len(p) > 1 and p[:-1] not in have:
            raise OptionError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
    return out


def read_tree(file: str | Path, heads: int, ranks: int) -> list[tuple[int, ...]]:
    """A tree file: a JSON list of paths (Medusa's medusa_choices shape), e.g. [[0], [0, 0], [1]]."""
    try:
        paths = json.loads(Path(file).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OptionError(f"--tree {file}: not a readable JSON list of paths ({e})") from None
    return check_paths(paths, heads, ranks)


class TreeLayout:
    """A set of paths as draft structure: nodes sorted by depth, parents, and each node's (depth, rank)."""

    def __init__(self, paths: Sequence[tuple[int, ...]]):
        paths = sorted(paths, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        self.parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long)
        self.depth = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long)
        self.rank = torch.tensor([p[-1] for p in paths], dtype=torch.long)
        self.size = [int((self.depth < d).sum()) for d in range(int(self.depth.max()) + 2)]  # nodes above depth d
        self.max_depth = len(self.size) - 1
        self.ranks = int(self.rank.max()) + 1


# --- the drafter ------------------------------------------------------------------------------------

class Medusa(Drafter):
    """Draft a tree (or chain) from the heads' top candidates at the last accepted position."""

    name = KIND
    wants_hidden = True       # the loop passes the verify pass's last hidden state in Context.hidden
    tau_prior = 0.05

    def __init__(self, heads: MedusaHeads, lm_rows: torch.Tensor, vocab: torch.Tensor,
                 paths: Sequence[tuple[int, ...]], prior_alpha: float = 0.6):
        self.heads = heads.float().eval()
        # the LM head's rows for the draft vocabulary [Vd, D], in the target's dtype: the runtime's Linear
        # streams them once for the K heads (bf16 through the kernel)
        self.lm = Linear(lm_rows.shape[1], lm_rows.shape[0], bias=False)
        self.lm.weight = nn.Parameter(lm_rows.detach(), requires_grad=False)
        self.vocab = vocab.long()       # [Vd] draft index -> token id
        self.layout = TreeLayout(check_paths(paths, heads.num_heads, len(vocab)))
        self.k_max = self.layout.max_depth
        self.prior_alpha = prior_alpha

    def nodes(self, k: int) -> int:
        """Draft positions of the tree cut at depth k (what a round with k costs to verify)."""
        return self.layout.size[min(k, self.k_max)]

    room = nodes  # the target's cache holds the whole tree cut at depth k

    @torch.inference_mode()
    def candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids [K, s]: each head's s best candidates at this hidden state, best first."""
        logits = self.lm(self.heads(hidden.float()))  # [K, Vd]
        return self.vocab[logits.topk(self.layout.ranks, dim=-1).indices]

    def propose(self, ctx: Context, k: int) -> Draft:
        if ctx.hidden is None or k <= 0:  # no hidden state yet (a one-token prompt): a plain step
            return Draft.empty()
        n = self.nodes(k)
        lay = self.layout
        top = self.candidates(ctx.hidden)
        return Draft(top[lay.depth[:n], lay.rank[:n]], lay.parents[:n])


def lm_head_rows(model, vocab: torch.Tensor) -> torch.Tensor:
    """The target's LM-head rows for the draft vocabulary [Vd, D], on the host (the heads are host code, also
    for a target on a GPU): as they are, or, for a quantized head (q8/q4 `QLinear`), dequantized once to bf16
    when the bf16 kernel runs them (else fp32)."""
    from specdec.runtime import kernels
    from specdec.runtime.kernels import quant
    from specdec.runtime.model import QLinear

    head = model.lm_head
    if not isinstance(head, QLinear):
        return head.matrix()[vocab.to(head.weight.device)].cpu()
    rows = torch.cat([quant.dequantize(p) for p in head.parts])[vocab]
    return rows.to(torch.bfloat16) if kernels.available() else rows.float()


def build(llm, heads_dir: str | None = None, tree: str = "auto", tree_nodes: int | None = None) -> Medusa:
    """The Medusa drafter for an `LLM`: heads found by `specdec.training.heads.find`, checked against
    the target; tree 'auto' (calibrated, sized by `tree_nodes` or the probe's cost curve), 'chain' or a
    JSON file of paths."""
    from specdec.training import heads as store

    folder = store.find(llm.name, KIND, heads_dir)
    tensors, config = store.load(folder, KIND, llm.folder, llm.name)
    k, d = config["heads"], config["hidden_size"]
    module = MedusaHeads(k, d)
    try:
        module.load_state_dict({"weight": tensors["weight"].float(), "bias": tensors["bias"].float()})
        vocab = tensors["vocab"].long()
    except (KeyError, RuntimeError) as e:  # a config.json edited by hand, or weights from another run
        raise SpecdecError(f"{folder}: the weights are not {k} heads of width {d} with their vocabulary, as its "
                           f"config.json says ({str(e).splitlines()[0] if str(e) else repr(e)}): train them again "
                           "with `specdec train medusa`") from None
    lm_rows = lm_head_rows(llm.model, vocab)
    acc = config["val_accuracy"]["after_hits"]  # acc[i][r]: head i's rank r, after heads 0 .. i-1 were right
    if tree_nodes is not None and tree_nodes < 1:
        raise OptionError(f"--tree-nodes must be at least 1, got {tree_nodes}")
    if tree == "chain":
        paths = chain(min(k, tree_nodes or k))
    elif tree == "auto":
        paths = calibrated_paths(acc, tree_nodes or auto_nodes(acc, llm.cost_curve(measure=True)))
    else:
        paths = read_tree(tree, k, len(vocab))
    # P(some first-level candidate is right), over the ranks validation measured (the top 8; a tree file may go deeper)
    first = sum(acc[0][p[0]] for p in paths if len(p) == 1 and p[0] < len(acc[0]))
    return Medusa(module, lm_rows, vocab, paths, prior_alpha=float(min(first, 0.95)))
