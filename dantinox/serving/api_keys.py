"""API keys: ``serve --api-key KEY`` (or the DANTINOX_API_KEY variable) makes every request show a key.

  1. Keys come from the repeatable --api-key flag, or when it is not given from DANTINOX_API_KEY (one key, or
     several separated by commas; the variable keeps them out of the process list). Empty keys are refused
     (``parse_api_keys``).
  2. With keys, every path answers 401 unless the request carries one of them as ``Authorization: Bearer
     KEY`` (OpenAI's form, what the openai client sends) or ``X-Api-Key: KEY`` (Anthropic's form, which
     llama-server also accepts), except GET /health, /ready and /metrics, which probes and scrapers reach
     without a key unless --api-key-all is given. The 401 body is OpenAI's error object with type
     authentication_error and code invalid_api_key (``api_errors``); a missing key and a wrong key get
     different messages, neither repeats the key sent.
  3. The key sent is compared with every configured key with ``hmac.compare_digest`` (time independent of
     where the strings differ), and with all of them whichever matches, so the answer's time does not tell
     which key came close or how many there are.
  4. Without keys, a server bound to an address other than loopback logs a warning at start
     (``exposure_warning``): anyone who reaches the port can use it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os

from .api_errors import unauthorized_body

ENV_VAR = "DANTINOX_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def parse_api_keys(flag_values: list | None, environ=None) -> tuple[str, ...]:
    """The configured keys: --api-key's values, else DANTINOX_API_KEY split on commas, else none. Raises
    ValueError naming the flag or the variable for an empty key."""
    environ = os.environ if environ is None else environ
    if flag_values:
        keys, source = list(flag_values), "--api-key"
    else:
        text = environ.get(ENV_VAR)
        if text is None:
            return ()
        keys, source = [k.strip() for k in text.split(",")], ENV_VAR
    if any(not k for k in keys):
        raise ValueError(f"{source}: an API key is empty; give non-empty keys ({ENV_VAR} separates several with "
                         "commas)")
    return tuple(dict.fromkeys(keys))


def key_matches(sent: str, keys: tuple[str, ...]) -> bool:
    """True when ``sent`` equals one of ``keys``, compared in constant time against every key."""
    sent_bytes = sent.encode("utf-8")
    found = False
    for key in keys:
        found |= hmac.compare_digest(sent_bytes, key.encode("utf-8"))
    return found


def sent_key(headers) -> str | None:
    """The key a request carries: the Bearer token of Authorization, else X-Api-Key; None without one.
    headers: ASGI scope headers [(name bytes, value bytes)]."""
    found = {}
    for name, value in headers:
        found.setdefault(name.lower(), value.decode("latin-1"))
    auth = found.get(b"authorization", "")
    scheme, _, token = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return found.get(b"x-api-key") or None


class ApiKeyAuth:
    """ASGI middleware answering 401 (OpenAI's error object) to requests without one of ``keys``.

    app: the ASGI app; keys: the configured keys (none: every request passes); protect_all: also guard
    OPEN_PATHS (--api-key-all); on_reject: called once per refused request (the server counts it in
    dantinox_requests_rejected_total{reason="unauthorized"}).
    """

    def __init__(self, app, keys: tuple[str, ...] = (), protect_all: bool = False, on_reject=None):
        self.app, self.keys, self.protect_all, self.on_reject = app, tuple(keys), protect_all, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or self._open(scope):
            return await self.app(scope, receive, send)
        sent = sent_key(scope.get("headers", ()))
        if sent is not None and key_matches(sent, self.keys):
            return await self.app(scope, receive, send)
        if self.on_reject is not None:
            self.on_reject()
        message = ("Missing API key: send it as 'Authorization: Bearer <key>' (this server was started with "
                   "--api-key)" if sent is None else "Incorrect API key provided")
        payload = json.dumps(unauthorized_body(message)).encode("utf-8")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode("ascii")),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": payload})

    def _open(self, scope) -> bool:
        return not self.protect_all and scope.get("method") in ("GET", "HEAD") and scope.get("path") in OPEN_PATHS


def is_loopback(host: str) -> bool:
    """True for a host that only this machine reaches: a loopback address or "localhost"."""
    name = host.strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, keys: tuple[str, ...]) -> str | None:
    """The start-up warning for a server bound beyond loopback without an API key, else None."""
    if keys or is_loopback(host):
        return None
    return (f"warning: serving on {host} without an API key: anyone who can reach this port can generate with "
            f"this model; set --api-key or {ENV_VAR}, or bind --host 127.0.0.1")
