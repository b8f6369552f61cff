"""SGLang's native server API for pat-serve (``/generate``, control, weight sync, info), so slime, AReaL and
sglang-router can drive pat-engine unchanged: ``routes.router`` and ``weight_routes.router``, which
``serve/server.py`` includes in the app."""
