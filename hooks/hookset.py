"""The runner calls the recorder wraps, and the one guard around its own work in them: a hook never raises into
vLLM, and installing twice changes nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from moetrace.hooks.vllm_api import HookPoint

HOOK_MARK = "_moetrace_hook"


class HookSet:
    """``HookPoint``s bound to the recorder's hooks by role (a point with a plan to ``planned`` or
    ``planned_at_launch``); the timed-only points are hooked for a timed step alone (``hook_timed_only``)."""

    def __init__(self, roles: Mapping[str, Callable[..., Any]]) -> None:
        self.roles = roles
        self.installed: list[tuple[HookPoint, Any]] = []  # each hook, and the instance attribute it replaced
        self.timed_only: list[HookPoint] = []

    def install(self, points: list[HookPoint]) -> None:
        self.timed_only = [point for point in points if point.timed_only]
        for point in points:
            if not point.timed_only:
                self._hook(point)

    def hook_timed_only(self) -> None:
        for point in self.timed_only:
            self._hook(point)

    def unhook_timed_only(self) -> None:
        """Remove the hooks installed for the timed step under way."""
        for entry in [entry for entry in self.installed if entry[0].timed_only]:
            self.installed.remove(entry)
            _unhook(*entry)

    def uninstall(self) -> None:
        for point, replaced in reversed(self.installed):
            _unhook(point, replaced)
        self.installed = []

    def _hook(self, point: HookPoint) -> None:
        replaced = vars(point.owner).get(point.name)
        if getattr(replaced, HOOK_MARK, False):
            return
        original = getattr(point.owner, point.name)
        if point.plan is None:
            hook = functools.partial(self.roles[point.role], original)
        else:
            hook = functools.partial(self.roles["planned_at_launch" if point.plan_at_launch else "planned"],
                                     original, point.plan)
        setattr(hook, HOOK_MARK, True)
        setattr(point.owner, point.name, hook)
        self.installed.append((point, replaced))


def _unhook(point: HookPoint, replaced: Any) -> None:
    if replaced is None:
        vars(point.owner).pop(point.name, None)  # the class's method shows through again
    else:
        setattr(point.owner, point.name, replaced)


class Guard:
    """The one guard around moetrace's own work in every hook (``with recorder._guarded:``): an exception stops
    recording, said in the log and the manifest, and never reaches vLLM (vLLM's own calls run outside it). A plain
    context manager, not a generator: entered several times a step on the engine thread."""

    __slots__ = ("stop",)

    def __init__(self, stop: Callable[[BaseException], None]) -> None:
        self.stop = stop

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
                 ) -> bool:
        if isinstance(exc, Exception):
            self.stop(exc)
            return True  # swallowed: the engine carries on unhooked
        return False
