"""The CLI's subcommands, one module each; `listen` is shared by the two that serve HTTP (race, serve)."""


def listen(host: str, port: int):
    """A listening socket on (host, port), or one SpecdecError line (bad address, port in use) instead of
    uvicorn's exit status 3."""
    import socket

    from specdec.errors import SpecdecError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise SpecdecError(f"cannot listen on {host}:{port} ({e.strerror or e}): check --host and --port") from None
