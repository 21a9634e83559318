"""Time of each bad-input refusal of `sao train` after imports: cli.main(["train", BAD]) 5 times each, in process.

    python benchmarks/refusals.py

Prints the import time once, then per refusal its exit code, median and max milliseconds and the one line it printed.
"""

import contextlib
import io
import statistics
import time

t0 = time.perf_counter()
import torch  # noqa: E402,F401

import sao.runtime.preflight  # noqa: E402,F401
from sao import cli  # noqa: E402

BAD = ["env.name=nope", "model.path=missing", "algo.name=nope", "runtime.sync_every=9", "critic.path=missing",
       "env.options.max_ops=0", "train.batch_size=abc"]

if __name__ == "__main__":
    print(f"imports {time.perf_counter() - t0:.2f} s")
    for arg in BAD:
        times, err = [], io.StringIO()
        for _ in range(5):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                t = time.perf_counter()
                rc = cli.main(["train", arg])
                times.append(time.perf_counter() - t)
        print(f"{arg:28s} rc={rc} median {statistics.median(times) * 1000:.0f} ms  max {max(times) * 1000:.0f} ms  "
              f"{err.getvalue().strip()[:90]}")
