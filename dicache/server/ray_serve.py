"""The earlier import path of the Ray Serve application builder, kept for Serve configs and KubeRay manifests that
name it: `dicache.server.ray_serve:app_builder` is `dicache.server.ray.builder:app_builder`."""

from __future__ import annotations

from .ray.builder import app_builder

__all__ = ["app_builder"]
