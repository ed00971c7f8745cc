"""An evaluation's progress, one update per decoded prompt: prompts done of the total, τ so far, the decoding's
tokens/s and the time left. A tqdm bar where stderr is a terminal; elsewhere (a log file, a pipe, Ray's log
forwarding) one plain log line per prompt, since a bar's redraws would fill a log with carriage returns.

    progress = EvalProgress("eval T=1.0", total=60, log=get_logger("dspark.eval"))
    progress.update(rounds=12, accepted=3, tokens=64, seconds=5.8)   # after each prompt (evaluate.evaluate_many)
    progress.close()
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class EvalProgress:
    def __init__(self, label: str, total: int, log: logging.Logger | None = None, stream: TextIO | None = None
                 ) -> None:
        self.label, self.total, self.log = label, total, log
        self.done = self.rounds = self.accepted = self.tokens = 0
        self.decode_s = 0.0
        self.t0 = time.monotonic()
        stream = stream if stream is not None else sys.stderr
        self.bar = None
        if stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="prompt", file=stream, dynamic_ncols=True)

    @property
    def tau(self) -> float:
        """Accepted draft tokens per round + 1, over every round so far (what the report's τ averages)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else math.nan

    def update(self, rounds: int, accepted: int, tokens: int, seconds: float) -> str:
        """One prompt decoded: its rounds, accepted draft tokens, new tokens and decoding seconds. Returns the line."""
        self.done += 1
        self.rounds, self.accepted, self.tokens = self.rounds + rounds, self.accepted + accepted, self.tokens + tokens
        self.decode_s += seconds
        tok_s = self.tokens / self.decode_s if self.decode_s > 0 else math.nan
        left = (time.monotonic() - self.t0) / self.done * (self.total - self.done)
        line = (f"{self.label}: {self.done}/{self.total} prompts | tau {self.tau:.3f} | {tok_s:.1f} tok/s | "
                f"{_duration(left)} left")
        if self.bar is not None:
            self.bar.set_postfix_str(f"tau {self.tau:.3f}, {tok_s:.1f} tok/s", refresh=False)
            self.bar.update(1)
        elif self.log is not None:
            self.log.info(line)
        return line

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
