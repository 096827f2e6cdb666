"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class SpecdecError(Exception):
    """An error whose message tells the user what to do; no traceback is shown. `param`: the request field it
    is about, where there is one (the HTTP server's error body names it: "speculation.k")."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param
