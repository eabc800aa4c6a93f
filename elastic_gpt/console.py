"""What a user reads on the console: the `[elastic-gpt]` lines, the log format, and errors cut
to one line.

- `say(line)` writes one user-facing line (run, resume, progress, done) to stdout.
- `setup_logging(...)` is called once, by an entry point (`elastic-gpt`, the preemption
  watcher); every other module only does `log = logging.getLogger(__name__)`, so logger names
  follow the package layout under the `elastic_gpt` root.
- `first_line(e)` / `last_line(e)` turn an exception into the one-line reason a message quotes.

Everything imports this module, so it imports nothing of elastic_gpt, Ray or torch.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "[elastic-gpt] %(levelname)s %(name)s: %(message)s"


def say(line: str) -> None:
    """One line to the job's output. Not print(): Ray Train patches print into its logger, which
    echoes each line twice in `ray job logs`."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def setup_logging(level: int | str = logging.INFO, stream=None, timestamps: bool = False) -> None:
    """One handler on the root logger, so third-party warnings (Ray, MLflow) show in the same
    format as ours. Does nothing when the process has set up logging already (a test harness,
    a program that embeds `cli.main`): basicConfig's rule, so calling this twice adds no handler."""
    fmt = ("%(asctime)s " if timestamps else "") + LOG_FORMAT
    logging.basicConfig(level=level, format=fmt, stream=stream)


def first_line(e: BaseException) -> str:
    """The first line of an error's message, or its type's name when the message is empty."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def last_line(e: BaseException) -> str:
    """The last non-blank line of an error's message (or its type's name): for errors that put
    the root cause at the end, like the ones torch's distributed checkpoint collects per rank."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__
