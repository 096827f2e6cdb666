"""A static, position-indexed KV cache: rollback is bookkeeping (gpt-fast, vLLM).

Every layer owns two preallocated tensors `[B, H_kv, S_max, D]`. A forward over n new
positions writes slots `length .. length+n-1` and advances `length`. Speculation then
either keeps a prefix of those slots (`rewind(n_rejected)`, for chains) or keeps a chosen
subset of the newest slots and moves it to be contiguous (`compact(keep)`, for trees).

Example: length 10, a round verifies 5 drafted tokens plus the last committed one
(6 slots, length 16); 2 drafts are accepted, so the 3 rejected slots are dropped with
`rewind(3)` (length 13) and overwritten by the next round.
"""

from __future__ import annotations

import torch


class KVCache:
    _pointers: list[int] | None = None  # `pointers`, until `grow` reallocates the tensors

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k, v `[B, H_kv, n, D]` in slots `start .. start+n-1` of one layer."""
        n = k.shape[2]
        self.k[layer][:, :, start:start + n] = k
        self.v[layer][:, :, start:start + n] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots `0 .. end-1`: `[B, H_kv, end, D]` each (views, no copy)."""
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def pointers(self) -> list[int]:
        """The addresses of k[0], v[0], k[1], v[1], ...: what the fused layers hand to C for every request and
        step (at 16 SmolLM2 requests, 960 `data_ptr` calls a step when asked each time)."""
        if self._pointers is None:
            self._pointers = [t.data_ptr() for pair in zip(self.k, self.v) for t in pair]
        return self._pointers

    def rewind(self, n: int) -> None:
        """Drop the newest n positions (rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"rewind: n={n} must be in [0, {self.length}]")
        self.length -= n

    def reset(self) -> None:
        self.length = 0

    def first_layers(self, n: int) -> "KVCache":
        """A cache over this one's first n layers that shares its tensors (LayerSkip's shared cache: an
        early-exit draft reads the target's cached positions instead of computing them again). Its
        length is its own."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.max_len, view.length = self.k[:n], self.v[:n], self.max_len, self.length
        return view

    def grow(self, max_len: int) -> None:
        """Make room for max_len slots (when more than now), keeping the cached positions."""
        if max_len <= self.max_len:
            return
        for kv in (self.k, self.v):
            for i, old in enumerate(kv):
                kv[i] = old.new_zeros(*old.shape[:2], max_len, old.shape[3])
                kv[i][:, :, :self.length] = old[:, :, :self.length]
        self.max_len, self._pointers = max_len, None

    def compact(self, keep: list[int] | torch.Tensor, newest: int) -> None:
        """Keep the slots `keep` (indices 0..newest-1 into the newest `newest` slots, ascending,
        e.g. the accepted path of a tree) and drop the rest of those `newest` slots, so the kept
        ones become contiguous right after the older cache."""
        keep = torch.as_tensor(keep, dtype=torch.long)
        if newest > self.length or (len(keep) and (int(keep.min()) < 0 or int(keep.max()) >= newest)):
            raise ValueError(f"compact: keep={keep.tolist()} must index the newest {newest} of {self.length} slots")
        base = self.length - newest
        src = keep + base
        dst = torch.arange(base, base + len(keep))
        if not torch.equal(src, dst):
            src, dst = src.to(self.k[0].device), dst.to(self.k[0].device)
            for kk, vv in zip(self.k, self.v):
                kk[:, :, dst] = kk[:, :, src]
                vv[:, :, dst] = vv[:, :, src]
        self.length = base + len(keep)
