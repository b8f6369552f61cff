"""pat-serve: the batch job, the OpenAI-compatible server, the timeline report and the demo.

Modules: ``cli`` (the ``pat-serve`` command), ``engine_args`` (engine options shared by the
subcommands), ``batch`` / ``batch_io`` (the JSONL job and its line formats), ``server`` /
``streams`` / ``async_engine`` / ``launcher`` (the HTTP server), ``openai_protocol`` /
``translate`` / ``errors`` (the OpenAI schemas and their mapping onto the engine), ``metrics``
(Prometheus), ``report`` (the timeline plot), ``summary``, ``demo``.
"""
