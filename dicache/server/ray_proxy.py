"""The earlier import path of Serve's proxy callback, kept for clusters whose environment names it:
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=dicache.server.ray_proxy:proxy_middlewares` is
`dicache.server.ray.proxy:proxy_middlewares`. Like it, this module imports neither Ray nor torch."""

from __future__ import annotations

from .ray.proxy import proxy_middlewares

__all__ = ["proxy_middlewares"]
