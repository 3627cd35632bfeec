"""The users of ``pdserve up``'s embedded broker.

One user per worker role (``prefill``, ``decode``, ``unified``), one per API process
(named by the API's id, so that it may read only its own reply subjects) and ``admin``
(every subject: for operators and test harnesses), one per direct publisher named with
``pdserve up --nats-client NAME`` (role ``client``: requests, cancels and its own replies
``pd.tokens.<NAME>.*``), each with a fresh random password in
``<data-dir>/nats/auth/<user>.password``, readable by this user only. What each may
publish and subscribe to is :mod:`pdserve.broker.permissions`; the server refuses
everyone else.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pdserve.broker import permissions, subjects
from pdserve.broker.auth import NatsAuth, read_password
from pdserve.broker.server import write_private

ADMIN = "admin"


@dataclasses.dataclass(frozen=True)
class NatsUser:
    """One user of the embedded server: a name, a password and what it may do."""

    name: str
    password: str = dataclasses.field(repr=False)
    rights: permissions.Rights

    def entry(self) -> dict[str, Any]:
        """This user as an entry of the server's ``authorization.users``."""
        return {"user": self.name, "password": self.password, **self.rights.conf()}


@dataclasses.dataclass(frozen=True)
class EmbeddedCredentials:
    """The users of ``pdserve up``'s broker and where their passwords are written."""

    directory: Path
    users: tuple[NatsUser, ...]

    @classmethod
    def create(cls, directory: Path, api_ids: Iterable[str], client_ids: Iterable[str] = ()) -> EmbeddedCredentials:
        """Fresh users for every role, for each of ``api_ids`` and for each direct
        publisher of ``client_ids``, their passwords written (0600) under ``directory``."""
        users = [NatsUser(role, _new_password(), permissions.for_role(role)) for role in permissions.WORKER_ROLES]
        users += [NatsUser(api_id, _new_password(), permissions.for_role("api", api_id)) for api_id in api_ids]
        users += [NatsUser(c, _new_password(), permissions.for_role(permissions.CLIENT, c)) for c in client_ids]
        users.append(NatsUser(ADMIN, _new_password(), permissions.everything()))
        names = [user.name for user in users]
        taken = sorted({n for n in names if names.count(n) > 1 or n != subjects.token(n)})
        if taken:
            raise ValueError(f"NATS user names must be unique subject tokens ([A-Za-z0-9_-]): {', '.join(taken)}")
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        for user in users:
            write_private(cls.password_file(directory, user.name), user.password + "\n")
        return cls(directory, tuple(users))

    @staticmethod
    def password_file(directory: Path, user: str) -> Path:
        return directory / f"{subjects.token(user)}.password"

    def entries(self) -> list[dict[str, Any]]:
        """The users as the server's configuration lists them."""
        return [user.entry() for user in self.users]

    def auth(self, user: str) -> NatsAuth:
        """How ``user`` connects."""
        (match,) = (u for u in self.users if u.name == user)
        return NatsAuth(user=match.name, password=match.password)


def embedded_auth(directory: Path, user: str) -> NatsAuth:
    """How ``user`` connects to a running ``pdserve up``'s broker whose credentials are
    under ``directory`` (``<data-dir>/nats/auth``): for operators' tools and tests."""
    return NatsAuth(user=user, password=read_password(EmbeddedCredentials.password_file(directory, user)))


def _new_password() -> str:
    return secrets.token_urlsafe(32)
