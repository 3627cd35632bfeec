"""Who a client is to NATS.

A client proves itself with a user and password, or with a credentials file (JWT and
nkey seed, as ``nsc`` writes them for an operator-managed server), and may talk TLS.
Secrets never travel on a command line: a password is read from a file or from the
environment (:mod:`pdserve.configs`). The users of ``pdserve up``'s own broker are
:mod:`pdserve.broker.credentials`.
"""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path
from typing import Any

from pdserve.broker import subjects


@dataclasses.dataclass(frozen=True)
class NatsAuth:
    """How to connect: nothing (an open server), ``user`` and ``password``, or
    ``creds_file``; TLS with ``tls_ca`` (trust), ``tls_cert`` and ``tls_key`` (client
    certificate) or with the system's trust store when the URL is ``tls://``."""

    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    creds_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("a NATS user needs a password, and a password a user")
        if self.user is not None and self.creds_file is not None:
            raise ValueError("give a NATS user and password, or a credentials file, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a TLS client certificate needs its key, and a key its certificate")

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``. With a user, the client's inboxes are
        ``_INBOX.<user>.*``: the only inboxes its permissions let it read."""
        opts: dict[str, Any] = {}
        if self.user is not None:
            opts.update(user=self.user, password=self.password, inbox_prefix=subjects.inbox_prefix(self.user))
        if self.creds_file is not None:
            opts["user_credentials"] = str(self.creds_file)
        if self.tls_ca is not None or self.tls_cert is not None:
            context = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
            if self.tls_cert is not None:
                context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
            opts["tls"] = context
        return opts


def read_password(path: Path) -> str:
    """The first line of ``path``; an error naming the file when it cannot be read."""
    try:
        password = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the NATS password file {path}: {exc.strerror}") from None
    if not password:
        raise ValueError(f"the NATS password file {path} is empty")
    return password
