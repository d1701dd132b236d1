"""The ingestion jobs' one error type."""


class IngestError(ValueError):
    """Bad input to an ingestion job; ``str(err)`` is one line starting with the file path."""
