"""Console sessions and CSRF tokens.

The session cookie holds the API key the user signed in with, encrypted and authenticated
with Fernet (AES-128-CBC + HMAC-SHA256) under a server secret, never in the clear: each
request authenticates that key through the same machinery as a Bearer key (rate limits,
the auth cache, revocation takes effect at once). The cookie is HttpOnly, SameSite=Strict,
scoped to ``/console`` and expires after ``SESSION_SECONDS``.

CSRF: every form carries ``HMAC(secret, "csrf:" + session id)``; the session id is random
per sign-in and lives only inside the encrypted cookie. The sign-in form, before there is
a session, uses a random nonce cookie the same way (login CSRF).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

SESSION_COOKIE = "gpucloud_session"
LOGIN_COOKIE = "gpucloud_login"
COOKIE_PATH = "/console"
SESSION_SECONDS = 12 * 3600
SECRET_FILE = "console.secret"


@dataclass(frozen=True)
class Session:
    api_key: str
    session_id: str


class SessionKeeper:
    """Seals and opens session cookies, makes and checks CSRF tokens."""

    def __init__(self, secret: bytes) -> None:
        self._mac_key = hashlib.sha256(b"gpucloud-console-csrf" + secret).digest()
        self._fernet = Fernet(_fernet_key(secret))

    def seal(self, api_key: str) -> str:
        payload = json.dumps({"k": api_key, "s": secrets.token_urlsafe(18)})
        return self._fernet.encrypt(payload.encode()).decode()

    def open(self, cookie: str | None) -> Session | None:
        """The session in a cookie; None when absent, forged, tampered with or expired."""
        if not cookie:
            return None
        try:
            data = json.loads(self._fernet.decrypt(cookie.encode(), ttl=SESSION_SECONDS))
        except (InvalidToken, ValueError):
            return None
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str)
                                                 for k in ("k", "s")):
            return None
        return Session(api_key=data["k"], session_id=data["s"])

    def token(self, purpose: str, value: str) -> str:
        return hmac.new(self._mac_key, f"{purpose}:{value}".encode(), "sha256").hexdigest()

    def check(self, purpose: str, value: str | None, offered: str | None) -> bool:
        if not value or not offered:
            return False
        return hmac.compare_digest(self.token(purpose, value), offered)


def _fernet_key(secret: bytes) -> bytes:
    return base64.urlsafe_b64encode(hashlib.sha256(b"gpucloud-console-session" + secret)
                                    .digest())


def load_secret(home: Path) -> bytes:
    """The server's console secret (``$GPUCLOUD_HOME/console.secret``, made once, 0600).

    Replicas that share a home share sessions; otherwise a user signs in per replica."""
    path = home / SECRET_FILE
    if path.exists():
        return path.read_bytes()
    home.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_bytes()
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
    return secret
