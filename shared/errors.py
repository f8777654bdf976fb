"""The one error type that crosses a boundary: an HTTP status and a message safe to show a client.

A handler raises it to answer with that status; a caller receives it back from ``call``; the frontend
turns it into an OpenAI error body. Subclasses add what their side knows (the frontend's ``param``,
a caller's "nobody was subscribed"), never a second meaning for ``status``. Messages never carry
internals (paths, addresses, tracebacks): those go to the logs.
"""

from __future__ import annotations


class ServiceError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r})"
