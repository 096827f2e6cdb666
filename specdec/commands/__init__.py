"""The CLI's subcommands, one module each; `listen` is shared by the two that serve HTTP (race, serve), `out_or`
by the two whose --out defaults to a folder of the store (train, datastore build)."""


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


def out_or(out: str | None, default):
    """--out as a path, or `default()` (a folder of the store) when it is not given; an empty --out is refused
    rather than read as not given (`train --out ''` wrote into the store's head folder)."""
    from pathlib import Path

    from specdec.errors import SpecdecError

    if out is None:
        return default()
    if not out.strip():
        raise SpecdecError("--out is empty: name a folder, or leave --out out for the store's folder")
    return Path(out).expanduser()
