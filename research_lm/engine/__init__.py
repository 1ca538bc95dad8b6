"""The host side of a run: the engine's step loop, the scheduler, requests, the KV block pool and the metrics."""
