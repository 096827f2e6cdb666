"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class SpecdecError(Exception):
    """An error whose message tells the user what to do; no traceback is shown."""
