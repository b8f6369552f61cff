"""pat-profile: the offline profiler behind the latency predictor (paper Sec. 4.2, "Offline Profiler")."""
