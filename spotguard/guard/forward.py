"""A read-only attribute that reads another object's: the public name of a facade's part.

``Guard`` keeps its state in parts (the stops, the watcher, the saves) and shows a few of their
attributes under its own names, documented where users look (``help(Guard)``, an editor's hover).
``stopped_at: Forward[int | None] = Forward("stops.stopped_at", "...")`` says that in one line,
where a property took five.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Generic, NoReturn, TypeVar, overload

if TYPE_CHECKING:
    from typing_extensions import Never

T = TypeVar("T")


class Forward(Generic[T]):
    """``obj.<name>`` reads ``obj.<path>`` (a dotted path); assigning to it is an ``AttributeError``."""

    def __init__(self, path: str, doc: str) -> None:
        self.path = path
        self._read = operator.attrgetter(path)
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Forward[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Forward[T] | T:
        if obj is None:
            return self
        value: T = self._read(obj)
        return value

    def __set__(self, obj: object, value: Never) -> NoReturn:  # Never: a type checker refuses the assignment too
        raise AttributeError(f"{self.name} is read-only (it is {self.path})")
