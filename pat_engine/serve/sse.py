"""Server-sent events: the response every streaming route returns (OpenAI's chunks, SGLang's objects)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import StreamingResponse


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """``events``: ``data: ...\\n\\n`` lines, sent as they come."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
