"""pat-serve: the batch job, the HTTP server with its faces, the timeline report and the demo.

Modules: ``cli`` (the ``pat-serve`` command), ``engine_args`` (engine options shared by the
subcommands), ``batch/`` (the JSONL job: ``job``, its line formats ``lines``, tail-batched
``rounds``, the run ``summary`` and the timeline plot ``report``), ``server`` (``build_app``:
the app and its routers) with ``state`` (what every route shares), ``async_engine``,
``launcher``, ``guard``, ``errors``, ``metrics``, ``sse``; the faces, each a FastAPI router:
``openai/`` (completions, chat, models: ``routes``, ``protocol``, ``translate``, ``streams``),
``sglang/`` (SGLang's native API, weight sync and memory routes) and ``pat_routes`` (health,
metrics, KV, timeline, reconfigure); ``demo``.
"""
