"""EAGLE's chain under sampling: drawn from q (rejection sampling) vs its top-1 chain (deterministic, checked
against the target's own draw). Mean accepted tokens per forward, same prompts and seeds, alternating.
Session 27 (SmolLM2 q4, HumanEvalFix dev x5 + Spec-Bench's first turn, 96 tokens, top-k 50, k 4): see
eagle-chain-ab.txt. Run: .venv/bin/python benchmarks/s27/eagle_chain_ab.py"""
import statistics
from specdec import LLM
from specdec.bench import prompts as P
from specdec.bench.runner import chat_ids
from specdec.drafters import eagle as E

llm = LLM("smollm2-135m")
items = P.load_prompts("humanevalfix", None, 5) + P.load_prompts("spec-bench", None, 1)
orig = E.Eagle.propose
def deterministic(self, ctx, k):
    self._ingest(ctx)
    if self.root is None or k <= 0:
        from specdec.draft import Draft
        return Draft.empty()
    committed = self.cache.length
    try:
        return self._tree(min(k, self.k_max))
    finally:
        self.cache.rewind(self.cache.length - committed)
res = {"sampled": [], "top1": []}
for temp in (0.8, 1.0):
    for it in items:
        ids = chat_ids(llm.tokenizer, [{"role": "user", "content": it.turns[0]}])
        for name, fn in (("sampled", orig), ("top1", deterministic)):
            E.Eagle.propose = fn
            r = llm.generate(ids, max_new_tokens=96, method="eagle", temperature=temp, top_k=50, seed=1, k=4)
            res[name].append((temp, r.mean_accepted, r.acceptance_rate))
for name, v in res.items():
    for temp in (0.8, 1.0):
        rows = [x for x in v if x[0] == temp]
        print(name, "T", temp, "tokens/forward median", round(statistics.median(x[1] for x in rows), 3),
              "mean", round(statistics.mean(x[1] for x in rows), 3), "alpha mean", round(statistics.mean(x[2] for x in rows), 3))
