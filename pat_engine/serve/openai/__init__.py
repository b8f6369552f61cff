"""The OpenAI-compatible face: ``routes.router`` (completions, chat, models), the request and response
schemas (``protocol``), their mapping onto the engine (``translate``, shared with the batch job), and
the server-sent-event chunks (``streams``)."""
