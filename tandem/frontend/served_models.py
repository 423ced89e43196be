"""The models one frontend serves, by the name clients pass as `model`.

Every API (Chat Completions, Completions, Responses, Messages, the public gRPC API) looks its
request's model up here and hands the request to that model's Frontend: its tokenizer, chat
template, output parsers and limits. An unknown name is a 404 naming it and the served ones."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from tandem.errors import ModelNotFound
from tandem.frontend.frontend import Frontend


class ServedModels:
    def __init__(self, frontends: Sequence[Frontend]) -> None:
        if not frontends:
            raise ValueError("a frontend serves at least one model")
        self._by_name = {f.model.name: f for f in frontends}
        if len(self._by_name) != len(frontends):
            raise ValueError("served model names must be unique")

    def get(self, name: object, param: str = "model") -> Frontend:
        """The Frontend of model `name`.

        Raises:
            ModelNotFound: no served model has that name (a missing or non-string name
                included); the message names the served ones.
        """
        frontend = self._by_name.get(name) if isinstance(name, str) else None
        if frontend is None:
            served = ", ".join(f"'{n}'" for n in self._by_name)
            raise ModelNotFound(f"model {name!r} does not exist; this deployment serves {served}",
                                param=param)
        return frontend

    @property
    def default(self) -> Frontend:
        """The first model listed (its metrics registry is the process's)."""
        return next(iter(self._by_name.values()))

    def __iter__(self) -> Iterator[Frontend]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)
