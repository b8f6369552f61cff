"""Tags a model writes into its answer (``<think>``, ``<tool_call>``): what a stream must hold back."""


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag`` (held until the next text)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
