"""In-process memos: a bounded LRU and a per-object digest, shared by detection, template
checking and inference (each keeps its answers by content; nothing here outlives the process).

Why one home: the three memos used to open-code the same ordered-dict-and-lock pattern and the
same weakly held per-Format hash; one class each keeps the rules (bounded, thread-safe, no
caller object held strongly) in one place.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable


class LRU:
    """A bounded, thread-safe memo (least recently used out).

    Entries should hold no object of the caller's (only strings, numbers, tuples, or copies
    made for the memo), so keeping an entry keeps nothing else alive.

    Args:
        size: the most entries kept.

    Example:
        >>> m = LRU(2)
        >>> m.put("a", 1); m.put("b", 2); m.put("c", 3)
        >>> m.get("a") is None, m.get("c")
        (True, 3)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        """The entry under ``key`` (now the most recently used), or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: Any, value: Any) -> None:
        """Keep ``value`` under ``key`` (the oldest entries go past the size)."""
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._items.clear()

    def values(self) -> list:
        """The entries, oldest first (a copy)."""
        with self._lock:
            return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)


class PerObject:
    """A value computed once per object and held weakly (the object is never kept alive);
    objects that cannot be weakly referenced get it computed on each call.

    Args:
        compute: ``obj -> value``.

    Example:
        >>> class F: pass
        >>> key = PerObject(lambda f: id(f) % 7)
        >>> f = F(); key(f) == key(f)
        True
    """

    def __init__(self, compute: Callable[[Any], Any]) -> None:
        self._compute = compute
        self._values: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def __call__(self, obj: Any) -> Any:
        try:
            hit = self._values.get(obj)
        except TypeError:  # not weakly referenceable
            return self._compute(obj)
        if hit is None:
            hit = self._compute(obj)
            self._values[obj] = hit
        return hit
