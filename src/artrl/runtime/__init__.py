"""Process plumbing: the C heap and glibc's allocator thresholds, torch's thread count, the exit hook that
stops engines and servers, once-per-process notices, durable file writes, progress bars.

Imports nothing of artrl: every other package may use it.
"""
