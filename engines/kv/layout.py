"""The KV layout: what two workers must agree on to exchange pages byte for byte. Plain
Python, no torch: a decode states it in its hello, which the router's codec reads too."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engines.config import ModelConfig

ORDER = "page,layer,kv,token,head,dim"     # a page's dimensions, outermost first
DIMENSION_MAX = 2**31 - 1                  # layers, page size, kv heads, head dim (int32)
ELEMENT_BYTES_MAX = 8
DTYPE_CHARS_MAX = 32


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on to exchange pages byte for byte."""
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_bytes: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> "KVLayout":
        return cls(cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim,
                   str(dtype).removeprefix("torch."), dtype.itemsize)

    @property
    def page_bytes(self) -> int:
        """One page of every layer, K and V: one contiguous chunk of the pool."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim \
            * self.element_bytes

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return num_pages, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim

    def to_dict(self) -> dict:
        """The fields with the page's size and dimension order (the compatibility hash's
        and the wire's shape)."""
        return asdict(self) | {"page_bytes": self.page_bytes, "order": ORDER}

    def to_wire(self) -> dict:
        return self.to_dict()

    @classmethod
    def from_dict(cls, raw: object) -> "KVLayout":
        """The layout a peer states (the wire decode's one check of it): every field,
        in bounds, with the page size and order they imply; other keys are ignored."""
        if not isinstance(raw, dict):
            raise ValueError(f"a KV layout must be an object, got {type(raw).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [name for name in (*names, "page_bytes", "order") if name not in raw]
        if missing:
            raise ValueError(f"KV layout lacks {', '.join(missing)}")
        layout = cls(**{name: raw[name] for name in names})
        problem = layout._problem()
        if not problem and (raw["page_bytes"] != layout.page_bytes or raw["order"] != ORDER):
            problem = (f"page_bytes {raw['page_bytes']!r} and order {raw['order']!r} are not "
                       f"the fields' {layout.page_bytes} and {ORDER!r}")
        if problem:
            raise ValueError(f"KV layout: {problem}")
        return layout

    def _problem(self) -> str:
        """Why these fields are no layout, or ""."""
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim"):
            if not _count(getattr(self, name), DIMENSION_MAX):
                return f"{name} must be an integer in [1, {DIMENSION_MAX}]"
        if not _count(self.element_bytes, ELEMENT_BYTES_MAX):
            return f"element_bytes must be an integer in [1, {ELEMENT_BYTES_MAX}]"
        if type(self.dtype) is not str or not 0 < len(self.dtype) <= DTYPE_CHARS_MAX \
                or not self.dtype.isprintable():
            return f"dtype must be a name of 1 to {DTYPE_CHARS_MAX} printable characters"
        return ""


def _count(value: object, high: int) -> bool:
    return type(value) is int and 1 <= value <= high
