"""How the HTTP server treats its clients, apart from the engine: API keys, CORS, request limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.server.limits import RequestLimits


@dataclass(slots=True)
class ServerOptions:
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    # CORS, as vLLM's defaults: any origin, method and header; no credentials
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json (vLLM's --disable-fastapi-docs turns them off)
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)
