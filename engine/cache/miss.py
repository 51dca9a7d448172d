"""Miss: why the cache could not use something it was offered, as a value.

`kind` is what the counters key on: a validation layer ("layer 1" .. "layer 3") for the
validator's failures, or a lower tier's reason ("missing", "fingerprint", "checksum", "length",
"decode", "timeout", "io", "unexpected", "save"). `detail` says what exactly. `str(miss)` is
the text events and the UI show, "kind: detail".

store/ imports nothing of engine/, so the disk tier builds its own value of this shape
(store.tier.Miss); the cache reads only `kind` and `str()` of what a lower tier returns, and
the two never compare equal (compare their `kind` and `detail`, never the values).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Miss:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"
