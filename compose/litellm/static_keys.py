"""LiteLLM custom auth for a proxy without a database: API keys listed in the environment.

LiteLLM's virtual keys (``/key/generate``, budgets, spend) need its PostgreSQL database; without
one the proxy accepts only its master key and answers any other key with ``No connected db``.
This module gives each client its own key all the same: ``LITELLM_STATIC_KEYS`` holds
``name=key`` pairs separated by commas, and a request is let in only with one of those keys (or
the master key, ``LITELLM_MASTER_KEY``) as ``Authorization: Bearer <key>``. The key's name becomes
the request's ``user_id`` and ``key_alias`` in LiteLLM's logs and metrics.

Enabled with ``general_settings: {custom_auth: static_keys.user_api_key_auth}`` in the proxy's
config; the file lives next to the config (LiteLLM imports it from the config's directory).
"""

from __future__ import annotations

import hmac
import os

from fastapi import HTTPException, Request
from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth


def _keys() -> dict[str, str]:
    """key -> name, from LITELLM_STATIC_KEYS (``name=key,name=key``); malformed entries fail."""
    out: dict[str, str] = {}
    for item in os.environ.get("LITELLM_STATIC_KEYS", "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, key = item.partition("=")
        if not sep or not name.strip() or len(key.strip()) < 16:
            raise ValueError(
                "LITELLM_STATIC_KEYS entries are name=key with a key of 16 characters or more"
            )
        out[key.strip()] = name.strip()
    return out


KEYS = _keys()


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    """Lets in the master key (as proxy admin) and the listed keys; 401 for anything else."""
    master = os.environ.get("LITELLM_MASTER_KEY", "")
    if master and hmac.compare_digest(api_key.encode(), master.encode()):
        return UserAPIKeyAuth(api_key=api_key, user_role=LitellmUserRoles.PROXY_ADMIN)
    for key, name in KEYS.items():
        if hmac.compare_digest(api_key.encode(), key.encode()):
            return UserAPIKeyAuth(
                api_key=api_key,
                user_id=name,
                key_alias=name,
                user_role=LitellmUserRoles.INTERNAL_USER,
            )
    raise HTTPException(status_code=401, detail="invalid API key")
