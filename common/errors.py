"""Errors a caller can act on. Every bad input becomes an `InvalidRequestError` naming the
field and the limit, raised before a request touches the engine, so one bad request never
affects the others in a batch."""


class PdserveError(Exception):
    """Base of pdserve's own errors: the message is meant for a person."""


class InvalidRequestError(PdserveError, ValueError):
    """A request field is out of its allowed range. `field` names it (e.g. ``top_p``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(PdserveError):
    """The model path is missing, unreadable, or of an architecture we do not run."""


class WorkerBusyError(PdserveError):
    """A worker's waiting queue is full (`--max-pending`): retry later or elsewhere."""
