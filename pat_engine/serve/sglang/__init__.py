"""SGLang's native server API for pat-serve (``/generate``, control, weight sync, info), so slime, AReaL and
sglang-router can drive pat-engine unchanged. ``register_sglang_routes`` adds it to the app."""

from pat_engine.serve.sglang.routes import register_sglang_routes

__all__ = ["register_sglang_routes"]
