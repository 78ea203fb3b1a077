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
    """A worker cannot take the request now: its waiting queue is full (`--max-pending`,
    `reason` "max_pending"), or the prompt's first token would come later than the TTFT
    target (`--ttft-target-ms`, "ttft_target"). Retry after `retry_after_s`, or elsewhere."""

    def __init__(self, message: str, reason: str = "max_pending", retry_after_s: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
