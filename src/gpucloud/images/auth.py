"""Registry authentication: the Docker token handshake and basic auth, as an ``httpx.Auth``.

A registry answers an unauthenticated request with ``401`` and a challenge:

* ``Basic realm=…``: resend with the configured username and password;
* ``Bearer realm=URL,service=S,scope=…``: ask the token service at ``URL`` for a token for
  that service and scope (anonymously, or with basic credentials, which is how Docker Hub
  and GHCR serve public images to anyone and private ones to their owners), then resend
  with ``Authorization: Bearer TOKEN``.

The resulting header is cached per registry host and repository until the token expires,
so the many parallel blob requests of one pull pay for the handshake once. The token
request is yielded from the auth flow, so it goes through the same (injectable) transport.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass

import httpx

from gpucloud.images.errors import RegistryUnauthorized, RegistryUnavailable

_PARAM_RE = re.compile(r'\s*([A-Za-z0-9_-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))\s*,?')
_REPO_PATH_RE = re.compile(r"^/v2/(?P<name>.+?)/(?:manifests|blobs|tags)/")
_DEFAULT_TOKEN_LIFETIME = 60.0
_EXPIRY_MARGIN = 10.0


@dataclass(frozen=True)
class Credentials:
    """A username and password (or personal access token) for one registry."""

    username: str
    password: str

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password=***)"


@dataclass(frozen=True)
class Challenge:
    """A parsed ``WWW-Authenticate`` header: scheme (lowercased) and its parameters."""

    scheme: str
    params: Mapping[str, str]


def parse_challenge(header: str) -> Challenge | None:
    """Parse ``Bearer realm="…",service="…",scope="…"`` (or ``Basic realm=…``)."""
    scheme, _, rest = header.strip().partition(" ")
    if not scheme:
        return None
    params: dict[str, str] = {}
    for match in _PARAM_RE.finditer(rest):
        quoted, bare = match.group(2), match.group(3)
        value = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
        params[match.group(1).lower()] = value
    return Challenge(scheme.lower(), params)


class RegistryAuth(httpx.Auth):
    """Answers registry challenges; thread-safe so parallel downloads share one cache."""

    def __init__(self, credentials: Mapping[str, Credentials]) -> None:
        self._credentials = dict(credentials)
        self._cache: dict[tuple[str, str], tuple[str, float]] = {}
        self._lock = threading.Lock()

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        key = (request.url.netloc.decode("ascii"), _repository_of(request.url.path))
        cached = self._cached(key)
        if cached is not None:
            request.headers["Authorization"] = cached
        response = yield request
        if response.status_code != 401:
            return
        challenge = parse_challenge(response.headers.get("WWW-Authenticate", ""))
        if challenge is None:
            return
        creds = self._credentials.get(key[0])
        header = yield from self._answer(challenge, creds, key)
        if header is None:
            return
        request.headers["Authorization"] = header
        yield request

    def _answer(
        self, challenge: Challenge, creds: Credentials | None, key: tuple[str, str]
    ) -> Generator[httpx.Request, httpx.Response, str | None]:
        if challenge.scheme == "basic":
            if creds is None:
                return None
            header = _basic_header(creds)
            self._store(key, header, float("inf"))
            return header
        if challenge.scheme != "bearer" or "realm" not in challenge.params:
            return None
        token_response = yield self._token_request(challenge, creds, key[1])
        token_response.read()
        token, lifetime = _read_token(token_response, key[0], creds)
        header = f"Bearer {token}"
        self._store(key, header, time.monotonic() + lifetime - _EXPIRY_MARGIN)
        return header

    def _token_request(
        self, challenge: Challenge, creds: Credentials | None, repository: str
    ) -> httpx.Request:
        params = {k: v for k, v in challenge.params.items() if k in ("service", "scope")}
        if "scope" not in params and repository:
            params["scope"] = f"repository:{repository}:pull"
        headers = {}
        if creds is not None:
            params["account"] = creds.username
            headers["Authorization"] = _basic_header(creds)
        return httpx.Request("GET", challenge.params["realm"], params=params, headers=headers)

    def _cached(self, key: tuple[str, str]) -> str | None:
        with self._lock:
            entry = self._cache.get(key)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]

    def _store(self, key: tuple[str, str], header: str, expires: float) -> None:
        with self._lock:
            self._cache[key] = (header, expires)


def _basic_header(creds: Credentials) -> str:
    raw = f"{creds.username}:{creds.password}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


def _repository_of(path: str) -> str:
    match = _REPO_PATH_RE.match(path)
    return match.group("name") if match else ""


def _read_token(
    response: httpx.Response, registry: str, creds: Credentials | None
) -> tuple[str, float]:
    """The token and its lifetime in seconds, from a token service's answer."""
    if response.status_code in (401, 403):
        who = f"user {creds.username!r}" if creds else "anonymous access"
        raise RegistryUnauthorized(f"the token service of {registry} refused {who}")
    if response.status_code != 200:
        raise RegistryUnavailable(
            f"the token service of {registry} answered HTTP {response.status_code}"
        )
    try:
        body = response.json()
    except ValueError as exc:
        raise RegistryUnavailable(f"the token service of {registry} sent no JSON") from exc
    if not isinstance(body, dict):
        raise RegistryUnavailable(f"the token service of {registry} sent no token")
    token = body.get("token") or body.get("access_token")
    if not isinstance(token, str) or not token:
        raise RegistryUnavailable(f"the token service of {registry} sent no token")
    lifetime = body.get("expires_in")
    if not isinstance(lifetime, int | float) or lifetime <= 0:
        lifetime = _DEFAULT_TOKEN_LIFETIME
    return token, float(lifetime)
