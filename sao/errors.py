"""The errors that end a command with one line, grouped by what they mean to the command line (sao/cli.py
catches them by type): a run that stopped itself exits 1, a failed write 74. Each is raised where it is
found and subclasses one of these; this module imports nothing, so every package may use it.

    RunStopped    the run cannot go on and says why in one line: the parity gate (ParityError), no
                  trajectory arriving (StalledError), a crash-looping worker (WorkerCrashLoop), non-finite
                  losses (NonFiniteError), a dead trainer rank or critic process (RankFailed), most
                  episodes failing (TooManyFailures)
    WriteError    a file of the run could not be written (a full disk, a read-only mount); what was
                  written before is intact
"""

from __future__ import annotations


class RunStopped(Exception):
    """The run stopped itself; the message is the one line the user sees (exit code 1). Not a RuntimeError:
    a checkpoint write that fails with one is a failed write (sao/runtime/checkpoint.py); these are not."""


class WriteError(Exception):
    """A run's file could not be written (a full disk, a read-only mount): an I/O failure, not bad input."""
