"""Every change UnevenJoin makes to an object it does not own, each with its undo, in one register.

UnevenJoin reaches into objects that belong to the user or to Composer: a ``DataSpec``'s ``split_batch``,
an optimizer's ``step``, a forward on DDP's wrapper or a loss on the model for one microbatch, hooks on
the model's modules, Composer's checkpointed attributes. Each such change goes through a :class:`Changes`
register, which records how to undo it, and :meth:`Changes.undo` undoes them all, newest first. A register
is a context manager, so a scope undoes its changes on the way out, also when the code inside raises:

* the join's loader opens one scope per iteration over a dataloader (an epoch, an evaluation, a
  ``predict()``) and closes it when the iteration ends: normally, when Composer stops asking for batches, or
  when an exception unwinds Composer's loop (Python closes the suspended iterator then);
* a fit or evaluation session keeps one for what must last from its start event to its end event.

Example:
    >>> class Model:
    ...     def loss(self):
    ...         return 'real'
    >>> m = Model()
    >>> with Changes() as changes:
    ...     changes.set(m, 'loss', lambda: 'zero')
    ...     m.loss()
    'zero'
    >>> m.loss(), 'loss' in vars(m)
    ('real', False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ['Changes']

_MISSING = object()


class Changes:
    """A register of changes to other people's objects, undone together (:meth:`undo`), newest first.

    Idempotent: :meth:`undo` twice undoes once. Cost: one entry per change.
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], object]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value`` on the instance; undone to the instance's own earlier value, or removed."""
        previous = vars(obj).get(name, _MISSING)
        setattr(obj, name, value)

        def back() -> None:
            if previous is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, previous)

        self._undo.append(back)

    def hook(self, handle: Any) -> Any:
        """A hook handle (``torch.utils.hooks.RemovableHandle``): removed on undo. Returns the handle."""
        self._undo.append(handle.remove)
        return handle

    def remove_from(self, items: list, item: Any) -> None:
        """``items.remove(item)`` if it is there; put back where it was on undo."""
        if item not in items:
            return
        index = items.index(item)
        items.remove(item)
        self._undo.append(lambda: items.insert(min(index, len(items)), item) if item not in items else None)

    def call(self, undo: Callable[[], object]) -> None:
        """Any other change: ``undo()`` takes it back."""
        self._undo.append(undo)

    def undo(self) -> None:
        """Undo every change, newest first; the register is empty afterwards (even if an undo raises)."""
        pending, self._undo = self._undo, []
        errors: list[BaseException] = []
        for back in reversed(pending):
            try:
                back()
            except Exception as e:  # the others are still undone; the first error is raised at the end
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()
