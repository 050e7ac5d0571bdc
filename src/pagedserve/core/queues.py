"""The scheduler's queues: sequence groups kept in order by a key, with O(1) membership by request
id. Pure Python, no torch."""

from __future__ import annotations

import bisect
from typing import Callable, Iterator

from pagedserve.sequence import SequenceGroup


class GroupQueue:
    """Groups sorted by `key` (ties keep insertion order), indexed by request id.

    NOTE: a group's key must not change while it is queued (priority and arrival never do).
    Membership (`group in queue`, `get`) costs a dict lookup; `add` a binary search and one
    list insertion; removing the last entry is O(1), any other O(len).
    """

    def __init__(self, key: Callable[[SequenceGroup], tuple]) -> None:
        self._key = key
        self._items: list[SequenceGroup] = []
        self._ids: dict[str, SequenceGroup] = {}

    def add(self, group: SequenceGroup) -> None:
        if group.request_id in self._ids:
            raise ValueError(f"request {group.request_id} is already queued")
        bisect.insort(self._items, group, key=self._key)
        self._ids[group.request_id] = group

    def key(self, group: SequenceGroup) -> tuple:
        """The group's place in this queue's order."""
        return self._key(group)

    def get(self, request_id: str) -> SequenceGroup | None:
        return self._ids.get(request_id)

    def remove(self, group: SequenceGroup) -> None:
        del self._ids[group.request_id]
        # Binary search for the group's key, then an identity scan among equal keys.
        key = self._key(group)
        i = bisect.bisect_left(self._items, key, key=self._key)
        while self._items[i] is not group:
            i += 1
        del self._items[i]

    def pop(self, index: int = -1) -> SequenceGroup:
        group = self._items.pop(index)
        del self._ids[group.request_id]
        return group

    def popleft(self) -> SequenceGroup:
        return self.pop(0)

    def remove_many(self, groups: list[SequenceGroup]) -> None:
        """Remove these queued groups: one by one when few, else in one pass."""
        if len(groups) <= 8:
            for g in groups:
                self.remove(g)
            return
        gone = {id(g) for g in groups}
        self._items = [g for g in self._items if id(g) not in gone]
        for g in groups:
            del self._ids[g.request_id]

    def __contains__(self, group: object) -> bool:
        return isinstance(group, SequenceGroup) and self._ids.get(group.request_id) is group

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __getitem__(self, index: int) -> SequenceGroup:
        return self._items[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GroupQueue):
            return self._items == other._items
        if isinstance(other, list):
            return self._items == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"GroupQueue({[g.request_id for g in self._items]})"


# The queue orders (`Scheduler`): arrival, the order requests were queued in, and (priority,
# arrival) with the queueing order breaking ties.
def arrival_key(group: SequenceGroup) -> tuple:
    return (group.arrival_time,)


def queued_key(group: SequenceGroup) -> tuple:
    return (group.queue_no,)


def priority_key(group: SequenceGroup) -> tuple:
    return (group.priority, group.arrival_time, group.queue_no)
