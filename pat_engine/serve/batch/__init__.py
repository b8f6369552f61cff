"""``pat-serve batch``: the JSONL job (``job``), its input and output lines (``lines``), tail-batched rounds
(``rounds``), the run's summary (``summary``) and the timeline plot (``report``)."""
