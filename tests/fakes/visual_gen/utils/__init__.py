from __future__ import annotations

from .setup_configs import create_default_dit_configs, setup_configs

__all__ = ["setup_configs", "create_default_dit_configs"]
