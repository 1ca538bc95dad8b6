"""Errors a run can end with that are the setup's, not a bug: the CLI prints them in one line (harness/cli_checks.py).
Kept free of heavy imports, so the CLI's checks import them without torch.distributed."""

from __future__ import annotations


class RankLostError(RuntimeError):
    """A collective failed: another rank exited, crashed or stopped answering within the timeout."""
