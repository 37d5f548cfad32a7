"""Keys of one run's control plane: ZeroMQ CURVE (Curve25519 encryption and authentication).

Every TCP ZeroMQ socket between the head and the workers is a CURVE socket. The head makes, per
run, a server key pair (it proves the head's identity and encrypts) and a client key pair that
every worker presents; a ZAP handler on the head admits only that client key. A peer without the
keys gets no answer: its handshake fails and the head logs the refusal. The keys reach workers on
other hosts only through the SSH session's stdin (or, for agents started by hand and for per-node
launches, ``--node-keys-file``: a file readable only by its owner, which ``zpp node-keys FILE``
makes) — never on a command line or in the environment. On top of CURVE, every worker
still presents the run's random ``key`` in its first message.

What is not covered: tensors between stages (gloo / NCCL) travel in clear over the interface the
workers use; keep that traffic on a private network.
"""
from __future__ import annotations

import os
import secrets
import stat
from typing import Optional

import msgspec
import zmq

from zpp.errors import ConfigError


class RunKeys(msgspec.Struct, frozen=True):
    """Everything a process needs to join a run's control plane (z85-encoded CURVE keys)."""

    key: str
    """Random token every worker presents in Hello."""
    server_public: str = ""
    server_secret: str = ""
    """Only the head needs it; stripped from what workers receive (see :meth:`for_workers`)."""
    client_public: str = ""
    client_secret: str = ""

    @property
    def curve(self) -> bool:
        return bool(self.server_public)

    def for_workers(self) -> "RunKeys":
        """The same keys without the server's secret."""
        return msgspec.structs.replace(self, server_secret="")

    def encode(self) -> bytes:
        """One JSON line (for a stdin pipe or a key file)."""
        return msgspec.json.encode(self) + b"\n"

    @staticmethod
    def decode(data: bytes | str) -> "RunKeys":
        """Raises ValueError on anything but a RunKeys JSON object."""
        try:
            return msgspec.json.decode(data.strip() if isinstance(data, bytes) else data.strip().encode(),
                                       type=RunKeys)
        except msgspec.DecodeError as e:
            raise ValueError(f"not a zpp key line: {e}") from None


def new_run_keys(curve: bool) -> RunKeys:
    """Fresh keys for one run; CURVE key pairs only when ``curve`` (TCP control plane)."""
    if not curve:
        return RunKeys(key=secrets.token_hex(16))
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return RunKeys(key=secrets.token_hex(16), server_public=server_public.decode(),
                   server_secret=server_secret.decode(), client_public=client_public.decode(),
                   client_secret=client_secret.decode())


def read_keys_file(path: str) -> RunKeys:
    """Keys from a file only its owner can read.

    Raises:
        ConfigError: missing, readable by others (mode must be 0600 or stricter), or not a key file.
    """
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"key file {path}: mode {stat.S_IMODE(st.st_mode):o} lets other users read "
                              f"it; chmod 600 {path}")
        with open(path, "rb") as f:
            return RunKeys.decode(f.read())
    except OSError as e:
        raise ConfigError(f"key file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"key file {path}: {e}") from None


def write_keys_file(path: str, keys: RunKeys, mode: int = 0o600, what: str = "--node-keys-file") -> None:
    """Write ``keys`` to a new file created with ``mode`` (0600 or 0400; never an existing file).
    Raises ConfigError if it cannot (``what`` names the path's origin in the message)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(keys.encode())
    os.chmod(path, mode)  # whatever the umask took away, and nothing more


def read_node_keys(path: str, head: bool) -> RunKeys:
    """The keys of a per-node launch (``--nnodes``) from ``--node-keys-file``, which must exist (made
    by ``zpp node-keys FILE``), be readable by its owner only and, on the head, hold the server's
    secret. Nodes get them without that secret (:meth:`RunKeys.for_workers`).

    Raises:
        ConfigError: one line naming the file and what is wrong.
    """
    try:
        keys = read_keys_file(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("key file ", "--node-keys-file ", 1)
                          + ("; make one with `zpp node-keys FILE` and give every node the same file"
                             if not os.path.exists(path) else "")) from None
    if not keys.curve:
        raise ConfigError(f"--node-keys-file {path}: holds no CURVE keys (make one with `zpp node-keys FILE`)")
    if head and not keys.server_secret:
        raise ConfigError(f"--node-keys-file {path}: has no server key (a worker-side copy?); node rank 0 needs "
                          f"the file `zpp node-keys` wrote")
    return keys if head else keys.for_workers()


def keys_for_run(curve: bool, keys_file: Optional[str]) -> RunKeys:
    """The head's keys: from ``keys_file`` when it exists, else fresh (and written there when a
    path is given, so agents started by hand can read the same file). Raises ConfigError."""
    if keys_file and os.path.exists(keys_file):
        keys = read_keys_file(keys_file)
        if not keys.server_secret:
            raise ConfigError(f"--node-keys-file {keys_file}: has no server key (a worker-side copy?)")
        return keys
    keys = new_run_keys(curve or bool(keys_file))
    if keys_file:
        write_keys_file(keys_file, keys)
    return keys
